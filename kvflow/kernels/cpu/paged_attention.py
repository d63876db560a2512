"""Bindings of csrc/paged_attention.cpp: paged attention over query rows that read their keys and
values where they lie in the paged KV cache, the KV cache write, and the native rotary.

The cache write and the rotary are the same C code (csrc/attention.h) as the native decode pass
(csrc/decode_pass.cpp), so a token's cached keys and values are bit for bit the same whichever
path computed them. The attention backend built on these is kvflow.attention.backends.cpu.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels.cpu import native

MAX_HEAD_DIM = 256  # the kernel's limits (csrc/paged_attention.cpp)
MAX_GROUP = 32
# Cache element type -> the kernels' format code (KV_F32 / KV_INT8 / KV_BF16 / KV_FP8_E4M3 /
# KV_FP8_E5M2 / KV_INT4 in csrc/attention.h; uint8 is int4's two values a byte, see
# kvflow.attention.kv_formats). Queries, outputs and the maths stay float32; a bfloat16 model's
# tensors are widened at the call, fp8 and int4 codes as they are read.
KV_FORMATS = {
    torch.float32: 0,
    torch.int8: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.uint8: 5,
}

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "kvflow_paged_attention": ([_P, _L, _P, _P, _I, _P, _L, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _I, _F], _I),
    "kvflow_rotary": ([_P, _L, _I, _I, _I, _P, _P, _I], None),
    "kvflow_write_kv": ([_P, _L, _P, _I, _P, _P, _I, _I, _I, _I], None),
    "kvflow_tile_bf16_products": ([], _I),
}


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return native.load("paged_attention", _SIGNATURES)


def available() -> bool:
    """Whether the library builds and loads here (a C++ compiler, see kvflow.kernels.cpu.native)."""
    return _lib() is not None


def bf16_products() -> bool:
    """Whether prefill tiles over a bfloat16 cache multiply in bf16 here (AVX512_BF16: queries and
    probabilities rounded to bf16, sums in float32; csrc/tiled_attention.h), rather than in float32."""
    return available() and bool(_lib().kvflow_tile_bf16_products())


def rotary_available(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype == torch.float32 and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0 and _lib() is not None


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """Rotary in place on x [T, heads, head_dim] (heads contiguous, any row stride), by the same code
    as the native decode pass; cos, sin_signed: [T, 1, head_dim] float32, contiguous, sin_signed
    being sin with its first half negated (rotate_half(x) * sin == x.roll(half) * sin_signed). The
    native linear backends rotate every step through it (kvflow.layers.rotary.select_rotary), so a
    token's keys do not depend on which path computed them."""
    t, heads, head_dim = x.shape
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != head_dim or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"rotary_ takes float32 [T, heads, head_dim <= {MAX_HEAD_DIM}] with contiguous heads")
    _lib().kvflow_rotary(
        x.data_ptr(), x.stride(0), t, heads, head_dim, cos.data_ptr(), sin_signed.data_ptr(), torch.get_num_threads()
    )


def write_kv(kv: torch.Tensor, slot_mapping: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Writes kv [T, 2, kv_heads, head_dim] (any float dtype) into the cache `data` [num_blocks,
    block_size, 2, kv_heads, head_dim] at int64 `slot_mapping` [T]: stored as `data`'s dtype
    (`KV_FORMATS`), a quantized cache with one scale per token, K/V and kv head into `scales`."""
    t, head_dim = kv.shape[0], kv.shape[-1]  # (an int4 cache's rows are head_dim / 2 bytes)
    kv = kv.reshape(t, -1)
    if kv.stride(1) != 1 or kv.dtype != torch.float32:
        kv = kv.float().contiguous()
    _lib().kvflow_write_kv(
        kv.data_ptr(),
        kv.stride(0),
        slot_mapping.data_ptr(),
        t,
        data.data_ptr(),
        None if scales is None else scales.data_ptr(),
        KV_FORMATS[data.dtype],
        data.shape[3],
        head_dim,
        torch.get_num_threads(),
    )


def paged_attention(
    q: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor | None,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    tokens: torch.Tensor,
    block_size: int,
    window: int | None,
    scale: float,
    out: torch.Tensor,
    head_major: bool,
    softcap: float | None = None,
    tiled: bool = True,
) -> None:
    """Attention of the query rows `tokens` (int32 [R]) of q [T, H, D] (float32, heads contiguous),
    row r over the first context_lens[r] keys (window: the last `window` of them) of block table
    tables[r] (int32 [R, max_blocks]) in the cache `data` (`scales`: a quantized cache's), into rows
    `tokens` of out [T, H * D] float32. head_major: the rows share sequences (prefill chunks), so
    the kernel walks heads in the outer loop (csrc/attention.h's attend_rows) and, with `tiled`,
    computes runs of rows that read the same block table a tile at a time where the shape allows
    (csrc/tiled_attention.h; False: every row on its own, for benchmarks and tests). Without it
    (decode rows, and decodes verifying drafts), each row's sums are the same alone or in any
    batch; a decode's verifying rows read its keys once for all of them (plan_runs). softcap: scores
    (scale * q.k) become tanh(score / softcap) * softcap before the softmax (None: as they are)."""
    _, num_heads, head_dim = q.shape
    rc = _lib().kvflow_paged_attention(
        q.data_ptr(),
        q.stride(0),
        data.data_ptr(),
        None if scales is None else scales.data_ptr(),
        KV_FORMATS[data.dtype],
        tables.data_ptr(),
        tables.stride(0),
        context_lens.data_ptr(),
        tokens.data_ptr(),
        len(tokens),
        num_heads,
        data.shape[3],
        head_dim,
        block_size,
        window or 0,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
        2 if head_major and tiled else int(head_major),
        softcap or 0.0,
    )
    if rc != 0:
        raise RuntimeError(f"native paged attention refused head_dim={head_dim}, heads={num_heads}/{data.shape[3]}")
