"""The Mixture-of-Experts feed-forward as tensor code: the router (`route`), the routed experts run
expert by expert (`grouped_experts`), and the block holding both with its weights
(`SparseMoeBlock`), Qwen2-MoE's shared expert included. Tokens in, tokens out: no requests here.

Exactness against HF transformers is the point, so the maths follows its implementations op for op
wherever the order of operations could change a bit of a result or a routing choice:

* routing: the router logits in the model dtype (`F.linear`, as HF), softmax in float32, `torch.topk`
  on those float32 probabilities (the same op on the same values, so tied experts are broken the
  same way), renormalised where the family does, then the weights cast where the family casts them;
* combining: each (token, slot) output is scaled by its weight in the weights' dtype, and a token's
  k outputs are summed in slot order before one cast to the model dtype (HF's grouped path).

The experts run as one matmul pair per expert that received tokens, in torch; a native grouped
kernel is for later (see docs/features/moe.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvflow.config import MoeConfig
from kvflow.layers.linear import Linear


class Routing(NamedTuple):
    """Each token's chosen experts and their weights: [tokens, k] each."""

    weights: torch.Tensor  # in the family's weight dtype (float32, or the model's)
    experts: torch.Tensor  # int64 expert ids, best first


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype) -> Routing:
    """The top-k experts of every row of `router_logits` [tokens, experts] and their weights:
    softmax over the experts in float32, top-k, divided by their sum if `renormalize`, cast to
    `weights_dtype`."""
    probs = router_logits.float().softmax(dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.to(weights_dtype), experts)


def grouped_experts(x: torch.Tensor, routing: Routing, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """For every token t of x [tokens, hidden]: sum over its slots j of
    weight[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j].

    `w13` [experts, 2 * inter, hidden]: each expert's gate rows, then its up rows; `w2` [experts,
    hidden, inter]. The (token, slot) pairs are sorted by expert and each expert that received any
    runs one matmul pair over its rows: an expert no token chose costs nothing, and no expert sees
    a token that did not choose it."""
    tokens, top_k = routing.experts.shape
    flat = routing.experts.reshape(-1)
    # Pairs grouped by expert; stable, so each group keeps token order (a deterministic layout).
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0])
    bounds = [0, *counts.cumsum(0).tolist()]  # expert e's pairs are order[bounds[e]:bounds[e + 1]]
    rows = x.index_select(0, order // top_k)
    out = torch.empty_like(rows)
    for e in counts.nonzero().flatten().tolist():
        lo, hi = bounds[e], bounds[e + 1]
        gate, up = F.linear(rows[lo:hi], w13[e]).chunk(2, dim=-1)
        torch.mm(F.silu(gate) * up, w2[e].t(), out=out[lo:hi])
    # Weighted in the weights' dtype (float32 for Mixtral, whatever x's), back in (token, slot)
    # order, summed over the slots, then cast once.
    weighted = out * routing.weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    combined = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return combined.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


class SparseMoeBlock(torch.nn.Module):
    """A decoder layer's routed feed-forward: router, stacked experts, and (Qwen2-MoE) a shared
    expert every token takes, scaled by sigmoid(shared_expert_gate(x)).

    The experts are kept stacked in the model dtype (`w13` [E, 2I, H] with gate then up rows, `w2`
    [E, H, I]); the router (`router` [E, H]) and the shared gate ([1, H]) run through `F.linear` as
    HF's do, so the routing sees the same logits. The shared expert is a dense MLP on the model's
    linear kernels (`Linear`, prepared with the rest)."""

    def __init__(self, hidden_size: int, moe: MoeConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        e, inter = moe.num_experts, moe.moe_intermediate_size
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.weights_dtype = torch.float32 if moe.routing_weights_float32 else dtype

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.router = param(e, hidden_size)
        self.w13 = param(e, 2 * inter, hidden_size)
        self.w2 = param(e, hidden_size, inter)
        shared = moe.shared_expert_intermediate_size
        self.shared_gate_up = Linear(hidden_size, 2 * shared, False, dtype, device) if shared else None
        self.shared_down = Linear(shared, hidden_size, False, dtype, device) if shared else None
        self.shared_expert_gate = param(1, hidden_size) if shared else None

    def route(self, h: torch.Tensor) -> Routing:
        """The experts each row of h [tokens, hidden] goes to, and their weights."""
        return route(F.linear(h, self.router), self.top_k, self.renormalize, self.weights_dtype)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + the block's output for h [tokens, hidden] (the post-attention norm's output)."""
        out = grouped_experts(h, self.route(h), self.w13, self.w2)
        if self.shared_down is not None:
            gate, up = self.shared_gate_up.kernel(h).chunk(2, dim=-1)
            shared = self.shared_down.kernel(F.silu(gate) * up)
            out = out + torch.sigmoid(F.linear(h, self.shared_expert_gate)) * shared
        return residual + out

    def expert_bytes(self) -> int:
        """Bytes of the weights this block holds outside the linear kernels: router, experts, and
        the shared expert's gate (the shared expert itself is in its kernels)."""
        params = (self.router, self.w13, self.w2, self.shared_expert_gate)
        return sum(p.numel() * p.element_size() for p in params if p is not None)
