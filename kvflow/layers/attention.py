"""Attention over a paged KV cache.

A step's tokens are one flat axis mixing decodes (1 new token) and prefill chunks (many new
tokens starting at any position). Each layer writes its new K/V into the cache through
`slot_mapping`, then every new token attends to its sequence's cached prefix plus the chunk
itself (causal). The backend builds its metadata once per step; layers only run `forward`.

`TorchPagedAttention` is the portable reference: gather each sequence's blocks, pad sequences
of a group to one shape, and run `scaled_dot_product_attention` with a mask. Decodes and
prefill chunks go in separate groups so a long chunk does not pad every decode to its length.
A GPU kernel can replace it behind the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    rows: torch.Tensor  # [B * q_len] index into the step's token axis (padding rows repeat a valid one)
    valid: torch.Tensor | None  # [B * q_len] bool, None when no row is padding
    dst: torch.Tensor  # token-axis indices of the valid rows, in order
    block_tables: torch.Tensor  # [B, num_blocks]
    mask: torch.Tensor  # [B, 1, q_len, num_blocks * block_size], True = may attend
    batch: int
    q_len: int


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


class TorchPagedAttention:
    def __init__(self, block_size: int, sliding_window: int | None, device: torch.device) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device

    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata:
        dev = self.device
        starts = torch.tensor([s.start_pos for s in seqs], dtype=torch.long)
        lens = torch.tensor([s.num_new for s in seqs], dtype=torch.long)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)

        # Flat token axis: sequence index and absolute position of every new token.
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), lens)
        offsets = torch.cumsum(lens, 0) - lens
        positions = starts[seq_of_token] + torch.arange(int(lens.sum())) - offsets[seq_of_token]
        bs = self.block_size
        slot_mapping = tables[seq_of_token, positions // bs] * bs + positions % bs

        groups = []
        is_decode = lens == 1
        for members in (torch.nonzero(is_decode).flatten(), torch.nonzero(~is_decode).flatten()):
            if len(members):
                groups.append(self._group(members, starts, lens, offsets, tables))
        return AttentionMetadata(positions=positions.to(dev), slot_mapping=slot_mapping.to(dev), groups=groups)

    def _group(self, members: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
               offsets: torch.Tensor, tables: torch.Tensor) -> AttentionGroup:
        g_starts, g_lens, g_offsets = starts[members], lens[members], offsets[members]
        batch, q_len = len(members), int(g_lens.max())
        num_blocks = -(-int((g_starts + g_lens).max()) // self.block_size)
        q_idx = torch.arange(q_len)
        valid = q_idx[None, :] < g_lens[:, None]  # [B, q_len]
        rows = g_offsets[:, None] + torch.minimum(q_idx[None, :], g_lens[:, None] - 1)
        q_pos = g_starts[:, None] + q_idx[None, :]
        key_pos = torch.arange(num_blocks * self.block_size)
        mask = key_pos[None, None, :] <= q_pos[:, :, None]
        if self.sliding_window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
        all_valid = bool(valid.all())
        dev = self.device
        return AttentionGroup(
            rows=rows.flatten().to(dev),
            valid=None if all_valid else valid.flatten().to(dev),
            dst=rows[valid].to(dev),
            block_tables=tables[members, :num_blocks].to(dev),
            mask=mask.unsqueeze(1).to(dev),
            batch=batch,
            q_len=q_len,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D]; caches: [num_blocks, block_size, KV, D] -> [T, H, D]."""
        num_kv, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv, head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for g in meta.groups:
            qg = q.index_select(0, g.rows).view(g.batch, g.q_len, q.shape[1], head_dim).transpose(1, 2)
            kg = k_cache[g.block_tables].view(g.batch, -1, num_kv, head_dim).transpose(1, 2)
            vg = v_cache[g.block_tables].view(g.batch, -1, num_kv, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale,
                                               enable_gqa=num_kv != q.shape[1])
            o = o.transpose(1, 2).reshape(g.batch * g.q_len, q.shape[1], head_dim)
            out[g.dst] = o if g.valid is None else o[g.valid]
        return out


class AttentionBackend(Protocol):
    """What the model runner and the layers need from an attention implementation."""

    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...
