"""The int8 linear (W8A8 through FBGEMM) on the CPU: `Int8Kernel` and the ctypes bindings of its
native library (csrc/int8_linear.cpp, FBGEMM called directly), with the torch-op path
(`torch.ops.quantized`) where that library cannot be built.
"""

from __future__ import annotations

import ctypes
import os
import warnings
import weakref

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import native
from kvflow.kernels.norm import NormWeights, rms_norm
from kvflow.quantization.int8 import quantize_weight_per_channel

# FBGEMM's AVX2 kernels multiply u8 activations by s8 weights with vpmaddubsw, which can saturate
# the int16 sum of two adjacent products; 7-bit activations rule that out at a cost in accuracy.
# With AVX512-VNNI the products accumulate in int32 and 8 bits are exact. None = decide at first
# use by probing the kernel on a saturating input (`activation_qparams`); True/False force 7/8 bits.
INT8_REDUCE_RANGE: bool | None = None


class Int8Kernel:
    """W8A8 with per-token activation scales through FBGEMM.

    Each row (token) of the input is divided by its own max |x| and quantized with a fixed symmetric
    scale, x_q = round(127 * x / max|x|) + 128; FBGEMM's int8 GEMM accumulates in int32, dequantizes
    per output channel, and the row is multiplied back by max|x|. Every token gets the full 8-bit
    range whatever the other tokens of the batch hold (with one scale per tensor, as `linear_dynamic`
    does, a token with massive activations flattens the others: perplexity +200% on SmolLM2-135M),
    and a token's result does not depend on what it is batched with.

    `norm=<NormWeights>` or `silu_mul=True` apply the op that produces the projection's input first
    (that RMSNorm; silu(x[:, :k]) * x[:, k:]), and `residual` is added to the output: with the native
    library (csrc/int8_linear.cpp, FBGEMM called directly) a projection and its neighbours are then
    one call; without it, the same maths runs as torch ops around `torch.ops.quantized`. The
    ``int8`` backend of kvflow.layers.linear_kernels.
    """

    backend = "int8"

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`quantized`: (int8 [out, in], float32 scales [out]) already quantized (a W8A8
        checkpoint's, as stored) instead of a float `weight` to quantize."""
        if quantized is not None:
            q, scale = quantized[0].contiguous(), quantized[1].float().contiguous()
            if q.dtype != torch.int8 or scale.shape != (q.shape[0],):
                raise ValueError(
                    f"int8 weights need int8 [out, in] and [out] scales, got {q.dtype} {tuple(scale.shape)}"
                )
        else:
            q, scale = quantize_weight_per_channel(weight.detach())
        if q.device.type != "cpu":
            raise ValueError("the int8 linear backend (FBGEMM) is CPU only")
        self.out_features, self.in_features = q.shape
        # The bias is added after the per-token rescale, so it stays out of the packed weight.
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        self.x_scale, self.x_zero_point = activation_qparams()
        # The packed weight in the native library (csrc/int8_linear.cpp); None: the torch-op path.
        self._lib = int8_library()
        self.native_handle: int | None = None
        if self._lib is not None:
            self.native_handle = self._lib.kvflow_int8_pack(
                q.contiguous().data_ptr(),
                scale.contiguous().data_ptr(),
                self.out_features,
                self.in_features,
                self.x_zero_point - 1,
            )
        if self.native_handle is not None:
            weakref.finalize(self, self._lib.kvflow_int8_free, self.native_handle)
        else:
            self.packed = fbgemm_prepack(q, scale)
            self._op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32

    @property
    def native(self) -> bool:
        return self.native_handle is not None

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        norm: NormWeights | None = None,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        if self.native:  # any dtype and shape: float32 rows made, the result back in x's dtype
            return native.fused_linear(self, self._lib.kvflow_int8_linear, x, residual, norm, silu_mul, "int8 linear")
        dtype = x.dtype
        if x.shape[-1] != (2 if silu_mul else 1) * self.in_features:
            raise ValueError(
                f"int8 linear of {self.in_features} inputs got rows of {x.shape[-1]}"
                + (" (silu_mul takes gate and up: twice the inputs)" if silu_mul else "")
            )
        if norm is not None:
            x = rms_norm(x, norm.weight, norm.eps)
        x = x.float()
        if silu_mul:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        r = x.abs().amax(-1, keepdim=True).clamp_min_(1e-30)
        y = self._op(x / r, self.x_scale, self.x_zero_point, self.packed).mul_(r)
        if self.bias is not None:
            y = y.add_(self.bias)
        y = y if dtype == torch.float32 else y.to(dtype)
        return y if residual is None else residual + y

    def dequantized_weight(self) -> torch.Tensor:
        if not self.native:
            return torch.ops.quantized.linear_unpack(self.packed)[0].dequantize()
        q = torch.empty(self.out_features, self.in_features, dtype=torch.int8)
        scale = torch.empty(self.out_features)
        self._lib.kvflow_int8_unpack(self.native_handle, q.data_ptr(), scale.data_ptr())
        return q.float() * scale[:, None]

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.out_features * self.in_features + 4 * self.out_features + bias


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_INT8_SIGNATURES = {
    "kvflow_int8_pack": ([_P, _P, _I, _I, _I], _P),
    "kvflow_int8_free": ([_P], None),
    "kvflow_int8_unpack": ([_P, _P, _P], None),
    "kvflow_int8_linear": ([_P, _P, _L, _I, _I, _P, _F, _P, _P, _L, _P, _I], None),
}


def int8_library(signatures: dict[str, native.Signature] = _INT8_SIGNATURES) -> ctypes.CDLL | None:
    """The native linear library (csrc/int8_linear.cpp, float_linear.cpp, decode_pass.cpp) with `signatures` typed, or
    None (the torch-op path) when it cannot be built here or KVFLOW_INT8_NATIVE=0 asks for the torch
    path."""
    if os.environ.get("KVFLOW_INT8_NATIVE", "1") == "0":
        return None
    return native.load("linear", signatures)


def fbgemm_prepack(q: torch.Tensor, scale: torch.Tensor):
    """FBGEMM-packed int8 weight [out, in] with one symmetric scale per output channel, as torch's
    quantized linear ops take it."""
    with warnings.catch_warnings():  # torch deprecates quantized tensors; FBGEMM's prepack takes one
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(
            q, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0
        )
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        return torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = previous


_QPARAMS: tuple[float, int] | None = None


def activation_qparams() -> tuple[float, int]:
    """(scale, zero point) of activations already divided by their per-token max |x|.

    8 bits (1/127, 128: x_q in 1..255) unless FBGEMM's kernel saturates on this CPU, found by
    running it once on an input built to saturate int16 pair sums (all weights 127, activations
    at the top of the u8 range); then 7 bits (1/63, 64), which cannot saturate."""
    global _QPARAMS
    if INT8_REDUCE_RANGE is not None:
        return (1 / 63, 64) if INT8_REDUCE_RANGE else (1 / 127, 128)
    if _QPARAMS is None:
        k = 64
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            torch.ones(1, k), 1 / 127, 128, fbgemm_prepack(*quantize_weight_per_channel(torch.ones(8, k)))
        )
        exact = torch.allclose(y, torch.full_like(y, float(k)), rtol=1e-3)
        _QPARAMS = (1 / 127, 128) if exact else (1 / 63, 64)
    return _QPARAMS
