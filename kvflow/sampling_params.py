"""Per-request sampling options, named as in vLLM and validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.structured_output.params import StructuredOutputsParams
from kvflow.utils.validation import is_int

_GREEDY_EPS = 1e-5
# Limits a request can reach (the server's and the offline API's alike; docs/serving.md lists them).
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_ALLOWED_TOKEN_IDS = 262144  # entries of allowed_token_ids (beyond any vocabulary served)
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 256  # bad_words: words, and characters in one
LOGIT_BIAS_LIMIT = 100.0  # |bias|, as OpenAI
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM
# An expert trace (return_expert_trace) holds one entry per token and MoE layer: at most this many
# (prompt + max_tokens) x MoE layers per completion; more is refused when the request is added.
MAX_EXPERT_TRACE_ENTRIES = 131072
POOLING_MODES = ("last", "mean")  # embeddings: the last prompt token's hidden state, or all tokens' mean


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs besides the sampled token
    # vLLM's: the logprob of every prompt token but the first, with this many top logprobs
    # (`RequestOutput.prompt_logprobs`); the request then computes its whole prompt (no prefix hit).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's; only a slow tokenizer puts spaces between special tokens, and kvflow loads fast
    # tokenizers only (their decode is the same either way): accepted, with nothing to change
    spaces_between_special_tokens: bool = True
    # token id -> added to its logit before sampling (OpenAI's logit_bias; -100 bans a token)
    logit_bias: dict[int, float] | None = None
    # vLLM's: sample only among these token ids
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output never contains as whole tokens (kvflow.sample.bad_words)
    bad_words: list[str] | None = None
    # vLLM's: a stop string that ends the output stays at its end
    include_stop_str_in_output: bool = False
    # vLLM's: keep only the prompt's last N tokens (-1: the last max_model_len), dropping its start
    truncate_prompt_tokens: int | None = None
    # a JSON schema, regex, choice or grammar the output must follow (see structured_output/)
    structured_outputs: StructuredOutputsParams | None = None
    # Scheduling (vLLM's priority: lower first; SLOs for the slo policy and the goodput metrics;
    # None: the server's default, if any)
    priority: int = 0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # Prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true} asks a producer engine
    # to hold the prompt's KV for a decode engine; the params it returns ({"do_remote_prefill": true,
    # "remote_host", ...}) tell the decode engine where to fetch it. See kvflow/kv_transfer/.
    kv_transfer_params: dict[str, Any] | None = None
    # kvflow's: a Mixture-of-Experts model returns, with the finished completion, the experts each
    # of its tokens was routed to per MoE layer and the distance in tokens since each was last
    # active (`CompletionOutput.expert_trace`); bounded by MAX_EXPERT_TRACE_ENTRIES.
    return_expert_trace: bool = False
    # An embedding request (LLM.embed, /v1/embeddings): "last" | "mean" pools the prompt's final
    # hidden states; it ends after its prefill with `RequestOutput.embedding`, never sampling.
    pooling: str | None = None
    # Filled by the engine: EOS ids of the model, the token sequences of bad_words (not user fields).
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, cond: str) -> ValueError:
            return ValueError(f"{name} must be {cond}, got {_short(getattr(self, name))}")

        def number(name: str, lo: float | None, hi: float | None, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "a finite number")
            if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
                raise bad(name, _range(lo, hi, lo_open))

        def integer(name: str, lo: int, hi: int | None = None, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not is_int(v) or v < lo or (hi is not None and v > hi):
                raise bad(name, f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")

        integer("n", 1, MAX_N)
        number("temperature", 0, None)
        number("top_p", 0, 1, lo_open=True)
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "0 or -1 (disabled) or a positive integer")
        number("min_p", 0, 1)
        number("presence_penalty", -2, 2)
        number("frequency_penalty", -2, 2)
        number("repetition_penalty", 0, None, lo_open=True)
        integer("seed", SEED_MIN, SEED_MAX, optional=True)
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        integer("logprobs", 0, optional=True)  # (its limit: the engine's max_logprobs)
        integer("prompt_logprobs", 0, optional=True)
        for name in ("ignore_eos", "skip_special_tokens", "return_expert_trace", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {_short(s)}")
            check_text(s, "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
            )
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {_short(self.stop_token_ids)}")
        self._validate_logit_bias()
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids or any(not is_int(t) or t < 0 for t in ids):
                raise bad("allowed_token_ids", "a non-empty list of non-negative token ids")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids holds {len(ids)} ids; at most {MAX_ALLOWED_TOKEN_IDS} are allowed")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list) or any(not isinstance(w, str) or not w.strip() for w in words):
                raise bad("bad_words", "a list of non-empty strings")
            if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in words):
                raise ValueError(
                    f"bad_words holds at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} characters each"
                )
            for w in words:
                check_text(w, "bad_words")
        if self.truncate_prompt_tokens is not None and (
            not is_int(self.truncate_prompt_tokens)
            or not (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
        ):
            raise bad("truncate_prompt_tokens", "a positive integer, or -1 (the last max_model_len tokens)")
        if not is_int(self.priority) or not SEED_MIN <= self.priority <= SEED_MAX:
            raise bad("priority", "an integer (lower is served first)")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            if getattr(self, name) is not None:
                number(name, 0, None, lo_open=True)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )
        if self.kv_transfer_params is not None:
            if not isinstance(self.kv_transfer_params, dict):
                raise bad("kv_transfer_params", "a JSON object")
            if self.n != 1:
                raise ValueError(f"kv_transfer_params needs n=1, got n={self.n}")
            if self.prompt_logprobs is not None and self.kv_transfer_params.get("do_remote_prefill"):
                raise ValueError(
                    "prompt_logprobs cannot be combined with a remote prefill (the prompt's KV comes from "
                    "another engine, its logits are not computed here)"
                )
        if self.pooling is not None:
            if self.pooling not in POOLING_MODES:
                raise bad("pooling", f"one of {list(POOLING_MODES)}")
            if self.n != 1:
                raise ValueError(f"pooling needs n=1, got n={self.n}")
            if self.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs cannot be combined with pooling (an embedding request)")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a map of token id to bias, got {_short(bias)}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds {len(bias)} tokens; at most {MAX_LOGIT_BIAS} are allowed")
        for token, value in bias.items():
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {_short(token)}")
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or abs(value) > LOGIT_BIAS_LIMIT
            ):
                raise ValueError(
                    f"logit_bias for token {token} must be a number in [-{LOGIT_BIAS_LIMIT:g}, "
                    f"{LOGIT_BIAS_LIMIT:g}], got {_short(value)}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of n completions: each gets its own seed stream (seed + index,
        wrapped into int64)."""
        seed = None if self.seed is None else (self.seed + index - SEED_MIN) % 2**64 + SEED_MIN
        return replace(self, n=1, seed=seed)


def check_text(text: str, what: str) -> None:
    """Refuse a string that is not valid Unicode (a lone surrogate, e.g. "\\ud800" in JSON): no
    tokenizer or UTF-8 encoder downstream can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}"
        ) from None


def _range(lo: float | None, hi: float | None, lo_open: bool) -> str:
    if hi is None:
        return f"> {lo}" if lo_open else f">= {lo}"
    return f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"


def _short(v: Any, limit: int = 60) -> str:
    """repr of a user value, cut so an error message never echoes a long input back."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."
