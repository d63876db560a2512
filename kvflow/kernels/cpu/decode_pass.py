"""A decode-only step's decoder layers in one native call (csrc/decode_pass.cpp), over int8 weights
(`Int8Kernel`), float32 or bfloat16 ones (the native GEMV, `NativeFloatKernel`, under the ``native``
or ``auto`` backend) or block-quantized ones (`BlockQuantKernel`: GGUF formats, int4).

At small batch the matmuls take about half of a step; most of the rest was the Python around them:
~10 calls per layer (five native kernels, views, the attention backend's dispatch) x 30 layers.
Here the layers loop in C++ over the same kernels in the same order as the per-layer path (the
linear with its fused norm / activation, the native rotary, cache write and paged attention), so a
token's hidden state is bit for bit the same whichever path ran it. Steps with prefill chunks take
the per-layer path; so do fp32 / bf16 steps with more rows than the autotune found the native GEMM
worth running (`max_rows`, from `KernelPlan.decode_pass_rows`). The model gets it from its attention
backend (`CpuPagedAttention.decode_pass`), as a `kvflow.layers.attention.DecodePass`.

A bfloat16 model's pass keeps its activations in float32 from the first layer to the last (its
hidden state widened on the way in, rounded on the way out; the KV cache written in bf16), where
the per-layer path rounds each op's output to bf16: both are bf16 models' approximations of the
float32 maths, the pass the closer one. Only float32 promises bit-identical paths.
"""

from __future__ import annotations

import ctypes

import torch

from kvflow.kernels.cpu.block_linear import BlockQuantKernel
from kvflow.kernels.cpu.float_linear import NativeFloatKernel
from kvflow.kernels.cpu.int8_linear import Int8Kernel, int8_library
from kvflow.kernels.cpu.paged_attention import KV_FORMATS, MAX_HEAD_DIM, CpuPagedAttention, NativeGroup
from kvflow.layers.attention import LayerKVCache

_I, _F, _P = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class _Shape(ctypes.Structure):  # DecoderShape in csrc/decode_pass.cpp
    _fields_ = [(n, _I) for n in ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim",
                                  "block_size", "window", "kv_format")] + [("eps", _F), ("scale", _F)]


class _Layer(ctypes.Structure):  # DecoderLayer in csrc/decode_pass.cpp
    _fields_ = [(n, _P) for n in ("qkv", "o", "gate_up", "down", "qkv_bias", "input_norm", "post_norm", "kv_cache",
                                  "kv_scales")]


_ARGS = [ctypes.POINTER(_Shape), ctypes.POINTER(_Layer), _P, _I, _P, _P, _P, _P, ctypes.c_long, _P, _P, _P, _I]
_SIGNATURES = {"kvflow_int8_decode": (_ARGS, _I), "kvflow_float_decode": (_ARGS, _I), "kvflow_block_decode": (_ARGS, _I)}
# The pass's entry point per kernel family (every projection of the model must be of one).
_ENTRY = {Int8Kernel: "kvflow_int8_decode", NativeFloatKernel: "kvflow_float_decode", BlockQuantKernel: "kvflow_block_decode"}
PHASES = ("qkv projection (+ RMSNorm)", "rotary + cache write + attention", "o projection (+ residual)",
          "gate_up projection (+ RMSNorm)", "down projection (+ silu*mul, residual)")
UNLIMITED = 1 << 30


def _native_kernel(kernel) -> Int8Kernel | NativeFloatKernel | BlockQuantKernel | None:
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
    if model.linear_backend not in ("int8", "native", "auto", "gguf", "int4"):
        return "it serves the int8, native float and block-quantized linear backends only"
    if not isinstance(model.attention, CpuPagedAttention):
        return "it needs the native attention backend"
    if cfg.qk_norm or cfg.head_dim > MAX_HEAD_DIM or cfg.head_dim % 2:
        return "q/k norms, or a head_dim the native rotary cannot take"
    if max_rows(model) == 0:
        return "the autotune found the native GEMV slower at one row"
    kernels = [_native_kernel(lin.kernel) for layer in model.layers
               for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    if not all(kernels):
        return "a projection has no native kernel (the library could not be built, or the plan uses none)"
    if len({type(k) for k in kernels}) != 1:
        return "the projections mix kernel families (a GGUF with float tensors among its block ones)"
    if any(k.bias is not None for layer in model.layers for k in (layer.o_proj.kernel, layer.gate_up_proj.kernel,
                                                                 layer.down_proj.kernel)):
        return "o / gate_up / down projections with a bias"
    return None


class NativeDecode:
    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.cfg
        attention: CpuPagedAttention = model.attention
        fn = _ENTRY[type(_native_kernel(model.layers[0].qkv_proj.kernel))]
        self._fn = getattr(int8_library(_SIGNATURES), fn)
        self.max_rows = max_rows(model)
        self.shape = _Shape(num_layers=cfg.num_layers, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                            block_size=attention.block_size, window=attention.sliding_window or 0, kv_format=0,
                            eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5)
        self.layers = (_Layer * cfg.num_layers)()
        for dst, layer in zip(self.layers, model.layers):
            qkv = _native_kernel(layer.qkv_proj.kernel)
            dst.qkv, dst.o = qkv.native_handle, _native_kernel(layer.o_proj.kernel).native_handle
            dst.gate_up = _native_kernel(layer.gate_up_proj.kernel).native_handle
            dst.down = _native_kernel(layer.down_proj.kernel).native_handle
            dst.qkv_bias = None if qkv.bias is None else qkv.bias.data_ptr()
            dst.input_norm = layer.input_layernorm.float_weight().data_ptr()
            dst.post_norm = layer.post_attention_layernorm.float_weight().data_ptr()
        self._bound: list[LayerKVCache] | None = None
        # Set to a float64 tensor of len(PHASES) to have each call add the seconds spent per phase.
        self.phase_seconds: torch.Tensor | None = None

    def _bind(self, kv_caches: list[LayerKVCache]) -> None:
        for dst, kv in zip(self.layers, kv_caches):
            dst.kv_cache = kv.data.data_ptr()
            dst.kv_scales = None if kv.scale is None else kv.scale.data_ptr()
        self.shape.kv_format = KV_FORMATS[kv_caches[0].data.dtype]
        self._bound = kv_caches

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, kv_caches: list[LayerKVCache],
                 slot_mapping: torch.Tensor, group: NativeGroup) -> None:
        """Runs every decoder layer on x [rows, hidden] (contiguous; float32, or bfloat16: widened
        for the pass and rounded back) in place; row r is the step's token r, one per sequence."""
        if kv_caches is not self._bound:
            self._bind(kv_caches)
        h = x if x.dtype == torch.float32 else x.float()
        if cos.dtype != torch.float32:
            cos, sin_signed = cos.float(), sin_signed.float()
        rc = self._fn(ctypes.byref(self.shape), self.layers, h.data_ptr(), h.shape[0], cos.data_ptr(),
                      sin_signed.data_ptr(), slot_mapping.data_ptr(), group.tables.data_ptr(), group.tables.stride(0),
                      group.context_lens.data_ptr(), group.tokens.data_ptr(),
                      None if self.phase_seconds is None else self.phase_seconds.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("native decode refused the attention shape")
        if h is not x:
            x.copy_(h)
