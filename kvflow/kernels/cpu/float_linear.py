"""The float linear on the CPU: `NativeFloatKernel`, csrc/float_linear.cpp's register-tiled GEMM
over a packed copy of the weight (panels of output channels, register tiles of rows x panels),
with the norm / activation that feeds the projection and the residual in the same call. float32
sums; the weight in float32, or in bfloat16 (half the bytes a decode step reads: through the CPU's
bf16 dot product on bf16-rounded inputs where it has AVX512-BF16, `bf16_dot` -- on AMX tiles where
it has those, `bf16_amx` -- else widened in registers), or in float8 e4m3 with a scale per output
channel (an FP8 checkpoint's weights as stored, a quarter of float32's bytes: widened in registers,
the inputs rounded to e4m3 per token first where the checkpoint's activations are FP8 too). The
``native`` path of kvflow.layers.linear_kernels for float32 and bfloat16 models.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from kvflow.kernels.cpu import native
from kvflow.kernels.norm import NormWeights

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "kvflow_float_pack": ([_P, _I, _I, _I], _P),
    "kvflow_float_pack_fp8": ([_P, _I, _I, _P, _I], _P),
    "kvflow_float_free": ([_P], None),
    "kvflow_float_unpack": ([_P, _P], None),
    "kvflow_float_linear": ([_P, _P, _L, _I, _I, _P, _F, _P, _P, _L, _P, _I], None),
    "kvflow_float_bf16_dot": ([], _I),
    "kvflow_float_amx": ([], _I),
}
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1}  # enum WeightType in csrc/float_linear.h
FP8_ACTIVATIONS = {"none": 0, "fp8-token": 1}  # enum ActQuant in csrc/float_linear.h


def float_library() -> ctypes.CDLL | None:
    """The native linear library with the float entry points typed, or None when it cannot be built."""
    return native.load("linear", _SIGNATURES)


def bf16_dot() -> bool:
    """Whether bf16 weights go through the CPU's bf16 dot product here (AVX512-BF16: each input row
    rounded to bf16 once per call), rather than widened to meet float32 inputs."""
    lib = float_library()
    return lib is not None and bool(lib.kvflow_float_bf16_dot())


def bf16_amx() -> bool:
    """Whether those bf16 products run on AMX tiles here (Xeons since Sapphire Rapids; projections
    whose in_features are a multiple of 32), rather than through vdpbf16ps."""
    lib = float_library()
    return lib is not None and bool(lib.kvflow_float_amx())


class NativeFloatKernel:
    """y = residual + W . pre(x) + bias in float32, W [out, in] (float32 or bfloat16) packed once
    into the kernel's layout; the result in x's dtype.

    FP8 weights: W in torch.float8_e4m3fn with `scale` [out] (float32, one per output channel: y =
    scale * (W . x)), and `activations` "none" or "fp8-token" (each input row rounded to e4m3 with
    the scale max|x| / 448 before the products, as an FP8 W8A8 checkpoint's dynamic activations).

    `norm=<NormWeights>` / `silu_mul=True` apply the op that produces the projection's input first
    (as Int8Kernel takes them), so the per-layer path and the fused decode pass
    (kvflow.models.decode_pass) run the same code on a token."""

    backend = "native"

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        scale: torch.Tensor | None = None,
        activations: str = "none",
    ) -> None:
        fp8 = weight.dtype == torch.float8_e4m3fn
        if (weight.dtype not in WEIGHT_TYPES and not fp8) or weight.device.type != "cpu":
            raise ValueError(
                f"the native float linear takes float32, bfloat16 or float8_e4m3fn CPU weights, got {weight.dtype} "
                f"on {weight.device.type}"
            )
        if fp8 != (scale is not None) or (activations != "none" and not fp8) or activations not in FP8_ACTIVATIONS:
            raise ValueError(
                "float8_e4m3fn weights take a per-channel `scale` (and only they do), and `activations` one of "
                f"{tuple(FP8_ACTIVATIONS)}; got scale={scale is not None}, activations={activations!r}"
            )
        self._lib = float_library()
        if self._lib is None:
            raise RuntimeError("the native linear library could not be built here (see the log)")
        self.weight_dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        self.activations = activations
        w = weight.detach().contiguous()
        if fp8:
            s = scale.detach().float().reshape(-1).contiguous()
            if s.numel() != self.out_features:
                raise ValueError(f"{s.numel()} weight scales for {self.out_features} output channels")
            self.scale = s.clone()
            self.native_handle = self._lib.kvflow_float_pack_fp8(
                w.view(torch.uint8).data_ptr(),
                self.out_features,
                self.in_features,
                s.data_ptr(),
                FP8_ACTIVATIONS[activations],
            )
        else:
            self.scale = None
            self.native_handle = self._lib.kvflow_float_pack(
                w.data_ptr(), self.out_features, self.in_features, WEIGHT_TYPES[weight.dtype]
            )
        if not self.native_handle:
            raise MemoryError(f"no memory for the packed {self.out_features}x{self.in_features} weight")
        weakref.finalize(self, self._lib.kvflow_float_free, self.native_handle)

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        norm: NormWeights | None = None,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        return native.fused_linear(
            self, self._lib.kvflow_float_linear, x, residual, norm, silu_mul, "native float linear"
        )

    def dequantized_weight(self) -> torch.Tensor:
        """The weight back from the packed copy, in its own dtype (tests)."""
        w = torch.empty(self.out_features, self.in_features, dtype=self.weight_dtype)
        self._lib.kvflow_float_unpack(self.native_handle, w.data_ptr())
        return w

    @property
    def nbytes(self) -> int:
        return (
            self.out_features * self.in_features * self.weight_dtype.itemsize
            + (0 if self.bias is None else self.bias.numel() * 4)
            + (0 if self.scale is None else self.scale.numel() * 4)
        )
