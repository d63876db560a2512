"""Binding of csrc/decode_pass.cpp: a decode step's decoder layers in one native call, over
int8 weights (`Int8Kernel`), float32 or bfloat16 ones (`NativeFloatKernel`) or block-quantized
ones (`BlockQuantKernel`: GGUF formats, int4).

The C++ loop runs, per layer, the same kernels in the same order as the per-layer path (each
linear with its fused norm / activation, the native rotary, cache write and paged attention), so a
token's hidden state is bit for bit the same whichever path ran it (float32; a bfloat16 model's
pass keeps its activations in float32 from the first layer to the last). With LoRA adapters
(`LoRAStep`) each projection's adapter rows get their scaling * B (A x) in the pass too, from the
function the per-layer path calls (csrc/lora.cpp, kvflow.kernels.cpu.lora). What a layer is made
of and when a model may run the pass is the model side's: kvflow.models.decode_pass.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvflow.kernels.cpu.block_linear import BlockQuantKernel
from kvflow.kernels.cpu.float_linear import NativeFloatKernel
from kvflow.kernels.cpu.int8_linear import Int8Kernel, int8_library
from kvflow.kernels.cpu.lora import LoRAProjection, LoRARows, NativeProj, NativeRows
from kvflow.kernels.cpu.moe_experts import NativeExperts
from kvflow.kernels.cpu.paged_attention import KV_FORMATS

_I, _F, _P = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class _Shape(ctypes.Structure):  # DecoderShape in csrc/decode_pass.cpp
    _fields_ = [
        (n, _I)
        for n in (
            "num_layers",
            "hidden",
            "intermediate",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "block_size",
            "window",
            "kv_format",
        )
    ] + [("eps", _F), ("scale", _F), ("qk_norm", _I)]


class _MoeLayer(ctypes.Structure):  # kvflow::MoeLayer in csrc/moe_experts.h
    _fields_ = [(n, _P) for n in ("router", "gate_up", "down", "shared_gate_up", "shared_down", "shared_gate")] + [
        (n, _I) for n in ("num_experts", "top_k", "renormalize", "slot")
    ]


class _Layer(ctypes.Structure):  # DecoderLayer in csrc/decode_pass.cpp
    _fields_ = [
        (n, _P) for n in ("qkv", "o", "gate_up", "down", "qkv_bias", "input_norm", "post_norm", "kv_cache", "kv_scales")
    ] + [("moe", ctypes.POINTER(_MoeLayer)), ("q_norm", _P), ("k_norm", _P), ("rope", _I)]


class _LoraStep(ctypes.Structure):  # LoraStep in csrc/decode_pass.cpp
    _fields_ = [("projs", ctypes.POINTER(NativeProj)), ("rows", NativeRows), ("max_tk", _I)]


_ARGS = [
    ctypes.POINTER(_Shape),
    ctypes.POINTER(_Layer),
    _P,
    _I,
    _P,
    _P,
    _P,
    _P,
    ctypes.c_long,
    _P,
    _P,
    _P,
    _I,
    ctypes.POINTER(_LoraStep),
    _P,
]
_SIGNATURES = {
    "kvflow_int8_decode": (_ARGS, _I),
    "kvflow_float_decode": (_ARGS, _I),
    "kvflow_block_decode": (_ARGS, _I),
}
# The pass's entry point per kernel family (every projection of the model must be of one).
ENTRY = {
    Int8Kernel: "kvflow_int8_decode",
    NativeFloatKernel: "kvflow_float_decode",
    BlockQuantKernel: "kvflow_block_decode",
}
PHASES = (
    "qkv projection (+ RMSNorm)",
    "rotary + cache write + attention",
    "o projection (+ residual)",
    "gate_up projection (+ RMSNorm)",
    "down projection (+ silu*mul, residual); a routed layer's whole feed-forward",
)
TIE = 1  # what a call returns when a routed layer's top-k ties (see DecodePassKernel.__call__)

NativeLinear = Int8Kernel | NativeFloatKernel | BlockQuantKernel
LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a layer's, in the pass's order


class LoRAStep:
    """The resident adapters as the pass reads them: per layer, its projections' stacked slots
    (`LORA_PROJECTIONS`; a projection missing from a layer's dict takes none). `for_rows` gives
    the step's argument."""

    def __init__(self, slots: list[dict[str, LoRAProjection]]) -> None:
        self._slots = slots  # (what the pointers below point into)
        self.projs = (NativeProj * (len(LORA_PROJECTIONS) * len(slots)))()
        max_tk = 1
        for i, layer in enumerate(slots):
            for j, name in enumerate(LORA_PROJECTIONS):
                proj = layer.get(name)
                if proj is not None:  # (else all zeros: a null `a`)
                    self.projs[i * len(LORA_PROJECTIONS) + j] = proj.native
                    max_tk = max(max_tk, proj.native.parts * proj.native.rmax)
        self.step = _LoraStep(self.projs, NativeRows(), max_tk)

    def for_rows(self, rows: LoRARows) -> _LoraStep:
        self.step.rows = rows.native
        return self.step


@dataclass
class MoeWeights:
    """A routed feed-forward as the pass reads it: the router (float32 [experts, hidden], on a
    native float kernel), every expert (`NativeExperts`: native float kernels), how many experts
    a token takes and whether their weights are renormalised, and Qwen2-MoE's shared expert (its
    gate | up and down kernels and its gate, float32 [1, hidden]) or Nones."""

    router: NativeFloatKernel
    experts: NativeExperts
    top_k: int
    renormalize: bool
    shared_gate_up: NativeFloatKernel | None = None
    shared_down: NativeFloatKernel | None = None
    shared_gate: NativeFloatKernel | None = None


@dataclass
class LayerWeights:
    """One decoder layer as the pass reads it: its four projections' native kernels (one family),
    the qkv bias and the two RMSNorm weights in float32 (o, gate_up and down take no bias). A
    routed layer has `moe` (native float kernels) instead of gate_up and down."""

    qkv: NativeLinear
    o: NativeLinear
    gate_up: NativeLinear | None
    down: NativeLinear | None
    qkv_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    moe: MoeWeights | None = None
    q_norm: torch.Tensor | None = None  # q/k norms' float32 weights (the pass's `qk_norm`), or None
    k_norm: torch.Tensor | None = None
    rope: bool = True  # False: the layer does not rotate q and k (SmolLM3's NoPE layers)


class DecodePassKernel:
    """The native pass over `layers`, for a model of the given shape (`window`: the sliding window,
    0 for none; `scale`: the attention's softmax scale; `eps`: the RMSNorms')."""

    def __init__(
        self,
        layers: list[LayerWeights],
        *,
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        window: int,
        eps: float,
        scale: float,
        qk_norm: int = 0,
    ) -> None:
        """`qk_norm`: 0, or q/k norms after the qkv projection with the layers' `q_norm` / `k_norm`
        weights, per head (1) or over the whole projection (2): kvflow.kernels.cpu.qk_norm."""
        self._fn = getattr(int8_library(_SIGNATURES), ENTRY[type(layers[0].qkv)])
        self.shape = _Shape(
            num_layers=len(layers),
            hidden=hidden,
            intermediate=intermediate,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            window=window,
            kv_format=0,
            eps=eps,
            scale=scale,
            qk_norm=qk_norm,
        )
        self.layers = (_Layer * len(layers))()
        self._moe = []  # (the routed layers' structs, which the layers point to)
        for dst, w in zip(self.layers, layers):
            dst.qkv, dst.o = w.qkv.native_handle, w.o.native_handle
            if w.moe is None:
                dst.gate_up, dst.down = w.gate_up.native_handle, w.down.native_handle
            else:
                self._moe.append(_moe_layer(w.moe, len(self._moe)))
                dst.moe = ctypes.pointer(self._moe[-1])
            dst.qkv_bias = None if w.qkv_bias is None else w.qkv_bias.data_ptr()
            dst.input_norm, dst.post_norm = w.input_norm.data_ptr(), w.post_norm.data_ptr()
            if qk_norm:
                dst.q_norm, dst.k_norm = w.q_norm.data_ptr(), w.k_norm.data_ptr()
            dst.rope = int(w.rope)
        self._weights = layers  # (what the pointers above point into)
        # Routed layers: how many, and the experts a token takes in each (the `routed` buffer's shape).
        self.num_routed = len(self._moe)
        self.top_k = self._moe[0].top_k if self._moe else 0
        # Set to a float64 tensor of len(PHASES) to have each call add the seconds spent per phase.
        self.phase_seconds: torch.Tensor | None = None

    def bind_kv(self, data: list[torch.Tensor], scales: list[torch.Tensor | None]) -> None:
        """The KV cache the calls read and write: per layer its data [num_blocks, block_size, 2,
        kv_heads, head_dim] and, for a quantized cache (int8, fp8, int4), its scales."""
        for dst, d, s in zip(self.layers, data, scales):
            dst.kv_cache = d.data_ptr()
            dst.kv_scales = None if s is None else s.data_ptr()
        self.shape.kv_format = KV_FORMATS[data[0].dtype]

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        slot_mapping: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor,
        tokens: torch.Tensor,
        lora: tuple[LoRAStep, LoRARows] | None = None,
        routed: torch.Tensor | None = None,
    ) -> bool:
        """Runs every decoder layer on x [rows, hidden] (contiguous; float32, or bfloat16: widened
        for the pass and rounded back) in place; row r is the step's token r (a sequence's rows, a
        decode and the drafts it verifies, next to each other), attending to the first
        context_lens[r] keys of block table tables[r] (int32). `lora`: the resident adapters and
        the step's rows under them, or None. `routed`: with routed layers, int64 [num_routed, rows,
        top_k] that receives each routed layer's chosen experts per row.

        Returns False where a routed layer's top-k probabilities tied: the call stopped there, x
        and the KV cache partly written; the caller runs the step again another way (whose
        torch.topk breaks the tie as HF's routers do), from its own copy of x."""
        h = x if x.dtype == torch.float32 else x.float()
        if cos.dtype != torch.float32:
            cos, sin_signed = cos.float(), sin_signed.float()
        rc = self._fn(
            ctypes.byref(self.shape),
            self.layers,
            h.data_ptr(),
            h.shape[0],
            cos.data_ptr(),
            sin_signed.data_ptr(),
            slot_mapping.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            context_lens.data_ptr(),
            tokens.data_ptr(),
            None if self.phase_seconds is None else self.phase_seconds.data_ptr(),
            torch.get_num_threads(),
            None if lora is None else ctypes.byref(lora[0].for_rows(lora[1])),
            None if routed is None else routed.data_ptr(),
        )
        if rc == TIE:
            return False
        if rc != 0:
            raise RuntimeError("native decode refused the attention shape")
        if h is not x:
            x.copy_(h)
        return True


def _moe_layer(w: MoeWeights, slot: int) -> _MoeLayer:
    experts = w.experts
    shared = [None if k is None else k.native_handle for k in (w.shared_gate_up, w.shared_down, w.shared_gate)]
    return _MoeLayer(
        w.router.native_handle,
        ctypes.cast(experts.gate_up_handles, _P),
        ctypes.cast(experts.down_handles, _P),
        *shared,
        len(experts),
        w.top_k,
        int(w.renormalize),
        slot,
    )
