"""The fp32 linear for few rows on the CPU: `NativeF32Kernel`, csrc/f32_linear.cpp's tiled GEMV
over a packed copy of the weight (read as one stream per thread), with the norm / activation that
feeds the projection and the residual in the same call. The ``native`` path of kvflow.layers.linear.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

import torch

from kvflow.kernels.cpu import native

if TYPE_CHECKING:
    from kvflow.layers.norm import RMSNorm

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "kvflow_f32_pack": ([_P, _I, _I], _P),
    "kvflow_f32_free": ([_P], None),
    "kvflow_f32_unpack": ([_P, _P], None),
    "kvflow_f32_linear": ([_P, _P, _L, _I, _I, _P, _F, _P, _P, _L, _P, _I], None),
}


def f32_library() -> ctypes.CDLL | None:
    """The native linear library with the fp32 entry points typed, or None when it cannot be built."""
    return native.load("linear", _SIGNATURES)


class NativeF32Kernel:
    """y = residual + W . pre(x) + bias in float32, W [out, in] packed once into the kernel's layout.

    `norm=<RMSNorm>` / `silu_mul=True` apply the op that produces the projection's input first
    (as Int8Kernel takes them), so the per-layer path and the fused decode pass
    (kvflow.kernels.cpu.decode_pass) run the same code on a token."""

    backend = "native"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("the native fp32 linear takes float32 CPU weights")
        self._lib = f32_library()
        if self._lib is None:
            raise RuntimeError("the native linear library could not be built here (see the log)")
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        w = weight.detach().contiguous()
        self.native_handle = self._lib.kvflow_f32_pack(w.data_ptr(), self.out_features, self.in_features)
        weakref.finalize(self, self._lib.kvflow_f32_free, self.native_handle)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
                 norm: RMSNorm | None = None, silu_mul: bool = False) -> torch.Tensor:
        return native.fused_linear(self, self._lib.kvflow_f32_linear, x, residual, norm, silu_mul, "fp32 linear")

    def dequantized_weight(self) -> torch.Tensor:
        """The weight back from the packed copy (tests)."""
        w = torch.empty(self.out_features, self.in_features)
        self._lib.kvflow_f32_unpack(self.native_handle, w.data_ptr())
        return w

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 4 + (0 if self.bias is None else self.bias.numel() * 4)
