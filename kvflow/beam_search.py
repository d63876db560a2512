"""Beam search: vLLM's `LLM.beam_search` and the server's `use_beam_search`, selecting beams by
HF transformers' rules (`generate(num_beams=W)`, its default `early_stopping=False`).

Each step, every running beam's next-token log-probabilities extend it; of all (beam, token)
candidates, the K = max(2, 1 + number of stop tokens) x W with the highest cumulative
log-probability are kept. Those ending in a stop token (EOS, `stop_token_ids`) or reaching the
length limit finish if they rank among the first W, scored cumulative log-probability / (output
length ** length_penalty); the W best unfinished ones run on. The search ends at the length limit,
when no candidate can continue, or once W beams have finished and the best running beam's score
at its current length is no better than the worst of them (HF's stopping rule; with
length_penalty > 0 a longer beam could still have won, as in HF). The W best finished beams are
the result, best first.

The search runs above the engine, one step at a time (`BeamSearch.pending` / `advance`): every
running beam is one engine request for one token with its top log-probabilities, and prefix
caching keeps what the beams share, so a step recomputes at most a beam's last partial KV block.
The scheduler, the model and the kernels know nothing of beams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvflow.outputs import Logprob
from kvflow.sampling_params import SamplingParams
from kvflow.utils.validation import is_int


@dataclass
class BeamSearchParams:
    """As vLLM's `BeamSearchParams` (temperature aside: beams are ranked by the model's own
    log-probabilities), with `min_tokens` and `stop_token_ids` as `SamplingParams` has them."""

    beam_width: int
    max_tokens: int | None = None  # None: up to max_model_len
    ignore_eos: bool = False  # the model's EOS tokens do not end a beam (stop_token_ids still do)
    length_penalty: float = 1.0  # the score's exponent of the output length (HF's length_penalty)
    min_tokens: int = 0  # no stop token before this many output tokens
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the stop token's text ends the text
    logprobs: int | None = None  # the top log-probabilities of each output token, as SamplingParams'

    def __post_init__(self) -> None:
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(
                f"max_tokens must be an integer >= 1 (or None: up to the context), got {self.max_tokens!r}"
            )
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        ids = self.stop_token_ids or []
        if not isinstance(ids, list) or not all(is_int(t) and t >= 0 for t in ids):
            raise ValueError("stop_token_ids must be a list of token ids (integers >= 0)")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")


@dataclass
class BeamSearchSequence:
    """One finished beam: its output tokens (a stop token that ended it included), their
    log-probabilities, and its score (cum_logprob / len(tokens) ** length_penalty)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (a stop token) or "length"
    stop_reason: int | None = None  # the stop token that ended it
    text: str | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's result, as vLLM's: the finished beams, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum: float


class BeamSearch:
    """One prompt's search, driven by its caller: `pending()` gives the token ids (prompt and
    beam) whose next-token log-probabilities `advance` takes, in the same order, until `done`."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: BeamSearchParams,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        max_logprobs: int,
    ) -> None:
        """`max_logprobs`: the most log-probabilities a step's request may ask for (the engine's)."""
        self.prompt = list(prompt_ids)
        self.params = params
        self.width = params.beam_width
        eos = () if params.ignore_eos else eos_token_ids
        self.stop_ids = frozenset(eos) | frozenset(params.stop_token_ids or ())
        per_beam = max(2, 1 + len(self.stop_ids))
        self.keep = per_beam * self.width  # HF's candidates kept per step
        # Candidates needed from each beam: its top `keep`, and the stop tokens a min_tokens mask
        # may drop from them. Each step's requests ask for this many log-probabilities.
        masked = len(self.stop_ids) if params.min_tokens else 0
        self.top_n = max(self.keep + masked, params.logprobs or 0)
        if self.top_n > max_logprobs:
            most = (max_logprobs - masked) // per_beam
            raise ValueError(
                f"beam_width {self.width} needs the top {self.top_n} log-probabilities of each step "
                f"({len(self.stop_ids)} stop token(s)); at most {max_logprobs} are available (--max-logprobs), so "
                + (f"beam_width can be at most {most} here" if most else "no beam width fits these stop tokens")
            )
        room = max_model_len - len(self.prompt)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(self.prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(self.prompt) + params.max_tokens} exceeds max_model_len {max_model_len}"
            )
        self.max_new = room if params.max_tokens is None else params.max_tokens
        self.running = [_Beam([], [], 0.0)]
        self.finished: list[BeamSearchSequence] = []  # best first, at most `width`
        self.improvable = True  # HF's early-stop heuristic not yet satisfied
        self.done = self.max_new < 1  # (a prompt too long for any output: the engine refuses it)
        self.steps = 0

    def step_params(self, base: SamplingParams | None = None) -> SamplingParams:
        """What each step's engine requests ask for: one greedy token with the top `top_n`
        log-probabilities (`base`: other fields to keep, such as the priority)."""
        fields = {} if base is None else {"priority": base.priority}
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=self.top_n,
            ignore_eos=True,
            stop_token_ids=list(self.params.stop_token_ids or []),  # (the engine checks their range)
            **fields,
        )

    def pending(self) -> list[list[int]]:
        """The token ids of every running beam (prompt first), for this step's requests."""
        return [] if self.done else [self.prompt + b.tokens for b in self.running]

    def advance(self, tops: list[dict[int, Logprob]]) -> None:
        """Extend the running beams by their next tokens' top log-probabilities (one dict per
        beam of `pending()`, token id -> Logprob, as the engine's first output logprobs)."""
        if len(tops) != len(self.running):
            raise ValueError(f"advance got {len(tops)} results for {len(self.running)} beams")
        lp = self.params.length_penalty
        length = self.steps + 1  # each candidate's output length
        masked = self.stop_ids if self.steps < self.params.min_tokens else frozenset()
        cands = [
            (beam.cum + entry.logprob, b, tok)
            for b, (beam, top) in enumerate(zip(self.running, tops))
            for tok, entry in top.items()
            if tok not in masked and math.isfinite(entry.logprob)
        ]
        # Best first; ties by beam, then token id (HF's topk leaves their order to the kernel)
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[: self.keep]
        at_limit = length >= self.max_new
        running: list[_Beam] = []
        for rank, (cum, b, tok) in enumerate(cands):
            beam = self.running[b]
            stop = tok in self.stop_ids
            if not stop and not at_limit:
                if len(running) < self.width:
                    running.append(_Beam(beam.tokens + [tok], beam.logprobs + [tops[b]], cum))
                continue
            if rank < self.width and self.improvable:  # only the first W candidates may finish
                self.finished.append(
                    BeamSearchSequence(
                        tokens=beam.tokens + [tok],
                        logprobs=beam.logprobs + [tops[b]],
                        cum_logprob=cum,
                        score=cum / length**lp,
                        finish_reason="stop" if stop else "length",
                        stop_reason=tok if stop else None,
                    )
                )
        self.finished.sort(key=lambda s: -s.score)  # (stable: earlier finishers first on ties)
        del self.finished[self.width :]
        self.running = running
        self.steps = length
        if self.improvable and len(self.finished) == self.width:
            best = running[0].cum / length**lp if running else -math.inf
            self.improvable = best > self.finished[-1].score
        self.done = at_limit or not running or not self.improvable

    def result(self, tokenizer: Any = None) -> BeamSearchOutput:
        """The finished beams, best first, their text decoded by `tokenizer` (if given), a stop
        token's text only with include_stop_str_in_output."""
        if not self.done:
            raise RuntimeError("the beam search has not finished")
        seqs = list(self.finished)
        if tokenizer is not None:
            p = self.params
            for s in seqs:
                ids = s.tokens if s.stop_reason is None or p.include_stop_str_in_output else s.tokens[:-1]
                s.text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        return BeamSearchOutput(seqs, list(self.prompt))
