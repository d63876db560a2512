"""How long an engine step takes, learned from the steps that ran:

    seconds = a + b * tokens + c * chunks + m * (chunks > 0) + d * context / 1000 + p * pairs / 1e6
              + t * tiles

`tokens` are all tokens computed in the step, `chunks` the sequences computing more than one
(prefill chunks, draft verification), `context` the KV positions attention reads (each
sequence's length after the step, summed) and `pairs` the query-key pairs of the multi-token
chunks (a chunk of n tokens after s cached ones: n x (s + (n + 1) / 2)), the attention work that
grows with the square of a long prompt. On a CPU a step reads every weight once whatever it
computes, so `a` (the pass) dominates, `b` (one more token) is small until the batch is large, `c`
is what a multi-token sequence costs beyond its tokens (its attention runs apart from the batched
decode kernel), `m` what a step pays once for having any (the mixed path), `d` the decode rows'
attention, which grows with their contexts, and `p` the chunks' attention. That is what makes verifying drafts cheap at batch 1 and not
at batch 32, and what the `slo` scheduling policy predicts TTFT and TPOT with.

`tiles` counts, for a step on the decode pass whose kernels compute `tile_rows` rows per pass
over a weight (the block kernels' register tile), the passes beyond the first: ceil(tokens /
tile_rows) - 1. Such a step is not linear in its rows: a ninth row after a tile of eight reads and
unpacks every weight once more, so a draft that opens a tile costs several times what one that
fills it does (batch 8 on the default model: docs/benchmarks/results/).

A step that rides the model's one-call decode pass (`DecodePass`: every sequence with at most
`rows_per_seq` new tokens, at most `max_rows` in all; decodes, and decodes verifying a few drafts)
counts no chunk, whatever its sequences' token counts: there a verification row costs what one
more decode row does. `chunks` is then what the caller gets from `chunks()`.

Refitted by least squares over a window of recent steps, pulled gently toward prior ratios (b, c
m, d and p as fractions of a step) so that a coefficient the steps have not varied enough to show stays
sensible. No tensors here: the scheduler side uses it (one model per engine, shared by the
speculator and the scheduling policy).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

REFIT_EVERY = 8


@dataclass(frozen=True)
class DecodePass:
    """Which steps the model runner computes as one fused decode pass (the runner says; the cost
    model only counts them). The default: none."""

    rows_per_seq: int = 1  # a sequence with at most this many new tokens rides in it ...
    max_rows: int = 0  # ... in a step of at most this many rows (0: the runner has no pass)
    tile_rows: int = 0  # rows its kernels compute per pass over a weight (0: not modelled)

    def takes(self, rows: int, longest: int) -> bool:
        return 0 < rows <= self.max_rows and longest <= self.rows_per_seq


class StepCostModel:
    def __init__(
        self,
        window: int = 256,
        prior_token_ratio: float = 0.01,
        prior_chunk_ratio: float = 0.02,
        prior_mixed_ratio: float = 0.05,
        prior_context_ratio: float = 0.005,
        prior_pairs_ratio: float = 10.0,
        prior_tile_ratio: float = 0.1,
    ) -> None:
        self.samples: deque[tuple[int, int, float, float, int, float]] = deque(maxlen=window)
        self.prior = np.array(
            [
                1.0,
                prior_token_ratio,
                prior_chunk_ratio,
                prior_mixed_ratio,
                prior_context_ratio,
                prior_pairs_ratio,
                prior_tile_ratio,
            ]
        )  # / a
        self.decode_pass = DecodePass()  # the runner's (the engine sets it once the model is loaded)
        self._fit: tuple[float, ...] | None = None
        self._unfitted = 0  # samples observed since the last fit
        self.errors: deque[float] = deque(maxlen=window)

    def chunks(self, rows: int, longest: int, multi: int) -> int:
        """The chunks a step of `rows` tokens counts, whose longest sequence has `longest` new tokens
        and `multi` sequences more than one: none where it rides the decode pass, else `multi`."""
        return 0 if self.decode_pass.takes(rows, longest) else multi

    def tiles(self, tokens: int, chunks: int) -> int:
        """Passes over the weights beyond the first that a step of `tokens` rows and `chunks`
        chunks makes on the decode pass (0 off it, or where the runner did not say)."""
        tile = self.decode_pass.tile_rows
        if tile <= 0 or chunks or tokens > self.decode_pass.max_rows:
            return 0
        return (tokens - 1) // tile

    def features(self, seqs: Iterable[tuple[int, int]]) -> tuple[int, int, int, int]:
        """(tokens, chunks, context, pairs) of a step computing `seqs`, each (cached tokens, new
        tokens): what `observe` and `predict` take."""
        seqs = list(seqs)
        tokens = sum(n for _, n in seqs)
        multi = [(s, n) for s, n in seqs if n > 1]
        chunks = self.chunks(tokens, max((n for _, n in seqs), default=0), len(multi))
        context = sum(s + n for s, n in seqs)
        return tokens, chunks, context, sum(chunk_pairs(s, n) for s, n in multi) if chunks else 0

    def observe(self, tokens: int, seconds: float, chunks: int = 0, context: int = 0, pairs: int = 0) -> None:
        if tokens > 0 and seconds > 0:
            if len(self.samples) >= 8:  # how far off the model was on a step it had not seen
                self.errors.append(abs(self.predict(tokens, chunks, context, pairs) - seconds) / seconds)
            self.samples.append((tokens, chunks, context / 1000, pairs / 1e6, self.tiles(tokens, chunks), seconds))
            self._unfitted += 1

    @property
    def prediction_error(self) -> float | None:
        """Median relative error of the last predictions made before each step was seen."""
        return float(np.median(self.errors)) if self.errors else None

    @property
    def coefficients(self) -> tuple[float, ...]:
        """(a, b, c, m, d, p, t): seconds per step, per token, per multi-token sequence, per step
        having any, per 1,000 context positions, per million chunk query-key pairs, per further
        pass over the weights. With no data only the ratios are known: (1, prior b, ...)."""
        # A fit is a small least-squares solve, but not free next to a batch-1 decode step (figures:
        # docs/benchmarks/results/): once the window holds enough steps it is refitted every
        # REFIT_EVERY of them, not on every one.
        if self._fit is None or self._unfitted >= (1 if len(self.samples) < 32 else REFIT_EVERY):
            self._fit, self._unfitted = self._solve(), 0
        return self._fit

    def predict(self, tokens: int, chunks: int = 0, context: int = 0, pairs: int = 0) -> float:
        a, b, c, m, d, p, t = self.coefficients
        return (
            a
            + b * tokens
            + c * chunks
            + m * (chunks > 0)
            + d * context / 1000
            + p * pairs / 1e6
            + t * self.tiles(tokens, chunks)
        )

    def _solve(self) -> tuple[float, ...]:
        if not self.samples:
            return tuple(self.prior.tolist())
        data = np.array(self.samples, dtype=np.float64)
        x = np.column_stack(
            [np.ones(len(data)), data[:, 0], data[:, 1], data[:, 1] > 0, data[:, 2], data[:, 3], data[:, 4]]
        )
        y = data[:, 5]
        # Relative errors are what the predictions are judged by (a 100 ms decode step matters as
        # much as a 2 s prefill step), so each step is weighted by 1 / its time. The prior, scaled
        # to the measured step time, enters as pseudo-observations of b..p: a ridge toward it that
        # the data outweighs once the steps have varied.
        scale = float(y.mean()) / float(self.prior @ x.mean(axis=0))
        weight = np.sqrt(len(data)) * (x.std(axis=0) + 1.0) * 0.03 / float(y.mean())
        weight[0] = 0.0
        coef, *_ = np.linalg.lstsq(
            np.vstack([x / y[:, None], np.diag(weight)[1:]]),
            np.concatenate([np.ones_like(y), weight[1:] * self.prior[1:] * scale]),
            rcond=None,
        )
        floor = 1e-3 * scale  # never free: noise must not make tokens or chunks cost nothing
        lows = np.concatenate([[floor], self.prior[1:] * floor])
        return tuple(np.maximum(coef, lows).tolist())


def chunk_pairs(start: int, n: int) -> int:
    """Query-key pairs causal attention computes for n new tokens after `start` cached ones."""
    return n * start + n * (n + 1) // 2
