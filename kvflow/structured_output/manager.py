"""Grammar compilation and per-request matchers: the engine's side of structured outputs.

Compiling happens off the engine loop, in a small thread pool, behind a cache keyed by the
constraint (the same schema compiles once). The server waits for the compiled grammar before it
hands a request to the engine (a grammar that fails or takes longer than the timeout is a 400),
so the engine's step never waits on a compile. Each constrained sequence then owns a matcher:
before a step, `bitmask()` fills the allowed-token bits for every logits row the runner will
sample (with draft tokens: one row per draft position, the matcher advanced tentatively through
the drafts and rolled back), and after the step `accept()` advances it by the tokens that were
really emitted. No model tensors here: the bitmask is data the runner applies to its logits.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from kvflow.models.tokenizer import FastTokenizer
from kvflow.structured_output.grammar import GrammarError, compile_grammar
from kvflow.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("kvflow")

_CACHE_ENTRIES = 256
_OBSERVATIONS = 4096  # compile and mask timings kept for the metrics until read


class ScheduledRow(Protocol):
    """What `bitmask()` needs of a scheduled sequence (core.scheduler.ScheduledSeq)."""

    request_id: str
    sample: bool
    spec_token_ids: list[int]


@dataclass
class GrammarBitmask:
    """Allowed tokens for the step's logits rows: `bitmask` [rows, ceil(vocab / 32)] int32 (bit
    set = allowed), applied to the rows in `rows` only (the others are unconstrained)."""

    bitmask: Any  # torch.Tensor
    rows: list[int]


def apply_bitmask(logits: Any, mask: GrammarBitmask) -> Any:
    """Disallowed tokens of the constrained rows get -inf (in place; returns `logits`).

    Unpacks the bits with numpy and selects with one torch.where: about twice as fast here as
    xgrammar's CPU kernel on rows that allow few tokens (the usual case; benchmarks/
    structured_output.py times both), and the same code on any device."""
    import numpy as np
    import torch

    rows = torch.tensor(mask.rows, dtype=torch.long)
    vocab = logits.shape[1]
    packed = mask.bitmask[rows].numpy().astype("<i4", copy=False).view(np.uint8)  # bit j of word w: token 32w + j
    allowed = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].view(np.bool_)
    rows = rows.to(logits.device)
    allowed_t = torch.from_numpy(allowed).to(logits.device)
    logits[rows] = torch.where(
        allowed_t, logits[rows], torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    )
    return logits


@dataclass
class StructuredOutputStats:
    requests_total: int = 0  # constrained sequences added
    compiles_total: int = 0
    compile_seconds_total: float = 0.0
    cache_hits_total: int = 0
    mask_steps_total: int = 0  # steps that filled a bitmask
    mask_seconds_total: float = 0.0


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], compile_timeout_s: float
    ) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer = tokenizer
        self._stop_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvflow-grammar")
        self._compiler: Future | None = None
        self._cache: collections.OrderedDict[tuple, Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._fresh: set[tuple] = set()  # keys compiled for a request the engine has not seen yet
        self._matchers: dict[str, Any] = {}  # engine thread only
        self.stats = StructuredOutputStats()
        self.compile_times: collections.deque[float] = collections.deque(maxlen=_OBSERVATIONS)
        self.mask_times: collections.deque[float] = collections.deque(maxlen=_OBSERVATIONS)

    # ---- compiling (any thread) --------------------------------------------------------------
    def warm_up(self) -> Future:
        """Start building the grammar compiler (the tokenizer's vocabulary, once), so the first
        constrained request does not pay for it. Idempotent."""
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer; this model has none")
                self._compiler = self._pool.submit(self._make_compiler)
            return self._compiler

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        t0 = time.perf_counter()
        # xgrammar reads a transformers tokenizer (its class tells the vocabulary's encoding); kvflow's
        # own FastTokenizer gives its transformers twin.
        hf = self._tokenizer.to_hf() if isinstance(self._tokenizer, FastTokenizer) else self._tokenizer
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids)
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)  # the cache is ours
        logger.info("grammar compiler ready (%d tokens) in %.2f s", self.vocab_size, time.perf_counter() - t0)
        return compiler

    def submit(self, spec: StructuredOutputsParams, ahead: bool = False) -> Future:
        """The compiled grammar of `spec`, as a future (cached: the same constraint compiles once).
        `ahead`: the server's lookup before the engine's own for the same request; a compile it
        starts is that request's, so the engine's lookup then is not a cache hit."""
        compiler = self.warm_up()
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (
                fut.done() and fut.exception() is not None and not isinstance(fut.exception(), GrammarError)
            ):
                self._cache.move_to_end(key)
                if not ahead:
                    if key in self._fresh:
                        self._fresh.discard(key)
                    else:
                        self.stats.cache_hits_total += 1
                return fut
            fut = self._pool.submit(self._compile, compiler, spec)
            self._cache[key] = fut
            if ahead:
                self._fresh.add(key)
            while len(self._cache) > _CACHE_ENTRIES:
                self._fresh.discard(self._cache.popitem(last=False)[0])
            return fut

    def _compile(self, compiler: Future, spec: StructuredOutputsParams) -> Any:
        t0 = time.perf_counter()
        grammar = compile_grammar(compiler.result(), spec)
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.compiles_total += 1
            self.stats.compile_seconds_total += dt
            self.compile_times.append(dt)
        return grammar

    def compiled(self, spec: StructuredOutputsParams, timeout: float | None = None) -> Any:
        """Block until `spec` is compiled; GrammarError (a ValueError) when it cannot be, or not
        within the timeout."""
        fut = self.submit(spec)
        timeout = self.compile_timeout_s if timeout is None else timeout
        try:
            return fut.result(timeout=timeout)
        except TimeoutError:
            raise GrammarError(
                f"structured_outputs.{spec.kind} did not compile within {timeout:g} s "
                "(the server's structured_outputs_compile_timeout_s); simplify it"
            ) from None

    # ---- matchers (engine thread) ------------------------------------------------------------
    def add_request(self, request_id: str, compiled: Any) -> None:
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(compiled)
        self.stats.requests_total += 1

    def remove(self, request_ids) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def has_requests(self) -> bool:
        return bool(self._matchers)

    def bitmask(self, seqs: list[ScheduledRow]) -> GrammarBitmask | None:
        """Allowed tokens for every logits row of this step that belongs to a constrained
        sequence. Rows follow the runner's layout: the sampling sequences in order, 1 + drafts
        rows each. After a draft the grammar refuses, the remaining rows stay unconstrained: the
        verifier rejects that draft (its probability is 0 under the mask), so they are never used."""
        if not self._matchers:
            return None
        import torch
        import xgrammar as xgr

        t0 = time.perf_counter()
        layout, total = [], 0
        for s in seqs:
            if not s.sample:
                continue
            n = 1 + len(s.spec_token_ids)
            if s.request_id in self._matchers:
                layout.append((s, total))
            total += n
        if not layout:
            return None
        mask = torch.full((total, xgr.get_bitmask_shape(1, self.vocab_size)[1]), -1, dtype=torch.int32)
        rows = []
        for s, start in layout:
            m = self._matchers[s.request_id]
            if m.is_terminated():
                continue
            m.fill_next_token_bitmask(mask, start)
            rows.append(start)
            advanced = 0
            for j, token in enumerate(s.spec_token_ids):
                if not m.accept_token(token):
                    break
                advanced += 1
                if m.is_terminated():
                    break
                m.fill_next_token_bitmask(mask, start + j + 1)
                rows.append(start + j + 1)
            if advanced:
                m.rollback(advanced)
        dt = time.perf_counter() - t0
        self.stats.mask_steps_total += 1
        self.stats.mask_seconds_total += dt
        self.mask_times.append(dt)
        return GrammarBitmask(mask, rows) if rows else None

    def accept(self, request_id: str, tokens: list[int]) -> bool | None:
        """Advance a sequence's matcher by the tokens it emitted. Returns True when the grammar
        has ended (the sequence is complete), False when it goes on, None when a token broke the
        grammar (the sampler ignored the mask: the caller fails the request)."""
        m = self._matchers.get(request_id)
        if m is None:
            return False
        for token in tokens:
            if m.is_terminated() or not m.accept_token(token):
                return None
        return m.is_terminated()

    def take_timings(self) -> tuple[list[float], list[float]]:
        """Compile and mask durations since the last call (for the metrics histograms)."""
        with self._lock:
            compiles = list(self.compile_times)
            self.compile_times.clear()
        masks = list(self.mask_times)
        self.mask_times.clear()
        return compiles, masks

    def snapshot(self) -> StructuredOutputStats:
        with self._lock:
            return StructuredOutputStats(**vars(self.stats))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
