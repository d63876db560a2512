"""`TritonPagedAttention`: the attention backend whose every step reads the paged KV cache in place
with the Triton kernels of kvflow.kernels.triton.attention_kernels -- decode rows through
`paged_decode` (a program per sequence and kv head), prefill / chunk rows through `paged_prefill`
(tiles of queries) -- instead of gathering and padding contexts as the torch reference does.

The metadata of a step is built once on the host and moved to the device in two copies (one int64
tensor, one int32); a layer's forward then launches at most two kernels and never syncs. Decode-only
steps can be replayed from CUDA graphs (kvflow.worker.cuda_graphs): the backend hands out static
metadata buffers of a fixed batch, whose rows past the real batch are padding -- context length
0 (the kernel writes zeros) and a cache write into one spare block kept for that.

The backend of CUDA devices; on the CPU only under TRITON_INTERPRET=1 (the tests' way to run the
kernels without a GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from kvflow.attention.backend import (
    BACKEND_WINDOW,
    AttentionMetadata,
    LayerKVCache,
    SeqLayout,
    TokenLayout,
    check_softcap,
    layer_window,
)
from kvflow.attention.backends.torch import TorchPagedAttention


def triton_unsupported(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on `device` here, or None when it can."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "it runs on CUDA devices (on the CPU only under TRITON_INTERPRET=1, Triton's interpreter, for tests)"
    if device.type not in ("cpu", "cuda"):
        return f"it runs on CUDA devices; device is {device.type!r}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (pip install triton)"
    return None


@dataclass
class TritonMetadata(AttentionMetadata):
    tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]: keys each sequence attends to (its new tokens included)
    query_start: torch.Tensor  # int32 [B + 1]: sequence s's rows are query_start[s] : query_start[s + 1]
    decode_seqs: torch.Tensor  # int32 [D]: the sequences with one new token
    tile_seq: torch.Tensor  # int32 [tiles]: each prefill tile's sequence
    tile_start: torch.Tensor  # int32 [tiles]: its first row within the sequence's chunk


class TritonPagedAttention(TorchPagedAttention):
    supports_decode_graphs = True

    def __init__(
        self, block_size: int, sliding_window: int | None, device: torch.device, block_m: int | None = None
    ) -> None:
        super().__init__(block_size, sliding_window, device)
        from kvflow.kernels.triton import attention_kernels

        self._kernels = attention_kernels  # (an attribute: the tests swap in mutated copies)
        # Queries per prefill tile: 16 under the interpreter (tests: less padding to simulate).
        self.block_m = block_m or (64 if device.type == "cuda" else 16)
        self.pad_slot = 0

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> list[LayerKVCache]:
        # One block more than the pool hands out: padded rows of a CUDA graph write their K/V there.
        self.pad_slot = num_blocks * self.block_size
        return super().allocate_kv_cache(num_layers, num_blocks + 1, num_kv_heads, head_dim, dtype, kv_cache_dtype)

    def build_metadata(self, seqs: list[SeqLayout]) -> TritonMetadata:
        t = TokenLayout.of(seqs, self.block_size)
        lens = t.lens.tolist()
        decode = [i for i, n in enumerate(lens) if n == 1]
        tiles = [(i, m) for i, n in enumerate(lens) if n > 1 for m in range(0, n, self.block_m)]
        b, width = t.tables.shape
        small = (
            torch.cat(
                (
                    t.tables.flatten(),
                    t.starts + t.lens,
                    torch.tensor([0]),
                    torch.cumsum(t.lens, 0),
                    torch.tensor(decode, dtype=torch.long),
                    torch.tensor([s for s, _ in tiles], dtype=torch.long),
                    torch.tensor([m for _, m in tiles], dtype=torch.long),
                )
            )
            .to(torch.int32)
            .to(self.device)
        )
        tables, ctx, qs, dec, tseq, tstart = small.split([b * width, b, b + 1, len(decode), len(tiles), len(tiles)])
        big = torch.cat((t.positions, t.slot_mapping)).to(self.device)
        positions, slot_mapping = big.split(t.positions.shape[0])
        return TritonMetadata(
            positions=positions,
            slot_mapping=slot_mapping,
            groups=[],
            tables=tables.view(b, width),
            context_lens=ctx,
            query_start=qs,
            decode_seqs=dec,
            tile_seq=tseq,
            tile_start=tstart,
        )

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: TritonMetadata,
        scale: float,
        window: int | None = BACKEND_WINDOW,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D] (heads contiguous); kv: [T, 2, KV, D] -> [T, H * D]. window, softcap: see
        AttentionBackend.forward."""
        window = layer_window(self.sliding_window, window)
        check_softcap(softcap)
        self._write_kv(kv, kv_cache, meta)
        t, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        out = torch.empty(t, num_heads * head_dim, dtype=q.dtype, device=q.device)
        k = self._kernels
        if meta.decode_seqs.shape[0]:
            k.paged_decode(
                q,
                kv_cache.data,
                kv_cache.scale,
                meta.tables,
                meta.context_lens,
                meta.query_start,
                meta.decode_seqs,
                out,
                scale,
                window,
                softcap=softcap,
            )
        if meta.tile_seq.shape[0]:
            k.paged_prefill(
                q,
                kv_cache.data,
                kv_cache.scale,
                meta.tables,
                meta.context_lens,
                meta.query_start,
                meta.tile_seq,
                meta.tile_start,
                out,
                scale,
                window,
                self.block_m,
                softcap=softcap,
            )
        return out

    # ---- static buffers of decode-only steps, for CUDA graphs ----------------------------------
    def static_decode_metadata(self, batch: int, max_blocks: int) -> TritonMetadata:
        """Metadata of a decode-only step of `batch` rows, all padding, in buffers that
        `copy_decode_metadata` refills each step (a captured graph reads them where they are)."""
        dev, i32 = self.device, torch.int32
        return TritonMetadata(
            positions=torch.zeros(batch, dtype=torch.long, device=dev),
            slot_mapping=torch.full((batch,), self.pad_slot, dtype=torch.long, device=dev),
            groups=[],
            tables=torch.zeros(batch, max_blocks, dtype=i32, device=dev),
            context_lens=torch.zeros(batch, dtype=i32, device=dev),
            query_start=torch.arange(batch + 1, dtype=i32, device=dev),
            decode_seqs=torch.arange(batch, dtype=i32, device=dev),
            tile_seq=torch.zeros(0, dtype=i32, device=dev),
            tile_start=torch.zeros(0, dtype=i32, device=dev),
        )

    @staticmethod
    def view_decode_metadata(static: TritonMetadata, batch: int) -> TritonMetadata:
        """The first `batch` rows of `static` (views: a graph captured on them sees every refill)."""
        return replace(
            static,
            positions=static.positions[:batch],
            slot_mapping=static.slot_mapping[:batch],
            tables=static.tables[:batch],
            context_lens=static.context_lens[:batch],
            query_start=static.query_start[: batch + 1],
            decode_seqs=static.decode_seqs[:batch],
        )

    def copy_decode_metadata(self, static: TritonMetadata, meta: TritonMetadata, batch: int) -> None:
        """This decode-only step's metadata into rows 0..n-1 of `static`; rows n..batch-1 padding."""
        n, width = meta.tables.shape
        static.positions[:n].copy_(meta.positions)
        static.slot_mapping[:n].copy_(meta.slot_mapping)
        static.tables[:n, :width].copy_(meta.tables)
        static.context_lens[:n].copy_(meta.context_lens)
        if batch > n:
            static.positions[n:batch].zero_()
            static.slot_mapping[n:batch].fill_(self.pad_slot)
            static.context_lens[n:batch].zero_()
