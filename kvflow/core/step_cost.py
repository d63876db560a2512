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
from collections.abc import Callable, Iterable
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
        # The recent steps as the fit's rows, a ring (the fit does not care about their order):
        # 1, tokens, chunks, any chunks, context / 1000, pairs / 1e6, tiles, seconds. (Building
        # the fit's arrays from a list of tuples took most of a refit's time.)
        self._ring = np.zeros((window, 8))
        self.num_samples = 0  # steps observed in all
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
            if self.num_samples >= 8:  # how far off the model was on a step it had not seen
                self.errors.append(abs(self.predict(tokens, chunks, context, pairs) - seconds) / seconds)
            row = (1.0, tokens, chunks, chunks > 0, context / 1000, pairs / 1e6, self.tiles(tokens, chunks), seconds)
            self._ring[self.num_samples % len(self._ring)] = row
            self.num_samples += 1
            self._unfitted += 1

    @property
    def samples(self) -> list[tuple[int, int, int, int, int, float]]:
        """The steps in the window, oldest first: (tokens, chunks, context, pairs, tiles, seconds)."""
        n, size = self.num_samples, len(self._ring)
        rows = np.roll(self._ring, -(n % size), axis=0) if n > size else self._ring[:n]
        return [(int(r[1]), int(r[2]), round(r[4] * 1000), round(r[5] * 1e6), int(r[6]), float(r[7])) for r in rows]

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
        if self._fit is None or self._unfitted >= (1 if self.num_samples < 32 else REFIT_EVERY):
            self._fit, self._unfitted = self._solve(), 0
        return self._fit

    def predict(self, tokens: int, chunks: int = 0, context: int = 0, pairs: int = 0) -> float:
        return _seconds(self.coefficients, tokens, chunks, context, pairs, self.tiles(tokens, chunks))

    def shape_predictor(self) -> Callable[[int, int, int, int, int], float]:
        """`predict` for a step given by its shape -- (rows, the longest sequence's new tokens,
        multi-token sequences, context, chunk pairs) -- with the current coefficients bound: for a
        planner that prices many candidate steps before each step (the speculator), where looking
        the fit and the pass up on every call cost more than the arithmetic."""
        coef, chunks_of, tiles_of = self.coefficients, self.chunks, self.tiles

        def seconds(rows: int, longest: int, multi: int, context: int, pairs: int) -> float:
            chunks = chunks_of(rows, longest, multi)
            return _seconds(coef, rows, chunks, context, pairs if chunks else 0, tiles_of(rows, chunks))

        return seconds

    def _solve(self) -> tuple[float, ...]:
        if not self.num_samples:
            return tuple(self.prior.tolist())
        data = self._ring[: min(self.num_samples, len(self._ring))]
        x, y = data[:, :7], data[:, 7]
        # Relative errors are what the predictions are judged by (a 100 ms decode step matters as
        # much as a 2 s prefill step), so each step is weighted by 1 / its time. The prior, scaled
        # to the measured step time, enters as pseudo-observations of b..p: a ridge toward it that
        # the data outweighs once the steps have varied.
        n = len(data)
        mean, y_mean = x.sum(axis=0) / n, float(y.sum()) / n
        std = np.sqrt(np.maximum(np.einsum("ij,ij->j", x, x) / n - mean * mean, 0.0))
        scale = y_mean / float(self.prior @ mean)
        weight = np.sqrt(n) * (std + 1.0) * 0.03 / y_mean
        weight[0] = 0.0
        coef, *_ = np.linalg.lstsq(
            np.vstack([x / y[:, None], np.diag(weight)[1:]]),
            np.concatenate([np.ones_like(y), weight[1:] * self.prior[1:] * scale]),
            rcond=None,
        )
        floor = 1e-3 * scale  # never free: noise must not make tokens or chunks cost nothing
        lows = np.concatenate([[floor], self.prior[1:] * floor])
        return tuple(np.maximum(coef, lows).tolist())


def _seconds(coef: tuple[float, ...], tokens: int, chunks: int, context: int, pairs: int, tiles: int) -> float:
    a, b, c, m, d, p, t = coef
    return a + b * tokens + c * chunks + m * (chunks > 0) + d * context / 1000 + p * pairs / 1e6 + t * tiles


def chunk_pairs(start: int, n: int) -> int:
    """Query-key pairs causal attention computes for n new tokens after `start` cached ones."""
    return n * start + n * (n + 1) // 2
