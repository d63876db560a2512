"""Turns a batch of logits into next tokens, vectorised over the batch.

Order of operations (as in vLLM): logprobs are taken from the raw logits; then penalties,
min_tokens masking, temperature, top-k, top-p, min-p; then one draw per row. Greedy rows take
the argmax of the penalised logits.

Random draws invert the CDF: one uniform u per row, the token is the first whose cumulative
probability exceeds u (torch.searchsorted), which samples exactly from p with one random number
per row (the exponential race needs one per vocabulary entry, a cost that grows with batch x
vocabulary; figures: docs/benchmarks/results/). Each seeded request draws its u from its own
generator, so its text does not depend on what else is in the batch; unseeded requests share one
generator seeded by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """The sampling side of one step: one row per sequence that samples."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per row: the request's own, or None (shared)
    prompt_ids: list[list[int] | None]  # only where a penalty needs them
    output_ids: list[list[int] | None]
    num_output_tokens: list[int]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N]
    # Per row that asked for logprobs: (sampled token logprob, its rank, top ids, top logprobs)
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index of the maximum, NaN counting as the maximum), as
    `argmax(dim=-1)` gives it. float32 CPU logits go through numpy's argmax, which is vectorised
    and defined alike (first index of the maximum, the first NaN if any), several times faster than
    torch's reductions over a vocabulary (figures: docs/benchmarks/results/); otherwise torch's
    `max`, which it runs faster than `argmax`."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.max(dim=-1).indices


def truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, top-p and min-p: excluded tokens get -inf."""
    dev = logits.device
    vocab = logits.shape[1]
    # Which truncations apply is decided from the params on the host: no device sync, and no
    # per-row tensors for the ones that do not.
    if any(0 < p.top_k < vocab for p in params) or any(p.top_p < 1 for p in params):
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        drop = rank >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        before = torch.cumsum(probs, dim=-1) - probs
        drop |= before >= top_p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(
            1, order, sorted_logits.masked_fill(drop, float("-inf"))
        )
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=logits.dtype)
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def transformed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] logits -> the distribution each row samples from: temperature, then top-k, top-p,
    min-p, then softmax (one params per row). Greedy rows get temperature 1 (they take the argmax).
    One code path for the sampler and both sides of speculative decoding: rejection sampling is
    exact only if the target and the draft distributions are transformed alike."""
    temps = torch.tensor(
        [p.temperature if not p.greedy else 1.0 for p in params], device=logits.device, dtype=logits.dtype
    )
    return torch.softmax(truncate(logits / temps[:, None], params), dim=-1)


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        params = batch.params
        # An argmax is the same over a bf16 model's logits as over their float32 copy (widening is
        # exact): a greedy batch skips the copy (at 64 rows: 12.6 MB written, then read by the max).
        if any(not p.greedy or p.logprobs is not None or p.has_penalties for p in params):
            logits = logits.float()
        _, vocab = logits.shape
        dev = logits.device
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None

        logits = self._apply_penalties(logits, batch)
        logits = self._mask_early_stops(logits, batch)

        tokens = greedy_tokens(logits)
        if not all(p.greedy for p in params):  # (decided on the host: no device sync)
            greedy = torch.tensor([p.greedy for p in params], device=dev)
            probs = transformed_probs(logits, params)
            cdf = torch.cumsum(probs, dim=-1)
            u = self._uniforms(batch.generators, dev) * cdf[:, -1]
            sampled = torch.searchsorted(cdf, u[:, None], right=True).clamp_max_(vocab - 1)
            # u * total may round up to the total: never land on a token of probability 0.
            dead = probs.gather(1, sampled) == 0
            sampled = torch.where(dead, probs.argmax(dim=-1, keepdim=True), sampled).squeeze(1)
            tokens = torch.where(greedy, tokens, sampled)

        return SamplerOutput(token_ids=tokens, logprobs=self._logprobs(raw_logprobs, tokens, params))

    # ---- logits processing -------------------------------------------------------------------
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = [i for i, p in enumerate(batch.params) if p.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        dev = logits.device
        out_counts = torch.zeros(len(rows), vocab, device=dev)
        in_prompt = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
        for j, i in enumerate(rows):
            out_ids = torch.tensor(batch.output_ids[i], dtype=torch.long, device=dev)
            out_counts[j].index_add_(0, out_ids, torch.ones(len(out_ids), device=dev))
            in_prompt[j, torch.tensor(batch.prompt_ids[i], dtype=torch.long, device=dev)] = True
        p = [batch.params[i] for i in rows]
        rep = torch.tensor([x.repetition_penalty for x in p], device=dev)[:, None]
        pres = torch.tensor([x.presence_penalty for x in p], device=dev)[:, None]
        freq = torch.tensor([x.frequency_penalty for x in p], device=dev)[:, None]
        sub = logits[rows]
        seen = in_prompt | (out_counts > 0)
        # Repetition penalty (CTRL): shrink seen tokens' logits toward "less likely".
        sub = torch.where(seen & (sub > 0), sub / rep, torch.where(seen, sub * rep, sub))
        sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
        logits[rows] = sub
        return logits

    @staticmethod
    def _mask_early_stops(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Before min_tokens are out, EOS and stop tokens may not be drawn."""
        masked = False
        for i, p in enumerate(batch.params):
            if batch.num_output_tokens[i] < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(p._eos_token_ids))
                if ids:
                    if not masked:
                        logits, masked = logits.clone(), True
                    logits[i, ids] = float("-inf")
        return logits

    def _uniforms(self, generators: list[torch.Generator | None], dev: torch.device) -> torch.Tensor:
        """One U[0, 1) per row: from the row's own generator, or the shared one."""
        u = torch.rand(len(generators), generator=self.generator, device=dev)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand((), generator=g, device=dev)
        return u

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]):
        """Per row: (logprob of tokens[row], its rank, top ids, top logprobs) from raw logits."""
        return Sampler._logprobs(torch.log_softmax(logits, dim=-1), tokens, params)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: torch.Tensor, params: list[SamplingParams]):
        result: list = [None] * len(params)
        if raw is None:
            return result
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        idx = torch.tensor(rows, device=raw.device)
        sub = raw[idx]
        chosen = sub.gather(1, tokens[idx][:, None]).squeeze(1)
        ranks = (sub > chosen[:, None]).sum(dim=-1) + 1
        k = max(params[i].logprobs for i in rows)
        top_vals, top_ids = sub.topk(k, dim=-1) if k > 0 else (sub[:, :0], sub[:, :0].long())
        chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            n = params[i].logprobs
            result[i] = (chosen_l[j], ranks_l[j], top_ids_l[j][:n], top_vals_l[j][:n])
        return result
