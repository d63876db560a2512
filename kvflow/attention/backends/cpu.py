"""`CpuPagedAttention`: paged attention on the CPU, every query row read in place by a native kernel.

`TorchPagedAttention` with the attention itself in kvflow/kernels/cpu/csrc/paged_attention.cpp:
each new token of a step -- a decode, or a token of a prefill chunk -- is one row attending to the
keys of its sequence up to its own position (causal by construction, a sliding window by its
start), walked through the block table where they lie. Nothing is gathered, nothing is padded to
the longest context, and blocks that several sequences share (prefix caching) are read from cache,
not copied. Float32 and bfloat16 models, with a cache in the model's dtype or quantized (int8,
fp8 e4m3 / e5m2, int4: widened as they are read); the maths is float32 (a bf16 model's queries are
widened at the call, its outputs rounded back), except prefill tiles over a bf16 cache on CPUs with
AVX512_BF16, which multiply in bf16 (csrc/tiled_attention.h).
Each call takes its layer's window and attention-logit soft-cap (Gemma 2), so one backend serves
models whose layers differ in both.

Rows that share sequences (prefill chunks) run head-major (csrc/attention.h's attend_rows), so a
thread's next rows read the same head's keys while they are still in cache. Gather + SDPA can
still win on prefill rows on some CPUs (oneDNN's bf16 kernels on AMX Xeons), so which path runs
them (`prefill_path`) is measured at the first start on a CPU and stored with the kernel choices
(kvflow.worker.autotune.measure_prefill_attention; docs/benchmarks/results/ has the figures): with
"torch", a step's prefill chunks go through the torch groups and its decodes still through the
native kernel. The cache write of every step runs in the same library with the same code as the
native decode pass (kvflow.models.decode_pass), whose rows `decode_group` hands out.
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.attention.backend import (
    BACKEND_WINDOW,
    DECODE_LIKE_ROWS,
    AttentionGroup,
    AttentionMetadata,
    LayerKVCache,
    PagedRows,
    SeqLayout,
    TokenLayout,
    layer_window,
    partition_groups,
)
from kvflow.attention.backends.torch import TorchPagedAttention
from kvflow.kernels.cpu import paged_attention as kernel

# The model dtypes the backend serves (the cache may also be quantized).
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def native_unsupported(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """Why the native kernel cannot serve this model here, or None when it can."""
    if device.type != "cpu":
        return f"it runs on the CPU; device is {device.type!r}"
    if dtype not in NATIVE_DTYPES:
        return f"it runs float32 and bfloat16 models; dtype is {dtype}"
    if head_dim > kernel.MAX_HEAD_DIM or num_heads // num_kv_heads > kernel.MAX_GROUP:
        return (
            f"head_dim {head_dim} / query heads per kv head {num_heads // num_kv_heads} exceed "
            f"{kernel.MAX_HEAD_DIM} / {kernel.MAX_GROUP}"
        )
    if not kernel.available():
        return "the kernel could not be built (see the warning above)"
    return None


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, block_size: int, sliding_window: int | None, device: torch.device) -> None:
        super().__init__(block_size, sliding_window, device)
        if not kernel.available():
            raise RuntimeError("the native paged-attention kernel could not be built")
        self.prefill_path = "native"  # or "torch": see the top of the file

    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata:
        """One PagedRows for the whole step: every new token a row (see the top of the file); with
        prefill_path "torch" and prefill chunks in the step, a PagedRows of its decodes and torch
        groups of the rest."""
        t = TokenLayout.of(seqs, self.block_size)
        total = t.positions.shape[0]
        decode_only = total == len(seqs)
        # (drafts to verify are a decode's few rows, not a prefill chunk: native rows on any path)
        decode_like = decode_only or max(s.num_new for s in seqs) <= DECODE_LIKE_ROWS
        if not decode_like and self.prefill_path == "torch":
            return self._split_metadata(seqs, t)
        # (numpy views of the layout: see TokenLayout.of)
        tables = t.tables.numpy() if decode_only else t.tables.numpy()[np.repeat(np.arange(len(seqs)), t.lens.numpy())]
        group = PagedRows(
            tables=torch.from_numpy(tables.astype(np.int32)),
            context_lens=torch.from_numpy((t.positions.numpy() + 1).astype(np.int32)),
            tokens=torch.from_numpy(np.arange(total, dtype=np.int32)),
            decode_only=decode_only,
            decode_like=decode_like,
        )
        return AttentionMetadata(positions=t.positions, slot_mapping=t.slot_mapping, groups=[group])

    def _split_metadata(self, seqs: list[SeqLayout], t: TokenLayout) -> AttentionMetadata:
        total = t.positions.shape[0]
        decodes = [i for i, s in enumerate(seqs) if s.num_new == 1]
        chunks = [i for i, s in enumerate(seqs) if s.num_new > 1]
        groups: list[AttentionGroup | PagedRows] = [
            self._group(torch.tensor([chunks[j] for j in members]), t.starts, t.lens, t.offsets, t.tables, total)
            for members in partition_groups(
                [seqs[i].num_new for i in chunks], [seqs[i].start_pos + seqs[i].num_new for i in chunks]
            )
        ]
        if decodes:  # last: its rows go into the output the torch groups made (a bf16 model's: those rows only)
            idx = torch.tensor(decodes)
            groups.append(
                PagedRows(
                    tables=t.tables[idx].to(torch.int32).contiguous(),
                    context_lens=(t.starts[idx] + 1).to(torch.int32),
                    tokens=t.offsets[idx].to(torch.int32),
                )
            )
        return AttentionMetadata(positions=t.positions, slot_mapping=t.slot_mapping, groups=groups)

    def _write_kv(self, kv: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata) -> None:
        # The same C code as the native decode pass's write (quantized / bf16 caches: the same rounding).
        kernel.write_kv(kv, meta.slot_mapping, kv_cache.data, kv_cache.scale)

    def decode_group(self, meta: AttentionMetadata) -> PagedRows | None:
        """The step's rows as one PagedRows when every sequence's are a decode or a decode with its
        drafts (at most DECODE_LIKE_ROWS rows: `decode_like`), else None."""
        g = meta.groups[0]
        return g if len(meta.groups) == 1 and isinstance(g, PagedRows) and g.decode_like else None

    def _attend(
        self,
        q: torch.Tensor,
        kv_cache: LayerKVCache,
        g: PagedRows | AttentionGroup,
        scale: float,
        out: torch.Tensor | None,
        window: int | None = BACKEND_WINDOW,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if not isinstance(g, PagedRows):
            return super()._attend(q, kv_cache, g, scale, out, window, softcap)
        t, num_heads, head_dim = q.shape
        dtype = q.dtype
        if q.stride(2) != 1 or q.stride(1) != head_dim or dtype != torch.float32:
            q = q.float().contiguous()
        dst = out if out is not None and out.dtype == torch.float32 else torch.empty(t, num_heads * head_dim)
        # Decode-like rows (decodes, and decodes verifying drafts) as decode rows: each row's bits the
        # same as a plain decode's, as in the fused decode pass; longer chunks head-major / tiled.
        kernel.paged_attention(
            q,
            kv_cache.data,
            kv_cache.scale,
            g.tables,
            g.context_lens,
            g.tokens,
            self.block_size,
            layer_window(self.sliding_window, window),
            scale,
            dst,
            head_major=not g.decode_like,
            softcap=softcap,
        )
        if dst.dtype == dtype:
            return dst
        if out is None:  # (the step's one group)
            return dst.to(dtype)
        rows = g.tokens.long()
        out[rows] = dst[rows].to(dtype)
        return out
