"""Paged attention on the CPU, every query row read in place by a native kernel.

`CpuPagedAttention` is `TorchPagedAttention` with the attention itself in csrc/paged_attention.cpp:
each new token of a step -- a decode, or a token of a prefill chunk -- is one row attending to the
keys of its sequence up to its own position (causal by construction, a sliding window by its
start), walked through the block table where they lie. Nothing is gathered, nothing is padded to
the longest context, and blocks that several sequences share (prefix caching) are read from cache,
not copied. Prefill rows went through scaled_dot_product_attention before: on the AVX-512 EPYC of
2026-12-02 a layer of eleven 186-token prompts took 7.8 ms there in float32 (8.7 with a bf16 cache)
against 4.4-4.8 (3.6-4.3) here, one 2,040-token prompt 42.0 (61.8) against 40.0 (38.6)
(`benchmarks/decode_attention.py --chunk`, README). Rows that share sequences run head-major
(`head_major`, csrc/attention.h's attend_rows). On the AMX Xeon of 2026-12-03, though, SDPA took
the eleven prompts in 3.1 ms with a bf16 cache (oneDNN's bf16 kernels) against 6.3 here, so which
path runs prefill rows (`prefill_path`) is measured at the first start on a CPU
(kvflow.kernels.cpu.autotune.measure_prefill_attention); with "torch", a step's prefill chunks go
through the torch groups and its decodes still through the native kernel. The cache write of
every step, and the rotary the native linear paths use, run in the same library with the same code
as the native decode pass (csrc/attention.h), which the backend hands to a model that can take it
(`decode_pass`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvflow.kernels.cpu import native
from kvflow.layers.attention import (AttentionGroup, AttentionMetadata, LayerKVCache, SeqLayout, TokenLayout,
                                     TorchPagedAttention, partition_groups)

if TYPE_CHECKING:
    from kvflow.kernels.cpu.decode_pass import NativeDecode

MAX_HEAD_DIM = 256  # the kernel's limits (csrc/paged_attention.cpp)
MAX_GROUP = 32
# Cache element type -> the kernels' format code (KV_F32 / KV_INT8 / KV_BF16 in csrc/attention.h).
# Queries, outputs and the maths stay float32; a bfloat16 model's tensors are widened at the call.
KV_FORMATS = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class NativeGroup:
    """Rows for the native kernel: row r is the query at token `tokens[r]` of the step, attending to
    the first `context_lens[r]` keys of block table `tables[r]`. decode_only: one row per sequence,
    each its one new token (what the decode pass takes)."""

    tables: torch.Tensor  # int32 [R, max_blocks]
    context_lens: torch.Tensor  # int32 [R]
    tokens: torch.Tensor  # int32 [R]
    decode_only: bool = True


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "kvflow_paged_attention": ([_P, _L, _P, _P, _I, _P, _L, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _I], _I),
    "kvflow_rotary": ([_P, _L, _I, _I, _I, _P, _P, _I], None),
    "kvflow_write_kv": ([_P, _L, _P, _I, _P, _P, _I, _I, _I, _I], None),
}


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return native.load("paged_attention", _SIGNATURES)


def rotary_available(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype == torch.float32 and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0 and _lib() is not None


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """Rotary in place on x [T, heads, head_dim] (heads contiguous, any row stride), by the same code
    as the native decode pass (kvflow.kernels.cpu.decode_pass); cos, sin_signed: [T, 1, head_dim] as
    `RotaryEmbedding.lookup` returns them (contiguous). The int8 path uses it for every step
    (kvflow.layers.rotary.select_rotary), so a token's keys do not depend on which path computed them."""
    t, heads, head_dim = x.shape
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != head_dim or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"rotary_ takes float32 [T, heads, head_dim <= {MAX_HEAD_DIM}] with contiguous heads")
    _lib().kvflow_rotary(x.data_ptr(), x.stride(0), t, heads, head_dim, cos.data_ptr(), sin_signed.data_ptr(),
                         torch.get_num_threads())


def native_unsupported(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                       head_dim: int) -> str | None:
    """Why the native kernel cannot serve this model here, or None when it can."""
    if device.type != "cpu":
        return f"it runs on the CPU; device is {device.type!r}"
    if dtype not in NATIVE_DTYPES:
        return f"it runs float32 and bfloat16 models; dtype is {dtype}"
    if head_dim > MAX_HEAD_DIM or num_heads // num_kv_heads > MAX_GROUP:
        return f"head_dim {head_dim} / query heads per kv head {num_heads // num_kv_heads} exceed {MAX_HEAD_DIM} / {MAX_GROUP}"
    if _lib() is None:
        return "the kernel could not be built (see the warning above)"
    return None


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, block_size: int, sliding_window: int | None, device: torch.device) -> None:
        super().__init__(block_size, sliding_window, device)
        lib = _lib()
        if lib is None:
            raise RuntimeError("the native paged-attention kernel could not be built")
        self._lib = lib
        self.prefill_path = "native"  # or "torch": see the top of the file

    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata:
        """One NativeGroup for the whole step: every new token a row (see the top of the file); with
        prefill_path "torch" and prefill chunks in the step, a NativeGroup of its decodes and torch
        groups of the rest."""
        t = TokenLayout.of(seqs, self.block_size)
        total = t.positions.shape[0]
        decode_only = total == len(seqs)
        if not decode_only and self.prefill_path == "torch":
            return self._split_metadata(seqs, t)
        tables = t.tables if decode_only else t.tables[torch.repeat_interleave(torch.arange(len(seqs)), t.lens)]
        group = NativeGroup(tables=tables.to(torch.int32).contiguous(),
                            context_lens=(t.positions + 1).to(torch.int32),
                            tokens=torch.arange(total, dtype=torch.int32), decode_only=decode_only)
        return AttentionMetadata(positions=t.positions, slot_mapping=t.slot_mapping, groups=[group])

    def _split_metadata(self, seqs: list[SeqLayout], t: TokenLayout) -> AttentionMetadata:
        total = t.positions.shape[0]
        decodes = [i for i, s in enumerate(seqs) if s.num_new == 1]
        chunks = [i for i, s in enumerate(seqs) if s.num_new > 1]
        groups: list[AttentionGroup | NativeGroup] = [
            self._group(torch.tensor([chunks[j] for j in members]), t.starts, t.lens, t.offsets, t.tables, total)
            for members in partition_groups([seqs[i].num_new for i in chunks],
                                            [seqs[i].start_pos + seqs[i].num_new for i in chunks])]
        if decodes:  # last: its rows go into the output the torch groups made (a bf16 model's: those rows only)
            idx = torch.tensor(decodes)
            groups.append(NativeGroup(tables=t.tables[idx].to(torch.int32).contiguous(),
                                      context_lens=(t.starts[idx] + 1).to(torch.int32),
                                      tokens=t.offsets[idx].to(torch.int32)))
        return AttentionMetadata(positions=t.positions, slot_mapping=t.slot_mapping, groups=groups)

    def _write_kv(self, kv: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata) -> None:
        # The same C code as the native decode pass's write (int8 / bf16 caches: the same rounding).
        t = kv.shape[0]
        kv = kv.reshape(t, -1)
        if kv.stride(1) != 1 or kv.dtype != torch.float32:
            kv = kv.float().contiguous()
        data, scales = kv_cache.data, kv_cache.scale
        self._lib.kvflow_write_kv(kv.data_ptr(), kv.stride(0), meta.slot_mapping.data_ptr(), t, data.data_ptr(),
                                  None if scales is None else scales.data_ptr(), KV_FORMATS[data.dtype],
                                  data.shape[3], data.shape[4], torch.get_num_threads())

    def decode_group(self, meta: AttentionMetadata) -> NativeGroup | None:
        """The step's rows as one NativeGroup when every row is a decode (one new token per
        sequence, row r = sequence r's token), else None."""
        g = meta.groups[0]
        return g if len(meta.groups) == 1 and isinstance(g, NativeGroup) and g.decode_only else None

    def decode_pass(self, model: torch.nn.Module) -> NativeDecode | None:
        """`model`'s decode-only steps in one native call (kvflow.kernels.cpu.decode_pass), or None
        when it cannot take them (see `native_decode_unsupported`)."""
        from kvflow.kernels.cpu.decode_pass import NativeDecode, native_decode_unsupported

        return NativeDecode(model) if native_decode_unsupported(model) is None else None

    def _attend(self, q: torch.Tensor, kv_cache: LayerKVCache, g: NativeGroup | AttentionGroup, scale: float,
                out: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(g, NativeGroup):
            return super()._attend(q, kv_cache, g, scale, out)
        t, num_heads, head_dim = q.shape
        dtype = q.dtype
        if q.stride(2) != 1 or q.stride(1) != head_dim or dtype != torch.float32:
            q = q.float().contiguous()
        dst = out if out is not None and out.dtype == torch.float32 else torch.empty(t, num_heads * head_dim)
        data, scales = kv_cache.data, kv_cache.scale
        rc = self._lib.kvflow_paged_attention(
            q.data_ptr(), q.stride(0), data.data_ptr(), None if scales is None else scales.data_ptr(),
            KV_FORMATS[data.dtype], g.tables.data_ptr(), g.tables.stride(0), g.context_lens.data_ptr(),
            g.tokens.data_ptr(), len(g.tokens), num_heads, data.shape[3], head_dim, self.block_size,
            self.sliding_window or 0, scale, dst.data_ptr(), torch.get_num_threads(), int(not g.decode_only))
        if rc != 0:
            raise RuntimeError(f"native paged attention refused head_dim={head_dim}, heads={num_heads}/{data.shape[3]}")
        if dst.dtype == dtype:
            return dst
        if out is None:  # (the step's one group)
            return dst.to(dtype)
        rows = g.tokens.long()
        out[rows] = dst[rows].to(dtype)
        return out
