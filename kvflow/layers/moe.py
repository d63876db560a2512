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

The experts run as one matmul pair per expert that received tokens, each on that expert's own
kernels: on the CPU, the linear kernels of the backend (under ``auto`` the one path the autotune
chose for the expert's shape at one row, `expert_kernel`; int4 blocks; or, for a GGUF's quantized
experts kept as stored, the block kernels of kvflow.kernels.cpu.block_linear); elsewhere in torch
over the stacked float weights (see docs/features/moe.md). Where every expert of a layer is on
a native float kernel, the layer's experts run in one native call instead
(kvflow.kernels.cpu.moe_experts: the same grouping, one parallel region).

Under tensor parallelism each rank holds a share of every expert, or (expert parallelism) a range
of whole experts, routes every token itself and returns a partial sum that one all-reduce
completes (`SparseMoeBlock`).

What the routing did can be recorded (`RoutingRecorder`): tokens per layer and expert, the load
imbalance of each step, and the chosen experts of a step's rows (expert traces). Nothing is
recorded, and nothing costs anything, unless a recorder is attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvflow.config import MoeConfig
from kvflow.distributed.parallel import TPGroup, expert_range
from kvflow.kernels.cpu.float_linear import NativeFloatKernel
from kvflow.kernels.cpu.moe_experts import NativeExperts, experts_library
from kvflow.layers.linear import Linear
from kvflow.layers.linear_kernels import (
    FUSED_PROLOGUE,
    KernelPlan,
    LinearKernel,
    TunedKernel,
    default_choice,
    dtype_name,
    make_linear_kernel,
)
from kvflow.quantization.gguf_blocks import BlockQuantized

# Backends whose per-expert kernels float experts take (kernels taking `silu_mul=`, on the CPU).
EXPERT_KERNEL_BACKENDS = FUSED_PROLOGUE


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


def grouped_experts(
    x: torch.Tensor,
    routing: Routing,
    w13: torch.Tensor | Sequence[LinearKernel],
    w2: torch.Tensor | Sequence[LinearKernel],
    counts: torch.Tensor | None = None,
    first_expert: int = 0,
) -> torch.Tensor:
    """For every token t of x [tokens, hidden]: sum over its slots j of
    weight[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j].

    `w13` [experts, 2 * inter, hidden]: each expert's gate rows, then its up rows; `w2` [experts,
    hidden, inter]. Or, per expert, kernels: `w13[e]` computing gate | up, `w2[e]` the down
    projection taking `silu_mul=` (a GGUF's quantized experts on their block kernels). `counts`:
    the pairs per expert (`torch.bincount` of the experts, if the caller has it already). The
    (token, slot) pairs are sorted by expert and each expert that received any runs one matmul
    pair over its rows: an expert no token chose costs nothing, and no expert sees a token that
    did not choose it.

    Under expert parallelism `w13` / `w2` hold only experts `first_expert` .. `first_expert +
    len(w13) - 1` (this rank's range): the pairs routed to other experts add nothing here (their
    ranks add them, in the all-reduce after the block)."""
    tokens, top_k = routing.experts.shape
    if tokens == 1:
        return _one_token(x, routing, w13, w2, first_expert)
    flat = routing.experts.reshape(-1)
    # Pairs grouped by expert; stable, so each group keeps token order (a deterministic layout).
    order = torch.argsort(flat, stable=True)
    last = first_expert + len(w13)  # (one past this rank's last expert)
    if counts is None:
        counts = torch.bincount(flat, minlength=last)
    bounds = [0, *counts.cumsum(0).tolist()]  # expert e's pairs are order[bounds[e]:bounds[e + 1]]
    start, stop = bounds[first_expert], bounds[last]  # the pairs of the experts held here
    whole = start == 0 and stop == flat.numel()
    pairs = order if whole else order[start:stop]
    rows = x.index_select(0, pairs // top_k)
    out = torch.empty_like(rows)
    stacked = isinstance(w13, torch.Tensor)
    for e in (counts[first_expert:last].nonzero().flatten() + first_expert).tolist():
        lo, hi, i = bounds[e] - start, bounds[e + 1] - start, e - first_expert
        if stacked:
            gate, up = F.linear(rows[lo:hi], w13[i]).chunk(2, dim=-1)
            torch.mm(F.silu(gate) * up, w2[i].t(), out=out[lo:hi])
        else:
            out[lo:hi] = w2[i](w13[i](rows[lo:hi]), silu_mul=True)
    # Weighted in the weights' dtype (float32 for Mixtral, whatever x's), back in (token, slot)
    # order (zeros for the pairs of experts held elsewhere), summed over the slots, then cast once.
    weighted = out * routing.weights.reshape(-1).index_select(0, pairs).unsqueeze(-1)
    combined = weighted.new_empty(flat.numel(), x.shape[1]) if whole else weighted.new_zeros(flat.numel(), x.shape[1])
    combined.index_copy_(0, pairs, weighted)
    return combined.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _one_token(
    x: torch.Tensor,
    routing: Routing,
    w13: torch.Tensor | Sequence[LinearKernel],
    w2: torch.Tensor | Sequence[LinearKernel],
    first_expert: int,
) -> torch.Tensor:
    """`grouped_experts` for one token (a batch-1 decode step), without the sorting and scattering
    that group many: the same expert calls on the same row, scaled and summed in the same order
    and dtypes, so the result is the same bits."""
    last = first_expert + len(w13)
    stacked = isinstance(w13, torch.Tensor)
    outs = []
    for e in routing.experts[0].tolist():
        if not first_expert <= e < last:  # held by another rank: adds nothing here
            outs.append(x.new_zeros(1, x.shape[1]))
        elif stacked:
            gate, up = F.linear(x, w13[e - first_expert]).chunk(2, dim=-1)
            outs.append(torch.mm(F.silu(gate) * up, w2[e - first_expert].t()))
        else:
            outs.append(w2[e - first_expert](w13[e - first_expert](x), silu_mul=True))
    weighted = torch.cat(outs) * routing.weights.reshape(-1, 1)
    return weighted.view(1, len(outs), -1).sum(dim=1).to(x.dtype)


def _native_float(kernel: LinearKernel) -> NativeFloatKernel | None:
    """The native float kernel an expert projection runs at every row count, if it has one (a
    float8 one, with its scales, is not among those `NativeExperts` takes)."""
    if isinstance(kernel, TunedKernel) and len(kernel.paths) == 1:
        kernel = kernel.native
    if isinstance(kernel, NativeFloatKernel) and kernel.scale is None:
        return kernel
    return None


def expert_kernel(backend: str, weight: torch.Tensor, plan: KernelPlan | None) -> LinearKernel:
    """One expert projection's kernel. Under ``auto`` one path only, the one `plan` chose for a
    single row (batch-1 decode, where a MoE step is bound by the bytes of the experts it reads),
    at every row count: a dense projection may keep a copy of its weight per path it uses, but the
    experts are most of a MoE model's weights (measured with the other path's copy dropped: no
    loss in prefill or batch-32 decode, docs/benchmarks/results/2026-12-06-epyc-avx512.md)."""
    if backend != "auto":
        return make_linear_kernel(backend, weight, plan=plan)
    choice = plan.choice(tuple(weight.shape)) if plan is not None else default_choice(dtype_name(weight.dtype))
    return TunedKernel(weight, None, dict.fromkeys(choice, choice[min(choice)]))


@dataclass
class MoeRoutingStats:
    """What the routed layers did since the model was loaded (cumulative), one entry per MoE layer
    (`layers`: their decoder layer indices), counting every row a forward pass computed (prompt
    chunks, decodes, draft tokens verified, preempted work recomputed)."""

    layers: list[int]
    num_experts: int
    top_k: int
    num_steps: int  # forward passes recorded
    tokens: list[int]  # (token, expert) pairs routed: tokens x top-k
    busiest: list[int]  # summed over steps: the tokens of the step's busiest expert
    imbalance_sum: list[float]  # summed over steps: max / mean tokens per expert in the step
    expert_tokens: list[list[int]] | None = None  # [layer][expert] pairs routed (per_expert only)


class RoutingRecorder:
    """Records, for every MoE layer of a model (slot i: decoder layer `layers[i]`), what its
    routing did: when `counting`, tokens per expert (accumulated in a tensor allocated once: one
    add of the step's `torch.bincount` per layer, no host sync), the step's busiest expert and its
    max / mean load; and, while a capture is on, the experts each row of the step chose (for
    expert traces; `capture[i]` holds layer slot i's [rows, k] ids, read once after the step)."""

    def __init__(self, layers: list[int], num_experts: int, top_k: int, device: torch.device) -> None:
        self.layers = layers
        self.num_experts, self.top_k = num_experts, top_k
        self.counting = False
        n = len(layers)
        self.tokens = torch.zeros(n, num_experts, dtype=torch.int64, device=device)
        self.busiest = torch.zeros(n, dtype=torch.int64, device=device)
        self.imbalance = torch.zeros(n, dtype=torch.float64, device=device)
        self.steps = 0
        self.capture: list[torch.Tensor | None] | None = None

    def record(self, slot: int, experts: torch.Tensor, counts: torch.Tensor) -> None:
        """Layer slot `slot` routed `experts` [rows, k]; `counts`: their bincount over the experts."""
        if self.counting:
            if slot == 0:
                self.steps += 1
            self._count(slot, counts, experts.numel())
        if self.capture is not None:
            self.capture[slot] = experts

    def record_layers(self, experts: torch.Tensor) -> None:
        """Every MoE layer's routing of one step at once (the native decode pass's): `experts` int64
        [layers, rows, k]; the same counts as `record` per layer."""
        if self.counting:
            flat = experts.reshape(len(self.layers), -1)
            counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64, device=flat.device)
            counts.scatter_add_(1, flat, torch.ones_like(flat))
            self.steps += 1
            self._count(slice(None), counts, flat.shape[1])
        if self.capture is not None:
            self.capture = list(experts.unbind(0))

    def _count(self, slots: int | slice, counts: torch.Tensor, pairs: int) -> None:
        """Add a step's `counts` (per expert, of the layer slot or slots `slots`; `pairs`: rows x k
        of each) to the totals, its busiest expert and its max / mean load (the mean: pairs / experts)."""
        self.tokens[slots].add_(counts)
        top = counts.max(dim=-1).values
        self.busiest[slots].add_(top)
        self.imbalance[slots].add_(top.double() * (self.num_experts / pairs))

    def snapshot(self, per_expert: bool) -> MoeRoutingStats:
        """The totals as Python numbers (one host copy each)."""
        return MoeRoutingStats(
            layers=list(self.layers),
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_steps=self.steps,
            tokens=self.tokens.sum(dim=1).tolist(),
            busiest=self.busiest.tolist(),
            imbalance_sum=self.imbalance.tolist(),
            expert_tokens=self.tokens.tolist() if per_expert else None,
        )


class SparseMoeBlock(torch.nn.Module):
    """A decoder layer's routed feed-forward: router, stacked experts, and (Qwen2-MoE) a shared
    expert every token takes, scaled by sigmoid(shared_expert_gate(x)).

    The experts are kept stacked in the model dtype (`w13` [E, 2I, H] with gate then up rows, `w2`
    [E, H, I]), or, from a GGUF whose experts are quantized, as each expert's blocks
    (`load_expert_blocks`) run by block kernels made at `prepare`. The router (`router` [E, H]) and
    the shared gate ([1, H]) run through `F.linear` as HF's do, so the routing sees the same
    logits. The shared expert is a dense MLP on the model's linear kernels (`Linear`, prepared with
    the rest).

    Under tensor parallelism (`tp`) every rank routes every token with the whole router; `moe` is
    this rank's share (kvflow.distributed.parallel.local_config): every expert's width I and the
    shared expert's split over the ranks (gate / up rows and down columns, as the dense MLP), or,
    with expert parallelism, whole experts, this rank's range (`experts`) of them. Either way a
    rank's output is a partial sum, and one all-reduce after the block (the residual added by the
    first rank) makes it whole."""

    def __init__(
        self, hidden_size: int, moe: MoeConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        e, inter = moe.num_experts, moe.moe_intermediate_size
        self.num_experts, self.inter = e, inter
        self.tp = tp or TPGroup()
        # The experts this rank holds and computes (all of them unless expert-parallel).
        ep = moe.expert_parallel_size
        self.expert_parallel = ep > 1
        self.experts = expert_range(e, self.tp.rank, ep) if self.expert_parallel else range(e)
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.weights_dtype = torch.float32 if moe.routing_weights_float32 else dtype

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.router = param(e, hidden_size)
        self.w13 = param(len(self.experts), 2 * inter, hidden_size)
        self.w2 = param(len(self.experts), hidden_size, inter)
        shared = moe.shared_expert_intermediate_size
        self.shared_gate_up = Linear(hidden_size, 2 * shared, False, dtype, device) if shared else None
        self.shared_down = Linear(shared, hidden_size, False, dtype, device) if shared else None
        self.shared_expert_gate = param(1, hidden_size) if shared else None
        # A GGUF's quantized experts: per expert (gate, up, down) blocks until `prepare`, then kernels.
        self.expert_blocks: list[tuple[BlockQuantized, BlockQuantized, BlockQuantized]] | None = None
        self.expert_kernels: tuple[list[LinearKernel], list[LinearKernel]] | None = None  # (gate | up, down)
        # What runs the experts: "torch" (the stacked tensors, F.linear), "blocks" (a GGUF's
        # quantized experts on block kernels), "kernels" (float experts on the linear kernels) or
        # "native" (float experts on native kernels, all of a layer's in one call).
        self.path = "torch"
        self.router_f32: torch.Tensor | None = None  # (see prepare)
        # Float experts all on native kernels: run by one native call per layer (see prepare).
        self.native_experts: NativeExperts | None = None
        # Set by the model: what records this layer's routing (None: nothing is recorded), and
        # which of the model's MoE layers this is.
        self.recorder: RoutingRecorder | None = None
        self.slot = 0

    def load_expert_blocks(self, gate: BlockQuantized, up: BlockQuantized, down: BlockQuantized) -> None:
        """Take the experts in block formats: every expert's gate / up rows [E x I, H] and down rows
        [E x H, I], expert after expert (a GGUF's 3-D tensors as stored). The stacked float
        weights are dropped."""
        e, inter, hidden = len(self.experts), self.inter, self.router.shape[1]
        for name, blocks, shape in (("gate", gate, (e * inter, hidden)), ("up", up, (e * inter, hidden))):
            if blocks.shape != shape:
                raise ValueError(f"block-quantized expert {name} weights of {blocks.shape}, expected {shape}")
        if down.shape != (e * hidden, inter):
            raise ValueError(f"block-quantized expert down weights of {down.shape}, expected {(e * hidden, inter)}")
        self.expert_blocks = list(zip(gate.split_rows(e), up.split_rows(e), down.split_rows(e)))
        self.path = "blocks"
        for name in ("w13", "w2"):
            setattr(self, name, torch.nn.Parameter(self.w13.new_empty(0), requires_grad=False))

    def prepare(self, backend: str, plan: KernelPlan | None = None) -> None:
        """The experts onto kernels of `backend`, one gate | up and one down kernel per expert.
        Block-quantized experts: the block kernels (``gguf``), the blocks then the kernels' only
        copy. Float experts, on the CPU backends whose kernels take `silu_mul=`
        (`EXPERT_KERNEL_BACKENDS`): each expert's weights become its own kernels (``auto``: one
        path, `expert_kernel`; ``int4``: its Q4_1 blocks), and the stacked tensors are dropped;
        where all are native float kernels, `NativeExperts` runs the layer's in one call.
        Otherwise (``dense``, a GPU) the stacked experts stay, run by `F.linear`."""
        if self.router.dtype == torch.bfloat16 and self.router.device.type == "cpu":
            # The router's logits in bfloat16, as HF's F.linear gives them (float32 sums rounded
            # once), but through a float32 copy of its few rows: torch's bfloat16 matmul of a few
            # rows by E columns is slow on the CPU (in a profile of batch-1 decode it was most of
            # a MoE layer's own overhead).
            self.router_f32 = self.router.float()
        if self.expert_blocks is not None:
            gate_up = [make_linear_kernel(backend, [g, u]) for g, u, _ in self.expert_blocks]
            down = [make_linear_kernel(backend, [d]) for _, _, d in self.expert_blocks]
            self.expert_kernels, self.expert_blocks = (gate_up, down), None
            return
        if backend not in EXPERT_KERNEL_BACKENDS or self.w13.device.type != "cpu" or not self.w13.numel():
            return
        # .clone(): each kernel may keep a reference to its weight (the dense path does), and a
        # view would keep the whole stacked tensor alive
        gate_up = [expert_kernel(backend, w.clone(), plan) for w in self.w13]
        down = [expert_kernel(backend, w.clone(), plan) for w in self.w2]
        self.expert_kernels, self.path = (gate_up, down), "kernels"
        for name in ("w13", "w2"):
            setattr(self, name, torch.nn.Parameter(self.w13.new_empty(0), requires_grad=False))
        natives = [_native_float(k) for k in (*gate_up, *down)]
        if all(natives) and experts_library() is not None:  # every expert of the layer in one call
            self.native_experts = NativeExperts(natives[: len(gate_up)], natives[len(gate_up) :])
            self.path = "native"

    def expert_shapes(self) -> list[tuple[int, int]]:
        """The (out, in) shapes of an expert's two kernels (gate | up, down), for the autotune."""
        hidden = self.router.shape[1]
        return [(2 * self.inter, hidden), (hidden, self.inter)]

    def route(self, h: torch.Tensor) -> Routing:
        """The experts each row of h [tokens, hidden] goes to, and their weights."""
        if self.router_f32 is not None:
            logits = F.linear(h.float(), self.router_f32).to(h.dtype)
        else:
            logits = F.linear(h, self.router)
        return route(logits, self.top_k, self.renormalize, self.weights_dtype)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + the block's output for h [tokens, hidden] (the post-attention norm's output)."""
        routing = self.route(h)
        counts = None  # (grouped_experts counts the pairs itself where it needs them)
        if self.recorder is not None:
            counts = torch.bincount(routing.experts.reshape(-1), minlength=self.num_experts)
            self.recorder.record(self.slot, routing.experts, counts)
        if self.native_experts is not None:
            out = self.native_experts(h, routing.experts, routing.weights, self.experts.start).to(h.dtype)
        else:
            experts = self.expert_kernels if self.expert_kernels is not None else (self.w13, self.w2)
            out = grouped_experts(h, routing, *experts, counts=counts, first_expert=self.experts.start)
        if self.shared_down is not None:
            gate, up = self.shared_gate_up.kernel(h).chunk(2, dim=-1)
            shared = self.shared_down.kernel(F.silu(gate) * up)
            out = out + torch.sigmoid(F.linear(h, self.shared_expert_gate)) * shared
        if self.tp.size > 1:  # this rank's partial sum: one all-reduce, the residual counted once
            return self.tp.all_reduce(residual + out if self.tp.is_first else out)
        return residual + out

    def expert_bytes(self) -> int:
        """Bytes of the weights this block holds outside the linear kernels: router, experts (in
        their kernels, for block-quantized ones), and the shared expert's gate (the shared expert
        itself is in its kernels)."""
        params = (self.router, self.w13, self.w2, self.shared_expert_gate)
        held = sum(p.numel() * p.element_size() for p in params if p is not None)
        if self.expert_kernels is not None:
            held += sum(k.nbytes for kernels in self.expert_kernels for k in kernels)
        if self.expert_blocks is not None:
            held += sum(b.nbytes for parts in self.expert_blocks for b in parts)
        return held
