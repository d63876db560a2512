"""A decode-only step's decoder layers in one native call: which models can take it, and the pass
built from one (`decode_pass`), over the kernel binding kvflow.kernels.cpu.decode_pass.

At small batch the matmuls take about half of a step; most of the rest was the Python around them:
~10 calls per layer (five native kernels, views, the attention backend's dispatch) times the
layers. The pass loops over the layers in C++ with the same kernels in the same order as the
per-layer path (the linear with its fused norm / activation, the native rotary, cache write and
paged attention), so a token's hidden state is bit for bit the same whichever path ran it. It
serves int8 weights, float32 / bfloat16 ones through the native GEMV (``native``, or ``auto``
where the autotune keeps it) and block-quantized ones (GGUF formats, int4), with the native CPU
attention backend. Steps with prefill chunks take the per-layer path; so do float steps with more
rows than the autotune found the pass worth running (`max_rows`, from `KernelPlan.decode_pass_rows`).

A bfloat16 model's pass keeps its activations in float32 from the first layer to the last (its
hidden state widened on the way in, rounded on the way out; the KV cache written in bf16), where
the per-layer path rounds each op's output to bf16: both are bf16 models' approximations of the
float32 maths, the pass the closer one. Only float32 promises bit-identical paths.

LoRA adapters (`use_lora`, kvflow.lora) ride along: rows under adapters and rows of the base model
share the pass, each projection adding its adapter rows' scaling * B (A x) with the function the
per-layer path's wrapped kernels call.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvflow.attention.backend import LayerKVCache, PagedRows
from kvflow.attention.backends.cpu import CpuPagedAttention
from kvflow.kernels.cpu.block_linear import BlockQuantKernel
from kvflow.kernels.cpu.decode_pass import DecodePassKernel, LayerWeights, LoRAStep, NativeLinear
from kvflow.kernels.cpu.float_linear import NativeFloatKernel
from kvflow.kernels.cpu.int8_linear import Int8Kernel
from kvflow.kernels.cpu.paged_attention import MAX_HEAD_DIM

UNLIMITED = 1 << 30


class DecodePass(Protocol):
    """All decoder layers of a decode-only step in one call: runs on x [rows, hidden] in place, row r
    being the step's token r, with the rows the attention backend's `decode_group` returned for the
    step, for steps of up to `max_rows` rows."""

    max_rows: int

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_caches: list[LayerKVCache],
        slot_mapping: torch.Tensor,
        group: PagedRows,
    ) -> None: ...


def _native_kernel(kernel) -> NativeLinear | None:
    """The native kernel a projection runs for decode rows (None: it has none)."""
    if isinstance(kernel, Int8Kernel):
        return kernel if kernel.native else None
    if isinstance(kernel, (NativeFloatKernel, BlockQuantKernel)):
        return kernel
    return getattr(kernel, "native", None)  # TunedKernel: its native path, if the plan uses one


def max_rows(model: torch.nn.Module) -> int:
    """Up to how many rows a decode-only step runs as the pass: any for int8, block weights and a
    forced native backend, the autotune's `decode_pass_rows` under ``auto``."""
    if model.linear_backend == "auto":
        plan = model.kernel_plan
        return plan.decode_pass_rows if plan is not None else 0
    return UNLIMITED


def native_decode_unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` (a prepared LlamaForCausalLM) cannot use the native decode pass, or None."""
    cfg = model.cfg
    if cfg.is_moe:  # (the pass has no routed feed-forward: no native grouped-expert kernel yet)
        return "Mixture-of-Experts layers run on the per-layer path"
    if cfg.gemma is not None:  # (the pass runs the Llama layer: no post-norms, GeGLU or soft-cap)
        return "Gemma layers run on the per-layer path"
    if len({layer.window for layer in model.layers}) > 1:
        return "layers with different attention windows run on the per-layer path"
    if model.linear_backend not in ("int8", "native", "auto", "gguf", "int4"):
        return "it serves the int8, native float and block-quantized linear backends only"
    if not isinstance(model.attention, CpuPagedAttention):
        return "it needs the native attention backend"
    if cfg.qk_norm or cfg.head_dim > MAX_HEAD_DIM or cfg.head_dim % 2:
        return "q/k norms, or a head_dim the native rotary cannot take"
    if max_rows(model) == 0:
        return "the autotune found the native GEMV slower at one row"
    kernels = [
        _native_kernel(lin.kernel)
        for layer in model.layers
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ]
    if not all(kernels):
        return "a projection has no native kernel (the library could not be built, or the plan uses none)"
    if len({type(k) for k in kernels}) != 1:
        return "the projections mix kernel families (a GGUF with float tensors among its block ones)"
    if any(
        k.bias is not None
        for layer in model.layers
        for k in (layer.o_proj.kernel, layer.gate_up_proj.kernel, layer.down_proj.kernel)
    ):
        return "o / gate_up / down projections with a bias"
    return None


class NativeDecode:
    """The pass of one prepared model (see `native_decode_unsupported`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.cfg
        attention = model.attention
        layers = []
        for layer in model.layers:
            qkv = _native_kernel(layer.qkv_proj.kernel)
            layers.append(
                LayerWeights(
                    qkv=qkv,
                    o=_native_kernel(layer.o_proj.kernel),
                    gate_up=_native_kernel(layer.gate_up_proj.kernel),
                    down=_native_kernel(layer.down_proj.kernel),
                    qkv_bias=qkv.bias,
                    input_norm=layer.input_layernorm.float_weight(),
                    post_norm=layer.post_attention_layernorm.float_weight(),
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
            scale=cfg.head_dim**-0.5,
        )
        self.max_rows = max_rows(model)
        self._bound: list[LayerKVCache] | None = None
        self._lora = None  # (the LoRABatch the wrapped projections read, and its slots as the pass reads them)

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
    ) -> None:
        if kv_caches is not self._bound:
            self.kernel.bind_kv([kv.data for kv in kv_caches], [kv.scale for kv in kv_caches])
            self._bound = kv_caches
        lora = None
        if self._lora is not None and self._lora[0].rows is not None:
            lora = (self._lora[1], self._lora[0].rows)
        self.kernel(x, cos, sin_signed, slot_mapping, group.tables, group.context_lens, group.tokens, lora)


def decode_pass(model: torch.nn.Module) -> DecodePass | None:
    """The native pass for `model`'s decode-only steps, or None when it cannot take them."""
    return NativeDecode(model) if native_decode_unsupported(model) is None else None
