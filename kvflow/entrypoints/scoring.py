"""Scores of text pairs from the served model's embeddings, as vLLM's `LLM.score`, `/score` and
`/rerank` give them for an embedding model: the cosine similarity of the two texts' pooled,
L2-normalised final hidden states (`--pooling`), in [-1, 1]. Each distinct text is embedded
once. (A cross-encoder's classifier head, which scores a pair in one pass, is not among the
models kvflow runs.)"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pair_indices(n1: int, n2: int) -> list[tuple[int, int]]:
    """vLLM's pairing of text_1 and text_2: one text_1 against each text_2, or pairwise."""
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 == n2:
        return [(i, i) for i in range(n1)]
    raise ValueError(
        f"text_1 holds {n1} texts and text_2 {n2}: give a single text_1 (scored against each "
        "text_2) or as many of each (scored in pairs)"
    )


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors, summed in float64 (0 if either is zero)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0
