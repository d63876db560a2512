"""Paged attention in Triton: the keys and values are read where they lie in the paged KV cache,
through each sequence's block table (PagedAttention), with the online softmax of FlashAttention
(one pass over the keys, running max and sum in float32, no [q, kv] score matrix in memory).

The cache is kvflow's layout (kvflow.attention.backend.LayerKVCache): slot-major
``[num_slots, 2 (K, V), kv_heads, head_dim]`` with slot = block * block_size + offset; a quantized
cache (int8, fp8 e4m3 / e5m2, int4: kvflow.attention.kv_formats) has one float32 scale per (slot,
K/V, kv head), applied here as the values are loaded. fp8 codes are read as bytes and decoded from
their bits (no float8 loads: the same on every GPU and under the interpreter); int4 bytes hold two
values, element d of a row in nibble d % 2 of byte d // 2.

* `paged_decode` -- one new token per sequence. A program per (sequence, kv head) computes the
  GROUP query heads that share the kv head together, so each key/value is read once for all of
  them (GQA). Padded rows (context length 0) produce zeros.
* `paged_prefill` -- chunks of any length starting at any position (prefill, chunked prefill,
  speculative verification): a program per (tile of BLOCK_M queries of one sequence, query head)
  walks the sequence's keys up to its last query, causal within the chunk, optionally windowed.

Both take keys per BLOCK_N tokens, each key's slot looked up from the block table, so any
block_size works. With TRITON_INTERPRET=1 Triton runs them on the CPU (numpy), which is how CI
tests them; on a GPU they compile for it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_to_f32(c, M: tl.constexpr, REBIAS: tl.constexpr, SUB_STEP: tl.constexpr):
    """fp8 codes (uint8) with M mantissa bits -> float32 from their bits: a normal code's exponent
    moved to float32's bias (REBIAS = 127 - the fp8 bias), a subnormal one's mantissa times SUB_STEP
    (2^(1 - bias - M)). The encoder never writes inf / NaN codes (values are clamped to the max)."""
    c = c.to(tl.int32)
    mag = c & 0x7F
    ex = mag >> M
    man = mag & ((1 << M) - 1)
    normal = (((ex + REBIAS) << 23) | (man << (23 - M))).to(tl.float32, bitcast=True)
    a = tl.where(ex == 0, man.to(tl.float32) * SUB_STEP, normal)
    return tl.where((c & 0x80) != 0, -a, a)


@triton.jit
def _kv_tile(
    kv_ptr,
    scale_ptr,
    tables_ptr,
    seq,
    table_stride,
    n,
    n_mask,
    d,
    d_valid,
    kvh,
    slot_stride,
    part_stride,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    QUANT: tl.constexpr,
):
    """K and V [N, D] of keys `n` (masked by n_mask) of sequence `seq`, kv head `kvh`: each key's slot
    from the block table; in the cache's dtype, or in float32 with a quantized cache's scales applied
    (QUANT: the format's code, kvflow.kernels.cpu.paged_attention.KV_FORMATS; 0: not quantized)."""
    page = tl.load(tables_ptr + seq * table_stride + n // BLOCK_SIZE, mask=n_mask, other=0)
    slot = page.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
    base = slot * slot_stride + kvh * HEAD_DIM  # in values (int4: two a byte)
    nd_mask = n_mask[:, None] & d_valid[None, :]
    if QUANT == 5:  # int4: nibble d % 2 of byte d // 2, q + 8
        k = tl.load(kv_ptr + (base[:, None] + d[None, :]) // 2, mask=nd_mask, other=0).to(tl.int32)
        v = tl.load(kv_ptr + (part_stride + base[:, None] + d[None, :]) // 2, mask=nd_mask, other=0).to(tl.int32)
        odd = (d % 2 == 1)[None, :]
        k = tl.where(odd, k >> 4, k & 15) - 8
        v = tl.where(odd, v >> 4, v & 15) - 8
    else:
        k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=nd_mask, other=0.0)
        v = tl.load(kv_ptr + part_stride + base[:, None] + d[None, :], mask=nd_mask, other=0.0)
    if QUANT == 3:  # fp8 e4m3fn bytes
        k = _fp8_to_f32(k, 3, 120, 0.001953125)
        v = _fp8_to_f32(v, 3, 120, 0.001953125)
    if QUANT == 4:  # fp8 e5m2 bytes
        k = _fp8_to_f32(k, 2, 112, 0.0000152587890625)
        v = _fp8_to_f32(v, 2, 112, 0.0000152587890625)
    if QUANT != 0:
        s_base = slot * (2 * NUM_KV_HEADS) + kvh
        k = k.to(tl.float32) * tl.load(scale_ptr + s_base, mask=n_mask, other=0.0)[:, None]
        v = v.to(tl.float32) * tl.load(scale_ptr + s_base + NUM_KV_HEADS, mask=n_mask, other=0.0)[:, None]
    return k, v


@triton.jit
def _softcap(s, cap):
    """tanh(s / cap) * cap (Gemma 2's attention-logit soft-cap), tanh as 1 - 2 / (exp(2x) + 1): no
    tanh in tl that runs both compiled and under the interpreter; exp's overflow to inf gives 1."""
    x = s / cap
    return (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * cap


@triton.jit
def _decode_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    kv_ptr,
    scale_ptr,
    slot_stride,
    part_stride,
    tables_ptr,
    table_stride,
    ctx_ptr,
    qstart_ptr,
    seqs_ptr,
    out_ptr,
    out_stride,
    sm_scale,
    window,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    QUANT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(seqs_ptr + i)
    ctx = tl.load(ctx_ptr + seq)
    row = tl.load(qstart_ptr + seq).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row * q_stride_t + heads[:, None] * q_stride_h + d[None, :], mask=gd_mask, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx - window, 0)
    for start in range(lo, ctx, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < ctx
        k, v = _kv_tile(
            kv_ptr,
            scale_ptr,
            tables_ptr,
            seq,
            table_stride,
            n,
            n_mask,
            d,
            d < HEAD_DIM,
            kvh,
            slot_stride,
            part_stride,
            BLOCK_SIZE,
            HEAD_DIM,
            NUM_KV_HEADS,
            QUANT,
        )
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale  # [G, N]
        if SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # The first block always holds a valid key (start < ctx), so m_new is finite from there on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + row * out_stride + heads[:, None] * HEAD_DIM + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=gd_mask,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    kv_ptr,
    scale_ptr,
    slot_stride,
    part_stride,
    tables_ptr,
    table_stride,
    ctx_ptr,
    qstart_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    out_ptr,
    out_stride,
    sm_scale,
    window,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    QUANT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_start_ptr + tile)
    q0 = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q0
    ctx = tl.load(ctx_ptr + seq)
    m = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_valid = m < q_len
    d_valid = d < HEAD_DIM
    q_pos = ctx - q_len + m  # absolute position of each query row
    rows = (q0 + m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * q_stride_t + h * q_stride_h + d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)  # keys up to the tile's last query
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx - q_len + m0 - window + 1, 0)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        k, v = _kv_tile(
            kv_ptr,
            scale_ptr,
            tables_ptr,
            seq,
            table_stride,
            n,
            n_mask,
            d,
            d_valid,
            kvh,
            slot_stride,
            part_stride,
            BLOCK_SIZE,
            HEAD_DIM,
            NUM_KV_HEADS,
            QUANT,
        )
        k = k.to(q.dtype)  # (quantized: dequantized to the model's dtype; under UPCAST q is float32)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # [M, N] float32
        if SOFTCAP:
            s = _softcap(s, softcap)
        allowed = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed = allowed & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet (windowed)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * out_stride + h * HEAD_DIM + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )


def _pow2(n: int, least: int) -> int:
    return max(triton.next_power_of_2(n), least)


# A quantized cache's element type -> QUANT (the CPU kernels' format codes, KV_FORMATS there).
_QUANT = {torch.int8: 1, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4, torch.uint8: 5}


def _cache_args(data: torch.Tensor, scale: torch.Tensor | None, head_dim: int) -> tuple:
    """The cache's pointer (fp8: as bytes), its scales' (or the data again: unread without QUANT),
    its strides in values (int4: two a byte) and QUANT."""
    kv_heads = data.shape[3]
    if not data.is_contiguous():
        raise ValueError("the paged KV cache must be contiguous")
    quant = 0 if scale is None else _QUANT[data.dtype]
    kv = data.view(torch.uint8) if quant in (3, 4) else data
    return kv, data if scale is None else scale, 2 * kv_heads * head_dim, kv_heads * head_dim, quant


def paged_decode(
    q: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor | None,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    seqs: torch.Tensor,
    out: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None,
    block_n: int = 32,
    softcap: float | None = None,
) -> None:
    """Attention of the one-token sequences `seqs` (indices into tables / context_lens /
    query_start, whose entry is the sequence's row in q and out): q [T, heads, head_dim] (heads
    contiguous), out [T, heads * head_dim]; sequence s attends to its first context_lens[s] keys."""
    _, num_heads, head_dim = q.shape
    kv_heads, block_size = data.shape[3], data.shape[1]
    group = num_heads // kv_heads
    kv, sc, slot_stride, part_stride, quant = _cache_args(data, scale, head_dim)
    _decode_kernel[(seqs.shape[0], kv_heads)](
        q,
        q.stride(0),
        q.stride(1),
        kv,
        sc,
        slot_stride,
        part_stride,
        tables,
        tables.stride(0),
        context_lens,
        query_start,
        seqs,
        out,
        out.stride(0),
        sm_scale,
        sliding_window or 0,
        softcap or 1.0,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=_pow2(head_dim, 16),
        GROUP=group,
        BLOCK_G=_pow2(group, 2),
        BLOCK_N=block_n,
        NUM_KV_HEADS=kv_heads,
        QUANT=quant,
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
    )


def paged_prefill(
    q: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor | None,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_start: torch.Tensor,
    out: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None,
    block_m: int,
    block_n: int = 32,
    softcap: float | None = None,
) -> None:
    """Attention of chunks: sequence s's queries are rows query_start[s] : query_start[s + 1] of q,
    the last of its context_lens[s] positions (their keys already in the cache); one program per
    (tile, head), tile t covering rows tile_start[t] : + block_m of sequence tile_seq[t]."""
    _, num_heads, head_dim = q.shape
    kv_heads, block_size = data.shape[3], data.shape[1]
    kv, sc, slot_stride, part_stride, quant = _cache_args(data, scale, head_dim)
    # float32 models: full-precision products (a GPU's tl.dot would otherwise round to tf32).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # Triton's interpreter computes a bf16 / fp16 tl.dot on the raw bits (3.9): under it, the
    # products are taken in float32 instead.
    upcast = q.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1"
    _prefill_kernel[(tile_seq.shape[0], num_heads)](
        q,
        q.stride(0),
        q.stride(1),
        kv,
        sc,
        slot_stride,
        part_stride,
        tables,
        tables.stride(0),
        context_lens,
        query_start,
        tile_seq,
        tile_start,
        out,
        out.stride(0),
        sm_scale,
        sliding_window or 0,
        softcap or 1.0,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=_pow2(head_dim, 16),
        GROUP=num_heads // kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_KV_HEADS=kv_heads,
        QUANT=quant,
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        PRECISION=precision,
        UPCAST=upcast,
    )
