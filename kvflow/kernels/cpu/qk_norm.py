"""Binding of csrc/qk_norm.cpp: q/k RMSNorms in place in a qkv row, per head (Qwen3) or over the
whole projection (OLMoE), by the same compiled function as the native decode pass, so a token's
queries and keys do not depend on which path computed them (float32)."""

from __future__ import annotations

import ctypes

import torch

from kvflow.kernels.cpu import native

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {"kvflow_qk_norm": ([_P, _L, _I, _I, _I, _I, _I, _P, _P, _F, _I], None)}
PER_HEAD, WHOLE = 1, 2  # enum QkNorm in csrc/qk_norm.h


def _lib() -> ctypes.CDLL | None:
    return native.load("linear", _SIGNATURES)


def available() -> bool:
    return _lib() is not None


def qk_norm_(
    qkv: torch.Tensor,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    per_head: bool,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> None:
    """q and k of qkv [T, (num_heads + 2 * kv_heads) * head_dim] (float32, rows contiguous, any row
    stride) RMS-normed in place: per head with weights [head_dim] (`per_head`), or q over its
    num_heads * head_dim values and k over kv_heads * head_dim with weights that long; v untouched.
    The weights: float32, contiguous."""
    if qkv.dtype != torch.float32 or qkv.stride(1) != 1:
        raise ValueError(f"qk_norm_ takes float32 rows with contiguous values, got {qkv.dtype} strides {qkv.stride()}")
    _lib().kvflow_qk_norm(
        qkv.data_ptr(),
        qkv.stride(0),
        qkv.shape[0],
        num_heads,
        kv_heads,
        head_dim,
        PER_HEAD if per_head else WHOLE,
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        eps,
        torch.get_num_threads(),
    )
