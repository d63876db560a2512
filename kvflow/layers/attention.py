"""Attention over a paged KV cache.

A step's tokens are one flat axis mixing decodes (1 new token) and prefill chunks (many new
tokens starting at any position). Each layer writes its new K/V into the cache through
`slot_mapping`, then every new token attends to its sequence's cached prefix plus the chunk
itself (causal). The backend builds its metadata once per step (positions, slots to write, slots
to gather, masks); layers only run `forward`.

KV cache layout: one `LayerKVCache` per layer, whose `data` is
``[num_blocks, block_size, 2, kv_heads, head_dim]`` (index 0 of the third axis is K, 1 is V), so a
block -- K and V of `block_size` tokens -- is one contiguous piece of memory. In the default
(`kv_cache_dtype="auto"`) mode `data` has the model's dtype and `scale` is None. With
`kv_cache_dtype="int8"`, `data` is int8 and `scale` is float32 ``[num_blocks, block_size, 2,
kv_heads]``: one symmetric scale per token, per K/V, per kv head, written with the values at
cache-write time and applied when the blocks are gathered for attention. Scales live per slot next
to their values, so anything that moves or shares whole blocks (prefix caching, preemption,
offload) moves `data[b]` and `scale[b]` together.

`TorchPagedAttention` is the portable reference: gather each sequence's cached tokens (one
`index_select` over slots for K and V together), pad sequences of a group to one length, and run
`scaled_dot_product_attention` (with a mask only where one is needed). Decodes form one group and
prefill chunks are split into groups of similar size (`partition_groups`), so a long chunk pads
neither the decodes nor the short chunks to its length. `CpuPagedAttention`
(kvflow/kernels/cpu/paged_attention.py) replaces the decode group with a native kernel that reads
the paged cache in place; `TritonPagedAttention` (kvflow/kernels/triton/paged_attention.py) runs
every row through Triton kernels that read the paged cache in place (CUDA devices).
`make_attention_backend` picks the backend.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from kvflow.config import ATTENTION_BACKENDS
from kvflow.layers.quant import quantize_kv

if TYPE_CHECKING:
    from kvflow.kernels.cpu.paged_attention import NativeGroup

KV_CACHE_DTYPES = ("auto", "int8")
logger = logging.getLogger("kvflow")


@dataclass
class LayerKVCache:
    """One layer's paged K/V. data: [num_blocks, block_size, 2, kv_heads, head_dim];
    scale: [num_blocks, block_size, 2, kv_heads] float32 when data is int8, else None."""

    data: torch.Tensor
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Slot-major views (slot = block * block_size + offset), used to write and gather tokens.
        nb, bs = self.data.shape[:2]
        self.slots = self.data.view(nb * bs, *self.data.shape[2:])  # [num_slots, 2, kv_heads, head_dim]
        self.slot_scales = None if self.scale is None else self.scale.view(nb * bs, *self.scale.shape[2:])

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    @property
    def k(self) -> torch.Tensor:
        """Keys as a view, dequantization not applied: [num_blocks, block_size, kv_heads, head_dim]."""
        return self.data[:, :, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.data[:, :, 1]


@dataclass
class AttentionGroup:
    rows: torch.Tensor | None  # [B * q_len] index into the step's token axis; None = the identity
    valid: torch.Tensor | None  # [B * q_len] bool, None when no row is padding
    dst: torch.Tensor | None  # token-axis indices of the valid rows, in order; None with rows None
    slots: torch.Tensor  # [B * kv_len] cache slots to gather, row-major by sequence (padding: slot 0)
    mask: torch.Tensor | None  # [B, 1, q_len, kv_len], True = may attend; None = attend to all kv_len
    batch: int
    q_len: int
    kv_len: int  # keys gathered per sequence: the longest context of the group
    # Every sequence's chunk starts at position 0 (a whole prompt, or its first chunk): the mask is
    # the plain causal one, which SDPA applies itself (its flash kernel skips the masked half)
    # instead of reading a [B, 1, q_len, kv_len] mask. A shorter sequence's padding keys lie past
    # its own rows, so causality alone keeps its valid rows off them.
    causal: bool = False


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] absolute position of each new token
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    groups: list[AttentionGroup]


@dataclass
class SeqLayout:
    """What the backend needs to know of one scheduled sequence."""

    start_pos: int
    num_new: int
    block_table: list[int]


@dataclass
class TokenLayout:
    """A step's sequences on the flat token axis (host tensors, int64): what every backend's
    metadata starts from."""

    starts: torch.Tensor  # [B] position of each sequence's first new token
    lens: torch.Tensor  # [B] new tokens of each sequence
    offsets: torch.Tensor  # [B] index of each sequence's first new token on the token axis
    tables: torch.Tensor  # [B, max_blocks] block tables, padded with block 0
    positions: torch.Tensor  # [T] absolute position of every new token
    slot_mapping: torch.Tensor  # [T] its cache slot

    @classmethod
    def of(cls, seqs: list[SeqLayout], block_size: int) -> "TokenLayout":
        starts = torch.tensor([s.start_pos for s in seqs], dtype=torch.long)
        lens = torch.tensor([s.num_new for s in seqs], dtype=torch.long)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
                              dtype=torch.long)
        total = int(lens.sum())
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), lens)
        offsets = torch.cumsum(lens, 0) - lens
        positions = starts[seq_of_token] + torch.arange(total) - offsets[seq_of_token]
        slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        return cls(starts, lens, offsets, tables, positions, slot_mapping)


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             kv_cache_dtype: str = "auto") -> int:
    """Bytes of KV cache one token occupies across all layers (K and V, scales included)."""
    if kv_cache_dtype == "int8":
        per_head = head_dim * 1 + 4  # int8 values + one float32 scale
    elif kv_cache_dtype == "auto":
        per_head = head_dim * torch.empty((), dtype=dtype).element_size()
    else:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return 2 * num_layers * num_kv_heads * per_head


def partition_groups(q_lens: list[int], kv_lens: list[int], max_waste: float = 1.5,
                     small: int = 1 << 16) -> list[list[int]]:
    """Split a step's sequences into attention groups, each a list of indices in token order.

    A group is padded to its longest chunk (queries) and longest context (keys), so one 1,000-token
    prompt grouped with thirty 64-token chunks would multiply the attention work by ~15. Decodes
    form one group; prefill chunks are taken largest first (q_len x kv_len) and join the current
    group while its padded size stays within `max_waste` times the work it really holds, or under
    `small` query-key pairs (tiny chunks: one SDPA call beats several)."""
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    prefill = sorted((i for i, n in enumerate(q_lens) if n > 1), key=lambda i: -q_lens[i] * kv_lens[i])
    groups: list[list[int]] = [decode] if decode else []
    current: list[int] = []
    max_q = max_kv = work = 0
    for i in prefill:
        q, kv = max(max_q, q_lens[i]), max(max_kv, kv_lens[i])
        padded = (len(current) + 1) * q * kv
        if current and padded > max(max_waste * (work + q_lens[i] * kv_lens[i]), small):
            groups.append(sorted(current))
            current, q, kv, work = [], q_lens[i], kv_lens[i], 0
        current.append(i)
        max_q, max_kv, work = q, kv, work + q_lens[i] * kv_lens[i]
    if current:
        groups.append(sorted(current))
    return groups


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. Zeroed, not empty: masked-out slots are still multiplied by 0 and NaN
    garbage would leak. On the CPU it is anonymous mmap memory, zero by the kernel's guarantee and
    faulted in page by page as blocks are first written, so start-up does not spend ~0.4 s per GiB
    writing zeros to a pool that is mostly empty."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    # torch.frombuffer keeps the mmap object alive as long as the tensor's storage.
    return torch.frombuffer(mmap.mmap(-1, n * dtype.itemsize), dtype=dtype).view(shape)


class TorchPagedAttention:
    # Whether decode-only steps can replay CUDA graphs over its static metadata buffers
    # (`static_decode_metadata` & co., kvflow.worker.cuda_graphs).
    supports_decode_graphs = False

    def __init__(self, block_size: int, sliding_window: int | None, device: torch.device) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device

    # ---- cache ---------------------------------------------------------------------------------
    def allocate_kv_cache(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, kv_cache_dtype: str = "auto") -> list[LayerKVCache]:
        shape = (num_blocks, self.block_size, 2, num_kv_heads, head_dim)
        if kv_cache_dtype == "auto":
            return [LayerKVCache(kv_zeros(shape, dtype, self.device)) for _ in range(num_layers)]
        if kv_cache_dtype == "int8":
            return [LayerKVCache(kv_zeros(shape, torch.int8, self.device), kv_zeros(shape[:-1], torch.float32, self.device))
                    for _ in range(num_layers)]
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")

    # ---- per step ------------------------------------------------------------------------------
    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata:
        dev = self.device
        t = TokenLayout.of(seqs, self.block_size)
        total = t.positions.shape[0]
        groups = [self._group(torch.tensor(members), t.starts, t.lens, t.offsets, t.tables, total)
                  for members in partition_groups([s.num_new for s in seqs], [s.start_pos + s.num_new for s in seqs])]
        return AttentionMetadata(positions=t.positions.to(dev), slot_mapping=t.slot_mapping.to(dev), groups=groups)

    def _group(self, members: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
               offsets: torch.Tensor, tables: torch.Tensor, total: int) -> AttentionGroup:
        g_starts, g_lens, g_offsets = starts[members], lens[members], offsets[members]
        batch, q_len = len(members), int(g_lens.max())
        ends = g_starts + g_lens
        kv_len = int(ends.max())
        q_idx = torch.arange(q_len)
        valid = q_idx[None, :] < g_lens[:, None]  # [B, q_len]
        rows = g_offsets[:, None] + torch.minimum(q_idx[None, :], g_lens[:, None] - 1)
        all_valid = bool(valid.all())
        identity = all_valid and batch * q_len == total  # the group is the whole step, in order
        key_pos = torch.arange(kv_len)
        bs = self.block_size
        g_tables = tables[members]
        slots = g_tables.gather(1, (key_pos // bs).clamp_max(g_tables.shape[1] - 1).expand(batch, -1)) * bs + key_pos % bs
        slots = torch.where(key_pos[None, :] < ends[:, None], slots, 0)  # past a sequence's end: masked anyway
        # One sequence decoding sees exactly its kv_len keys: no mask needed.
        mask = None
        causal = q_len > 1 and self.sliding_window is None and not bool(g_starts.any())
        if not (batch == 1 and q_len == 1 or causal) or self.sliding_window is not None:
            q_pos = g_starts[:, None] + q_idx[None, :]
            m = key_pos[None, None, :] <= q_pos[:, :, None]
            if self.sliding_window is not None:
                m &= key_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
            mask = m.unsqueeze(1).to(self.device)
        dev = self.device
        return AttentionGroup(
            rows=None if identity else rows.flatten().to(dev),
            valid=None if all_valid else valid.flatten().to(dev),
            dst=None if identity else rows[valid].to(dev),
            slots=slots.flatten().to(dev),
            mask=mask,
            causal=causal,
            batch=batch,
            q_len=q_len,
            kv_len=kv_len,
        )

    # ---- per layer -----------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, H, D]; kv: [T, 2, KV, D] (new keys and values) -> [T, H * D] (contiguous)."""
        self._write_kv(kv, kv_cache, meta)
        out = None
        for g in meta.groups:
            out = self._attend(q, kv_cache, g, scale, out)
        return out

    def decode_group(self, meta: AttentionMetadata) -> None:
        """The native decode rows of a decode-only step (see CpuPagedAttention); none here."""
        return None

    def decode_pass(self, model: torch.nn.Module) -> DecodePass | None:
        """A fused pass running all of `model`'s decoder layers on a decode-only step (see
        CpuPagedAttention); none here."""
        return None

    def _write_kv(self, kv: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata) -> None:
        slots, slot_scales = kv_cache.slots, kv_cache.slot_scales
        if slot_scales is None:
            slots.index_copy_(0, meta.slot_mapping, kv)
        else:
            kv_q, kv_s = quantize_kv(kv)
            slots.index_copy_(0, meta.slot_mapping, kv_q)
            slot_scales.index_copy_(0, meta.slot_mapping, kv_s)

    def _attend(self, q: torch.Tensor, kv_cache: LayerKVCache, g: AttentionGroup, scale: float,
                out: torch.Tensor | None) -> torch.Tensor:
        """Attention of one group's query rows; returns the step's [T, H * D] output so far (`out`,
        allocated here on first need, with this group's rows written in)."""
        t, num_heads, head_dim = q.shape
        num_kv = kv_cache.data.shape[3]
        slots, slot_scales = kv_cache.slots, kv_cache.slot_scales
        b, n = g.batch, g.q_len
        kv_g = slots.index_select(0, g.slots)  # [B * L, 2, KV, D]
        if slot_scales is not None:
            kv_g = kv_g * slot_scales.index_select(0, g.slots).unsqueeze(-1).to(q.dtype)
        kg, vg = kv_g.view(b, g.kv_len, 2, num_kv, head_dim).permute(2, 0, 3, 1, 4)  # 2 x [B, KV, L, D]
        qg = q if g.rows is None else q.index_select(0, g.rows)
        if n == 1 and num_heads != num_kv:
            # Decode: the G query heads sharing a kv head are G rows of one attention problem.
            o = F.scaled_dot_product_attention(qg.reshape(b, num_kv, num_heads // num_kv, head_dim), kg, vg,
                                               attn_mask=g.mask, scale=scale)
            o = o.view(b, num_heads * head_dim)
        else:
            qg = qg.view(b, n, num_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, is_causal=g.causal, scale=scale,
                                               enable_gqa=num_kv != num_heads)
            o = o.transpose(1, 2).reshape(b * n, num_heads * head_dim)
        if g.rows is None:  # the group is the whole step, in order
            return o
        if out is None:
            out = torch.empty(t, num_heads * head_dim, dtype=q.dtype, device=q.device)
        out[g.dst] = o if g.valid is None else o[g.valid]
        return out


class AttentionBackend(Protocol):
    """What the model runner and the layers need from an attention implementation."""

    supports_decode_graphs: bool

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, kv_cache_dtype: str = "auto") -> list[LayerKVCache]: ...

    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata: ...

    def forward(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor: ...

    def decode_group(self, meta: AttentionMetadata) -> NativeGroup | None: ...

    def decode_pass(self, model: torch.nn.Module) -> DecodePass | None: ...


class DecodePass(Protocol):
    """All decoder layers of a decode-only step in one call, from the attention backend
    (`decode_pass`): runs on x [rows, hidden] in place, row r being the step's token r, with the
    rows that backend's `decode_group` returned for the step, for steps of up to `max_rows` rows."""

    max_rows: int

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, kv_caches: list[LayerKVCache],
                 slot_mapping: torch.Tensor, group: NativeGroup) -> None: ...


def make_attention_backend(name: str, block_size: int, sliding_window: int | None, device: torch.device,
                           dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                           head_dim: int) -> TorchPagedAttention:
    """`attention_backend`: "torch" (the portable reference), "native" (the CPU kernel), "triton"
    (the Triton kernels: CUDA, or the CPU under TRITON_INTERPRET=1) -- an error if the one asked for
    cannot run here -- or "auto" (CUDA: triton; CPU: native; else, or when those cannot run: torch)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "torch":
        return TorchPagedAttention(block_size, sliding_window, device)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from kvflow.kernels.triton.paged_attention import TritonPagedAttention, triton_unsupported

        why = triton_unsupported(device)
        if why is None:
            return TritonPagedAttention(block_size, sliding_window, device)
        if name == "triton":
            raise ValueError(f"attention_backend='triton' is not available: {why}")
        logger.warning("attention: torch reference path (the Triton backend cannot run: %s)", why)
        return TorchPagedAttention(block_size, sliding_window, device)
    # Imported here: the CPU backend is built on this module's TorchPagedAttention.
    from kvflow.kernels.cpu.paged_attention import CpuPagedAttention, native_unsupported

    why = native_unsupported(device, dtype, num_heads, num_kv_heads, head_dim)
    if why is None:
        return CpuPagedAttention(block_size, sliding_window, device)
    if name == "native":
        raise ValueError(f"attention_backend='native' is not available: {why}")
    return TorchPagedAttention(block_size, sliding_window, device)
