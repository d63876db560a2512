"""vLLM's `bad_words`: strings the output never contains as whole tokens.

Each word becomes the token sequences it is written as: on its own and after a space (the form it
takes inside text, for tokenizers that fold the space into the word's first token). A sequence of
one token bans that token at every step; a longer one bans its last token wherever the output so
far ends with the rest of it. Only the output counts (a word in the prompt is no reason to ban its
continuation), and text the model spells with other tokens is not caught: the ban is on these
token sequences, as vLLM's is. No torch here but the masking of one request's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def bad_word_sequences(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """The token sequences each word is banned as (`encode`: text -> ids, no special tokens)."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = tuple(encode(text))
            if ids:
                out[ids] = None
    return tuple(out)


def banned_next(output: Sequence[int], sequences: Sequence[tuple[int, ...]]) -> list[int]:
    """The tokens that may not come after `output`: each sequence's last token where `output`
    ends with the sequence's other tokens."""
    banned = []
    for seq in sequences:
        head = seq[:-1]
        if len(output) >= len(head) and (not head or tuple(output[len(output) - len(head) :]) == head):
            banned.append(seq[-1])
    return banned


def ban_bad_words(
    rows: torch.Tensor, output: Sequence[int], drafts: Sequence[int], sequences: Sequence[tuple[int, ...]]
) -> None:
    """-inf, in place, for the banned tokens of a request's rows: row j samples (or verifies)
    the token after `output` + drafts[:j]. Only the last (longest sequence - 1) tokens matter, so
    only those are read, however long the output."""
    reach = max(len(s) for s in sequences) - 1
    tail = list(output[max(0, len(output) - reach) :]) if reach else []
    for j in range(rows.shape[0]):
        banned = banned_next(tail + list(drafts[:j]), sequences)
        if banned:
            rows[j, torch.tensor(banned, dtype=torch.long, device=rows.device)] = float("-inf")
