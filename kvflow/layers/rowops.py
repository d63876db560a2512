"""Row-wise fused ops of the int8 path (csrc/rowops.c), called through ctypes.

The int8 linear quantizes each row of its input with the row's own scale, max |x| (see
`Int8Kernel`). The producers of linear inputs -- RMSNorm before qkv and gate_up, silu(gate) * up
before down -- can emit that form directly (`RowScaled`), in one call instead of the norm's or
activation's ops plus four more to find and divide by the row max. At batch 1 a step is mostly
such small ops, so this is where its time goes.

Used only by the int8 backend: the float path keeps torch's own ops, whose order of float32
operations matches HF transformers. `available()` is False when the library cannot be built; the
callers then use torch ops (same results up to float32 rounding).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from kvflow.layers import native


MAX_HEAD_DIM = 256  # rotary_'s limit (csrc/rowops.c)


class RowScaled(NamedTuple):
    """x[r] / max|x[r]| with max|x[r]| in scale[r, 0]: an int8 linear's input, already row-scaled."""

    x: torch.Tensor  # [rows, cols] float32, each row's max |value| is 1
    scale: torch.Tensor  # [rows, 1] float32


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "kvflow_row_scale": ([_P, _L, _I, _I, _P, _P, _I], None),
    "kvflow_rmsnorm_row_scale": ([_P, _L, _P, _F, _I, _I, _P, _P, _I], None),
    "kvflow_silu_mul_row_scale": ([_P, _L, _I, _I, _P, _P, _I], None),
    "kvflow_rotary": ([_P, _L, _I, _I, _I, _P, _P, _I], None),
}
_lib: ctypes.CDLL | None = None  # set by available()


def available() -> bool:
    global _lib
    _lib = native.load("rowops", _SIGNATURES)
    return _lib is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, cols] float32 CPU with unit stride along cols (a view when possible)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"rowops take float32 CPU tensors, got {x.dtype} on {x.device}")
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def row_scale(x: torch.Tensor) -> RowScaled:
    x = _rows(x)
    rows, cols = x.shape
    out, scale = torch.empty(rows, cols), torch.empty(rows, 1)
    _lib.kvflow_row_scale(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr(), scale.data_ptr(),
                          torch.get_num_threads())
    return RowScaled(out, scale)


def rmsnorm_row_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> RowScaled:
    x = _rows(x)
    rows, cols = x.shape
    out, scale = torch.empty(rows, cols), torch.empty(rows, 1)
    _lib.kvflow_rmsnorm_row_scale(x.data_ptr(), x.stride(0), weight.data_ptr(), eps, rows, cols,
                                  out.data_ptr(), scale.data_ptr(), torch.get_num_threads())
    return RowScaled(out, scale)


def silu_mul_row_scale(gate_up: torch.Tensor) -> RowScaled:
    """silu(gate_up[:, :I]) * gate_up[:, I:], row-scaled."""
    gate_up = _rows(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out, scale = torch.empty(rows, inter), torch.empty(rows, 1)
    _lib.kvflow_silu_mul_row_scale(gate_up.data_ptr(), gate_up.stride(0), rows, inter, out.data_ptr(),
                                   scale.data_ptr(), torch.get_num_threads())
    return RowScaled(out, scale)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """In place on x [T, heads, head_dim] (heads contiguous, any row stride); cos, sin_signed:
    [T, 1, head_dim] as `RotaryEmbedding.lookup` returns them (contiguous)."""
    t, heads, head_dim = x.shape
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != head_dim or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"rotary_ takes float32 [T, heads, head_dim <= {MAX_HEAD_DIM}] with contiguous heads")
    _lib.kvflow_rotary(x.data_ptr(), x.stride(0), t, heads, head_dim, cos.data_ptr(), sin_signed.data_ptr(),
                       torch.get_num_threads())
