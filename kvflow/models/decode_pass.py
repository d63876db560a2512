"""A decode step's decoder layers in one native call: which models can take it, and the pass
built from one (`decode_pass`), over the kernel binding kvflow.kernels.cpu.decode_pass.

At small batch the matmuls take about half of a step; most of the rest was the Python around them:
~10 calls per layer (five native kernels, views, the attention backend's dispatch) times the
layers. The pass loops over the layers in C++ with the same kernels in the same order as the
per-layer path (the linear with its fused norm / activation, the native rotary, cache write and
paged attention), so a token's hidden state is bit for bit the same whichever path ran it. It
serves int8 weights, float32 / bfloat16 ones through the native GEMV (``native``, or ``auto``
where the autotune keeps it) and block-quantized ones (GGUF formats, int4), with the native CPU
attention backend. A decode step here: every sequence's new tokens a decode, or a decode with the
drafts it verifies (speculative decoding), or as short a prompt chunk: up to DECODE_LIKE_ROWS rows
of one sequence, which attend to each other's keys as the per-layer path's rows do (the attention
backend's `decode_group`). Steps with longer prefill chunks take the per-layer path; so do float
steps with more rows than the autotune found the pass worth running (`max_rows`, from
`KernelPlan.decode_pass_rows`).

A bfloat16 model's pass keeps its activations in float32 from the first layer to the last (its
hidden state widened on the way in, rounded on the way out; the KV cache written in bf16), where
the per-layer path rounds each op's output to bf16: both are bf16 models' approximations of the
float32 maths, the pass the closer one. Only float32 promises bit-identical paths.

Models with q/k norms (Qwen3's per head, OLMoE's over the whole projection) run them in the pass
with the native function the per-layer path calls on float32 models (kvflow.kernels.cpu.qk_norm),
then the native rotary: float32 stays bit for bit; a bfloat16 model's per-layer path norms in
torch, so there as elsewhere the pass is the float32 approximation.

LoRA adapters (`use_lora`, kvflow.lora) ride along: rows under adapters and rows of the base model
share the pass, each projection adding its adapter rows' scaling * B (A x) with the function the
per-layer path's wrapped kernels call.

Mixture-of-Experts layers (kvflow.layers.moe.SparseMoeBlock) ride along where every layer's experts
are on native float kernels (`NativeExperts`) and the model is not sharded: the router runs on a
native float32 kernel, the softmax and top-k in C++, the experts through the same native call as
the per-layer path's. The router's logits are then float32 sums in the kernel's order, not torch's
`F.linear`: a token's hidden state stays within float32 rounding of the per-layer path's, not bit
for bit, and a routing choice could differ from HF's only where two experts' probabilities lie
within that rounding. An exact tie (the same probability twice among a row's top-k, or at its
edge: which one torch.topk keeps is torch's choice) stops the pass, and the step runs on the
per-layer path instead, from a copy of its input. The experts each row chose come back from the
pass (`on_routed`: the model's routing telemetry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvflow.attention.backend import LayerKVCache, PagedRows
from kvflow.attention.backends.cpu import CpuPagedAttention
from kvflow.kernels.cpu.block_linear import BlockQuantKernel
from kvflow.kernels.cpu.decode_pass import DecodePassKernel, LayerWeights, LoRAStep, MoeWeights, NativeLinear
from kvflow.kernels.cpu.float_linear import NativeFloatKernel
from kvflow.kernels.cpu.int8_linear import Int8Kernel
from kvflow.kernels.cpu.paged_attention import MAX_HEAD_DIM
from kvflow.kernels.cpu.qk_norm import PER_HEAD, WHOLE
from kvflow.kernels.cpu.qk_norm import available as qk_norm_available

UNLIMITED = 1 << 30


class DecodePass(Protocol):
    """All decoder layers of a decode step in one call: runs on x [rows, hidden] in place, row r
    being the step's token r, with the rows the attention backend's `decode_group` returned for the
    step, for steps of up to `max_rows` rows. Returns False, x as it came, where the step must run
    on the per-layer path instead (a routing tie: see the module)."""

    max_rows: int

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_caches: list[LayerKVCache],
        slot_mapping: torch.Tensor,
        group: PagedRows,
    ) -> bool: ...


def _native_kernel(kernel) -> NativeLinear | None:
    """The native kernel a projection runs for decode rows (None: it has none)."""
    if isinstance(kernel, Int8Kernel):
        return kernel if kernel.native else None
    if isinstance(kernel, (NativeFloatKernel, BlockQuantKernel)):
        return kernel
    return getattr(kernel, "native", None)  # TunedKernel: its native path, if the plan uses one


def max_rows(model: torch.nn.Module) -> int:
    """Up to how many rows a decode step runs as the pass: any for int8, block weights and a
    forced native backend, the autotune's `decode_pass_rows` under ``auto``."""
    if model.linear_backend == "auto":
        plan = model.kernel_plan
        return plan.decode_pass_rows if plan is not None else 0
    return UNLIMITED


def native_decode_unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` (a prepared LlamaForCausalLM) cannot use the native decode pass, or None."""
    cfg = model.cfg
    if cfg.is_moe:
        why = _moe_unsupported(model)
        if why is not None:
            return why
    if cfg.gemma is not None:  # (the pass runs the Llama layer: no post-norms, GeGLU or soft-cap)
        return "Gemma layers run on the per-layer path"
    if model.rotary_local is not None:
        return "layers rotating by two rotary tables (local and global) run on the per-layer path"
    if len({layer.window for layer in model.layers}) > 1:
        return "layers with different attention windows run on the per-layer path"
    if model.linear_backend not in ("int8", "native", "auto", "gguf", "int4"):
        return "it serves the int8, native float and block-quantized linear backends only"
    if not isinstance(model.attention, CpuPagedAttention):
        return "it needs the native attention backend"
    if not all(layer.llama_attention for layer in model.layers):
        return "its layers' attention is not the Llama layer's (the pass runs that one)"
    if cfg.qk_norm and (cfg.clip_qkv is not None or not qk_norm_available()):
        return "q/k norms with clip_qkv (an OLMoE option) run on the per-layer path"
    if cfg.head_dim > MAX_HEAD_DIM or cfg.head_dim % 2:
        return "a head_dim the native rotary cannot take"
    if max_rows(model) == 0:
        return "the autotune found the native GEMV slower at one row"
    kernels = _pass_kernels(model)
    if not all(kernels):
        return "a projection has no native kernel (the library could not be built, or the plan uses none)"
    if len({type(k) for k in kernels}) != 1:
        return "the projections mix kernel families (a GGUF with float tensors among its block ones)"
    if any(lin.kernel.bias is not None for layer in model.layers for lin in (layer.o_proj, *_dense_mlp(layer))):
        return "o / gate_up / down projections with a bias"
    return None


def _pass_kernels(model: torch.nn.Module) -> list[NativeLinear | None]:
    """The native kernel of every projection the pass runs (None where one has none)."""
    return [
        _native_kernel(lin.kernel)
        for layer in model.layers
        for lin in (layer.qkv_proj, layer.o_proj, *_dense_mlp(layer))
    ]


def _dense_mlp(layer: torch.nn.Module) -> tuple:
    """A layer's gate_up and down projections, or () for a routed layer."""
    return () if layer.gate_up_proj is None else (layer.gate_up_proj, layer.down_proj)


def _moe_unsupported(model: torch.nn.Module) -> str | None:
    """Why the routed layers of `model` cannot ride in the pass, or None."""
    if model.tp.size > 1:
        return "Mixture-of-Experts layers under tensor or expert parallelism run on the per-layer path"
    for block in model.moe_blocks:
        if block.native_experts is None:
            return f"Mixture-of-Experts layers whose experts are not on native float kernels ({block.path}) run on the per-layer path"
        if block.shared_down is not None and not all(
            isinstance(_native_kernel(lin.kernel), NativeFloatKernel)
            for lin in (block.shared_gate_up, block.shared_down)
        ):
            return "a shared expert not on native float kernels runs on the per-layer path"
    return None


def _moe_weights(block) -> MoeWeights:
    """A `SparseMoeBlock`'s routed feed-forward as the pass reads it (its router and shared gate in
    float32 on native kernels of their own: a few rows by hidden each)."""
    router = block.router_f32 if block.router_f32 is not None else block.router.detach().float()
    shared = block.shared_down is not None
    return MoeWeights(
        router=NativeFloatKernel(router.contiguous(), None),
        experts=block.native_experts,
        top_k=block.top_k,
        renormalize=block.renormalize,
        shared_gate_up=_native_kernel(block.shared_gate_up.kernel) if shared else None,
        shared_down=_native_kernel(block.shared_down.kernel) if shared else None,
        shared_gate=NativeFloatKernel(block.shared_expert_gate.detach().float().contiguous(), None) if shared else None,
    )


class NativeDecode:
    """The pass of one prepared model (see `native_decode_unsupported`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.cfg
        attention = model.attention
        layers = []
        for layer in model.layers:
            qkv = _native_kernel(layer.qkv_proj.kernel)
            dense = bool(_dense_mlp(layer))
            layers.append(
                LayerWeights(
                    qkv=qkv,
                    o=_native_kernel(layer.o_proj.kernel),
                    gate_up=_native_kernel(layer.gate_up_proj.kernel) if dense else None,
                    down=_native_kernel(layer.down_proj.kernel) if dense else None,
                    qkv_bias=qkv.bias,
                    input_norm=layer.input_layernorm.float_weight(),
                    post_norm=layer.post_attention_layernorm.float_weight(),
                    moe=None if dense else _moe_weights(layer.moe),
                    q_norm=layer.q_norm.float_weight() if cfg.qk_norm else None,
                    k_norm=layer.k_norm.float_weight() if cfg.qk_norm else None,
                    rope=layer.rope,
                )
            )
        self.kernel = DecodePassKernel(
            layers,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=attention.block_size,
            window=model.layers[0].window or 0,  # (every layer's: see native_decode_unsupported)
            eps=cfg.rms_norm_eps,
            scale=model.layers[0].scale,  # (head_dim ** -0.5, or Granite's attention_multiplier)
            qk_norm=0 if not cfg.qk_norm else PER_HEAD if cfg.qk_norm_per_head else WHOLE,
        )
        self.max_rows = max_rows(model)
        # Rows the block kernels compute per pass over a weight (a step of more reads each weight
        # again per further tile: kvflow.core.step_cost); 0 for the other kernel families, whose
        # costs are not modelled that way.
        self.tile_rows = min((k.tile_rows for k in _pass_kernels(model) if isinstance(k, BlockQuantKernel)), default=0)
        self._bound: list[LayerKVCache] | None = None
        self._lora = None  # (the LoRABatch the wrapped projections read, and its slots as the pass reads them)
        # Routed layers: called after each step with its rows' chosen experts, int64 [routed layers,
        # rows, top_k] (the model's routing telemetry), or None.
        self.on_routed: Callable[[torch.Tensor], None] | None = None
        self.ties = 0  # steps that left the pass for the per-layer path on a routing tie

    def use_lora(self, batch) -> None:
        """Run `batch`'s adapters (a kvflow.lora.layers.LoRABatch: resident slots per layer, and
        each step's rows under them, None for none) in the pass."""
        self._lora = (batch, LoRAStep(batch.slots))

    @property
    def phase_seconds(self) -> torch.Tensor | None:
        """A float64 tensor of len(kvflow.kernels.cpu.decode_pass.PHASES) to which each call adds
        the seconds spent per phase; None (the default) for none."""
        return self.kernel.phase_seconds

    @phase_seconds.setter
    def phase_seconds(self, value: torch.Tensor | None) -> None:
        self.kernel.phase_seconds = value

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_caches: list[LayerKVCache],
        slot_mapping: torch.Tensor,
        group: PagedRows,
    ) -> bool:
        if kv_caches is not self._bound:
            self.kernel.bind_kv([kv.data for kv in kv_caches], [kv.scale for kv in kv_caches])
            self._bound = kv_caches
        lora = None
        if self._lora is not None and self._lora[0].rows is not None:
            lora = (self._lora[1], self._lora[0].rows)
        k = self.kernel
        if not k.num_routed:
            return k(x, cos, sin_signed, slot_mapping, group.tables, group.context_lens, group.tokens, lora)
        routed = torch.empty(k.num_routed, x.shape[0], k.top_k, dtype=torch.int64)
        before = x.clone()  # (a tie stops the pass part way: the per-layer path starts again from here)
        if not k(x, cos, sin_signed, slot_mapping, group.tables, group.context_lens, group.tokens, lora, routed):
            x.copy_(before)
            self.ties += 1
            return False
        if self.on_routed is not None:
            self.on_routed(routed)
        return True


def decode_pass(model: torch.nn.Module) -> DecodePass | None:
    """The native pass for `model`'s decode steps, or None when it cannot take them."""
    return NativeDecode(model) if native_decode_unsupported(model) is None else None
