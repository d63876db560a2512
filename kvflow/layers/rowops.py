"""Row-wise ops of the int8 path (csrc/rowops.c), called through ctypes: rotary in one call.

Used only by the int8 backend: the float path keeps torch's own ops, whose order of float32
operations matches HF transformers. `available()` is False when the library cannot be built; the
callers then use torch ops (same results up to float32 rounding).
"""

from __future__ import annotations

import ctypes

import torch

from kvflow.layers import native

MAX_HEAD_DIM = 256  # rotary_'s limit (csrc/rowops.c)

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_SIGNATURES = {"kvflow_rotary": ([_P, _L, _I, _I, _I, _P, _P, _I], None)}
_lib: ctypes.CDLL | None = None  # set by available()


def available() -> bool:
    global _lib
    _lib = native.load("rowops", _SIGNATURES)
    return _lib is not None


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """In place on x [T, heads, head_dim] (heads contiguous, any row stride); cos, sin_signed:
    [T, 1, head_dim] as `RotaryEmbedding.lookup` returns them (contiguous)."""
    t, heads, head_dim = x.shape
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != head_dim or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"rotary_ takes float32 [T, heads, head_dim <= {MAX_HEAD_DIM}] with contiguous heads")
    _lib.kvflow_rotary(x.data_ptr(), x.stride(0), t, heads, head_dim, cos.data_ptr(), sin_signed.data_ptr(),
                       torch.get_num_threads())
