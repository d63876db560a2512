"""Verifies draft tokens against the target model: modified rejection sampling (Leviathan et al.
2023; Chen et al. 2023), vectorised over a batch where row i carries its own k_i >= 0 drafts.

Row i scores k_i + 1 target positions (the drafts, then one past them). Random rows accept draft x
at position j with probability min(1, p_j(x) / q_j(x)); at the first rejection the row emits one
token from norm(max(p_j - q_j, 0)); if all k_i are accepted it emits a bonus token from p_{k_i}.
Every emitted token is then distributed exactly as p, whatever q is, so speculation changes speed,
never the output distribution. Greedy rows accept while draft == argmax p and emit the argmax at
the first mismatch (or the bonus argmax), i.e. exactly what non-speculative greedy decoding gives.

p is the request's transformed distribution (temperature, top-k, top-p, min-p: `transformed_probs`,
the sampler's own code path); the caller must build q with the same function on the draft logits.
q = None means a deterministic draft (n-gram lookup): q is one-hot, so x is accepted with
probability p(x) and a rejection samples from p with x removed. (That is exact for any draft, as
conditioned on x, q is one-hot; the real q only raises acceptance: sum min(p, q) >= sum q p.)
Penalties and min_tokens masking depend on the tokens before each position: they are the
caller's (apply them to the logits first).

Randomness: row i uses k_i + 1 uniforms per call (k_i acceptance tests, one final draw by inverse
CDF), from its own generator when seeded, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.sample.sampler import greedy_tokens, transformed_probs
from kvflow.sampling_params import SamplingParams

# A residual max(p - q, 0) with less mass than this is float noise (p == q in exact arithmetic):
# draw from p instead. A rejection happens with probability = that mass, so the bias is below it.
_RESIDUAL_EPS = 1e-6


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]  # per row: the accepted drafts, then one target token (1..k_i+1)
    num_accepted: list[int]  # per row: how many drafts were accepted (0..k_i)


class RejectionSampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)  # shared by the unseeded rows
        self.generator.manual_seed(seed)

    def __call__(
        self,
        target_logits: torch.Tensor,  # [sum(k_i + 1), V]; row i's positions contiguous, in order
        draft_token_ids: list[list[int]],  # per row: its k_i drafts
        draft_probs: list[torch.Tensor | None],  # per row: [k_i, V] transformed q, or None (one-hot)
        params: list[SamplingParams],
        generators: list[torch.Generator | None],  # per row: the request's own, or None (shared)
    ) -> RejectionOutput:
        dev = target_logits.device
        n_pos = target_logits.shape[0]
        ks = [len(d) for d in draft_token_ids]
        if not ks:
            return RejectionOutput(token_ids=[], num_accepted=[])
        if n_pos != sum(ks) + len(ks):
            raise ValueError(f"target_logits has {n_pos} rows, expected sum(k_i + 1) = {sum(ks) + len(ks)}")
        if all(p.greedy for p in params):  # (decided on the host: no device sync)
            return self._greedy(target_logits, draft_token_ids)
        kmax = max(ks)
        k = torch.tensor(ks, dtype=torch.long, device=dev)
        start = torch.cumsum(k + 1, 0) - (k + 1)  # first target position of each row
        col = torch.arange(kmax, device=dev)
        valid = col[None, :] < k[:, None]  # [B, K]: which padded slots hold a real draft
        pos = (start[:, None] + col[None, :]).clamp_max(n_pos - 1)  # target position of each draft
        draft = torch.tensor([d + [0] * (kmax - len(d)) for d in draft_token_ids], dtype=torch.long, device=dev).view(
            len(ks), kmax
        )
        greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=dev)

        target_argmax = greedy_tokens(target_logits)
        probs = transformed_probs(target_logits, [p for p, n in zip(params, ks) for _ in range(n + 1)])
        u = self._uniforms(generators, ks, kmax + 1, dev)  # [B, K + 1]
        q_x, q_all, q_first = self._draft_probs_at(draft_probs, draft, ks, probs.dtype)
        # u < p/q without a division: q(x) = 0 accepts iff p(x) > 0; p(x) = 0 never accepts.
        accept = torch.where(greedy[:, None], target_argmax[pos] == draft, u[:, :kmax] * q_x < probs[pos, draft])
        accept &= valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # length of the leading accepted run
        final_pos = start + num_accepted
        tokens = target_argmax[final_pos]

        p_final = probs[final_pos]  # [B, V]: p at the rejected draft, or at the bonus position
        residual = p_final.clone()
        rejected = num_accepted < k
        rows = torch.nonzero(rejected, as_tuple=True)[0]
        rej_tok = draft[rows, num_accepted[rows]]
        has_q = q_first[rows] >= 0
        # One-hot q: max(p - q, 0) is p with the rejected draft removed.
        residual[rows[~has_q], rej_tok[~has_q]] = 0
        if q_all is not None and bool(has_q.any()):
            r = rows[has_q]
            residual[r] -= q_all[q_first[r] + num_accepted[r]]
        residual.clamp_(min=0)  # also absorbs float negatives
        empty = residual.sum(dim=-1, keepdim=True) <= _RESIDUAL_EPS
        dist = torch.where(rejected[:, None] & ~empty, residual, p_final)
        sampled = _inverse_cdf(dist, u.gather(1, k[:, None]).squeeze(1))
        tokens = torch.where(greedy, tokens, sampled)

        tokens_l, acc_l = tokens.tolist(), num_accepted.tolist()
        return RejectionOutput(
            token_ids=[d[:a] + [t] for d, a, t in zip(draft_token_ids, acc_l, tokens_l)], num_accepted=acc_l
        )

    @staticmethod
    def _greedy(target_logits: torch.Tensor, draft_token_ids: list[list[int]]) -> RejectionOutput:
        """Every row greedy: accept while a draft is its position's argmax, then emit that
        position's argmax -- on the host, over one argmax of all positions (a batch's handful of
        rows does not pay for a dozen small tensor ops)."""
        best = greedy_tokens(target_logits).tolist()
        token_ids, num_accepted, at = [], [], 0
        for d in draft_token_ids:
            a = 0
            while a < len(d) and d[a] == best[at + a]:
                a += 1
            token_ids.append(d[:a] + [best[at + a]])
            num_accepted.append(a)
            at += len(d) + 1
        return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)

    @staticmethod
    def _draft_probs_at(
        draft_probs: list[torch.Tensor | None], draft: torch.Tensor, ks: list[int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """q(x) of each padded draft slot ([B, K]; 1 for one-hot rows), all given q rows in one
        [sum k_i, V] tensor, and each row's first row in it (-1 for one-hot rows)."""
        dev = draft.device
        q_x = torch.ones(draft.shape, dtype=dtype, device=dev)
        rows = [i for i, q in enumerate(draft_probs) if q is not None]
        first = [-1] * len(ks)
        for i in rows:
            if tuple(draft_probs[i].shape[:1]) != (ks[i],):
                raise ValueError(f"draft_probs[{i}] has shape {tuple(draft_probs[i].shape)}, expected [{ks[i]}, V]")
        if not rows:
            return q_x, None, torch.tensor(first, dtype=torch.long, device=dev)
        q_all = torch.cat([draft_probs[i] for i in rows]).to(device=dev, dtype=dtype)
        offset = 0
        for i in rows:
            first[i], offset = offset, offset + ks[i]
        ri = torch.tensor([i for i in rows for _ in range(ks[i])], dtype=torch.long, device=dev)
        rj = torch.tensor([j for i in rows for j in range(ks[i])], dtype=torch.long, device=dev)
        q_x[ri, rj] = q_all.gather(1, draft[ri, rj][:, None]).squeeze(1)
        return q_x, q_all, torch.tensor(first, dtype=torch.long, device=dev)

    def _uniforms(
        self, generators: list[torch.Generator | None], ks: list[int], width: int, dev: torch.device
    ) -> torch.Tensor:
        """[B, width] U[0, 1); a seeded row's k_i + 1 draws come from its own generator."""
        u = torch.rand(len(generators), width, generator=self.generator, device=dev)
        for i, (g, n) in enumerate(zip(generators, ks)):
            if g is not None:
                u[i, : n + 1] = torch.rand(n + 1, generator=g, device=dev)
        return u


def _inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from the unnormalised [B, V] dist, given one uniform per row (as Sampler)."""
    cdf = torch.cumsum(dist, dim=-1)
    x = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_max_(dist.shape[1] - 1)
    # u * total may round up to the total: never land on a token of probability 0.
    dead = dist.gather(1, x) == 0
    return torch.where(dead, dist.argmax(dim=-1, keepdim=True), x).squeeze(1)
