"""`SpeculativeConfig`: vLLM's `speculative_config` dict, typed and validated.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/path/to/small-llama", "num_speculative_tokens": 3}
    {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3}  # self-draft

Defaults (ngram): neither bound given -> min 2, max 4 (a 1-token match predicts too poorly to be
worth a verification step; 4 tokens already pin down quotes and code; vLLM picks 5 and 5). Only
one given -> the other equals it, as in vLLM. A draft_model without a model drafts with the target
model itself, quantized (int8 weights: a cheaper forward with nearly the same distribution).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
QUANTIZATIONS = (None, "int8")
_DEFAULT_LOOKUP = (2, 4)  # (min, max) when neither is given


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts proposed per request per step (at most)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix to match
    prompt_lookup_max: int | None = None  # ngram: longest suffix to match (tried first)
    model: str | None = None  # draft_model: HF folder or .gguf of the draft; None = self-draft
    quantization: str | None = None  # draft_model: None | "int8" (the draft's weights)
    # Let the engine propose fewer than k for a request whose drafts keep being rejected.
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        _int_at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_config quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.method == "ngram":
            for name in ("model", "quantization"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config {name} applies to method 'draft_model', not 'ngram'")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo, hi = _DEFAULT_LOOKUP
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            _int_at_least("prompt_lookup_min", lo, 1)
            _int_at_least("prompt_lookup_max", hi, 1)
            if lo > hi:
                raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config {name} applies to method 'ngram', not 'draft_model'")
            if self.model is not None and (not isinstance(self.model, str) or not self.model):
                raise ValueError(f"speculative_config model must be a path, got {self.model!r}")
            if self.model is None and self.quantization is None:
                raise ValueError(
                    "speculative_config method 'draft_model' needs a model (a path) or "
                    "quantization='int8' (self-draft: the target model quantized)"
                )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; valid keys: {names}")
        for name in ("method", "num_speculative_tokens"):
            if name not in d:
                raise ValueError(
                    f"speculative_config needs {name!r}" + (f" (one of {METHODS})" if name == "method" else "")
                )
        return cls(**d)


def _int_at_least(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"speculative_config {name} must be an integer >= {lo}, got {value!r}")
