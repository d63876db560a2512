"""`TorchPagedAttention`, the portable reference backend: any device, any dtype.

Each group of a step gathers its sequences' cached tokens (one `index_select` over slots for K and
V together), pads the sequences to one length, and runs `scaled_dot_product_attention` (with a
mask only where one is needed). Decodes form one group and prefill chunks are split into groups
of similar size (`partition_groups`), so a long chunk pads neither the decodes nor the short
chunks to its length. The CPU and Triton backends build on it (its cache allocation; the CPU
backend also its groups, for prefill rows it sends through SDPA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.backend import (
    BACKEND_WINDOW,
    AttentionGroup,
    AttentionMetadata,
    LayerKVCache,
    PagedRows,
    SeqLayout,
    TokenLayout,
    check_softcap,
    kv_zeros,
    layer_window,
    partition_groups,
)
from kvflow.attention.kv_formats import check_head_dim, dequantize, format_of, kv_float_dtype, kv_format, quantize
from kvflow.quantization.int8 import quantize_kv


class TorchPagedAttention:
    supports_decode_graphs = False  # (see AttentionBackend)

    def __init__(self, block_size: int, sliding_window: int | None, device: torch.device) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device

    # ---- cache ---------------------------------------------------------------------------------
    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> list[LayerKVCache]:
        shape = (num_blocks, self.block_size, 2, num_kv_heads, head_dim)
        fmt = kv_format(kv_cache_dtype)
        if fmt is None:
            stored = kv_float_dtype(kv_cache_dtype, dtype)
            return [LayerKVCache(kv_zeros(shape, stored, self.device)) for _ in range(num_layers)]
        check_head_dim(fmt, head_dim)
        packed = (*shape[:-1], head_dim // fmt.values_per_element)
        return [
            LayerKVCache(kv_zeros(packed, fmt.storage, self.device), kv_zeros(shape[:-1], torch.float32, self.device))
            for _ in range(num_layers)
        ]

    # ---- per step ------------------------------------------------------------------------------
    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata:
        dev = self.device
        t = TokenLayout.of(seqs, self.block_size)
        total = t.positions.shape[0]
        groups = [
            self._group(torch.tensor(members), t.starts, t.lens, t.offsets, t.tables, total)
            for members in partition_groups([s.num_new for s in seqs], [s.start_pos + s.num_new for s in seqs])
        ]
        return AttentionMetadata(positions=t.positions.to(dev), slot_mapping=t.slot_mapping.to(dev), groups=groups)

    def _group(
        self,
        members: torch.Tensor,
        starts: torch.Tensor,
        lens: torch.Tensor,
        offsets: torch.Tensor,
        tables: torch.Tensor,
        total: int,
    ) -> AttentionGroup:
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
        slots = (
            g_tables.gather(1, (key_pos // bs).clamp_max(g_tables.shape[1] - 1).expand(batch, -1)) * bs + key_pos % bs
        )
        slots = torch.where(key_pos[None, :] < ends[:, None], slots, 0)  # past a sequence's end: masked anyway
        # One sequence decoding sees exactly its kv_len keys: no mask needed.
        mask = None
        causal = q_len > 1 and self.sliding_window is None and not bool(g_starts.any())
        q_pos = g_starts[:, None] + q_idx[None, :]
        if not ((batch == 1 and q_len == 1) or causal) or self.sliding_window is not None:
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
            q_pos=q_pos.to(dev),
            mask_window=self.sliding_window,
            batch=batch,
            q_len=q_len,
            kv_len=kv_len,
        )

    # ---- per layer -----------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = BACKEND_WINDOW,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D]; kv: [T, 2, KV, D] (new keys and values) -> [T, H * D] (contiguous).
        window, softcap: see AttentionBackend.forward."""
        window = layer_window(self.sliding_window, window)
        check_softcap(softcap)
        self._write_kv(kv, kv_cache, meta)
        out = None
        for g in meta.groups:
            out = self._attend(q, kv_cache, g, scale, out, window, softcap)
        return out

    def decode_group(self, meta: AttentionMetadata) -> PagedRows | None:
        """None: this backend's rows are gathered, not read in place (see AttentionBackend)."""
        return None

    def _write_kv(self, kv: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata) -> None:
        slots, slot_scales = kv_cache.slots, kv_cache.slot_scales
        if slot_scales is None:  # (a float cache of another dtype than the model's: rounded here)
            slots.index_copy_(0, meta.slot_mapping, kv.to(slots.dtype))
        else:
            kv_q, kv_s = quantize_kv(kv) if slots.dtype == torch.int8 else quantize(kv, format_of(slots))
            # (as bytes: torch has no index_copy for float8; every quantized format's codes are bytes)
            slots.view(torch.uint8).index_copy_(0, meta.slot_mapping, kv_q.view(torch.uint8))
            slot_scales.index_copy_(0, meta.slot_mapping, kv_s)

    @staticmethod
    def _mask(g: AttentionGroup, window: int | None) -> tuple[torch.Tensor | None, bool]:
        """The group's (mask, causal) for a layer attending within `window` (None: all keys)."""
        if window == g.mask_window or g.q_pos is None:
            return g.mask, g.causal
        mask = g.window_masks.get(window)
        if mask is None:
            key_pos = torch.arange(g.kv_len, device=g.q_pos.device)
            m = key_pos[None, None, :] <= g.q_pos[:, :, None]
            if window is not None:
                m &= key_pos[None, None, :] > g.q_pos[:, :, None] - window
            mask = g.window_masks[window] = m.unsqueeze(1)
        return mask, False

    def _attend(
        self,
        q: torch.Tensor,
        kv_cache: LayerKVCache,
        g: AttentionGroup,
        scale: float,
        out: torch.Tensor | None,
        window: int | None = BACKEND_WINDOW,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of one group's query rows; returns the step's [T, H * D] output so far (`out`,
        allocated here on first need, with this group's rows written in)."""
        mask, causal = self._mask(g, layer_window(self.sliding_window, window))
        t, num_heads, head_dim = q.shape
        num_kv = kv_cache.data.shape[3]
        slots, slot_scales = kv_cache.slots, kv_cache.slot_scales
        b, n = g.batch, g.q_len
        if slot_scales is None or slots.dtype == torch.int8:
            kv_g = slots.index_select(0, g.slots)  # [B * L, 2, KV, D]
        else:  # fp8 / int4 codes gathered as bytes (int4: D / 2 of them); no float8 index_select in torch
            kv_g = slots.view(torch.uint8).index_select(0, g.slots).view(slots.dtype)
        if slot_scales is not None and slots.dtype == torch.int8:
            kv_g = kv_g * slot_scales.index_select(0, g.slots).unsqueeze(-1).to(q.dtype)
        elif slot_scales is not None:  # fp8 / int4 codes, widened (and unpacked) here
            kv_g = dequantize(kv_g, slot_scales.index_select(0, g.slots), q.dtype)
        elif kv_g.dtype != q.dtype:  # a float cache of another dtype than the model's
            kv_g = kv_g.to(q.dtype)
        kg, vg = kv_g.view(b, g.kv_len, 2, num_kv, head_dim).permute(2, 0, 3, 1, 4)  # 2 x [B, KV, L, D]
        qg = q if g.rows is None else q.index_select(0, g.rows)
        if softcap is not None:
            o = _softcapped_attention(qg.view(b, n, num_heads, head_dim), kg, vg, mask, causal, scale, softcap)
        elif n == 1 and num_heads != num_kv:
            # Decode: the G query heads sharing a kv head are G rows of one attention problem.
            o = F.scaled_dot_product_attention(
                qg.reshape(b, num_kv, num_heads // num_kv, head_dim), kg, vg, attn_mask=mask, scale=scale
            )
            o = o.view(b, num_heads * head_dim)
        else:
            qg = qg.view(b, n, num_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=num_kv != num_heads
            )
            o = o.transpose(1, 2).reshape(b * n, num_heads * head_dim)
        if g.rows is None:  # the group is the whole step, in order
            return o
        if out is None:
            out = torch.empty(t, num_heads * head_dim, dtype=q.dtype, device=q.device)
        out[g.dst] = o if g.valid is None else o[g.valid]
        return out


def _softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with soft-capped scores, in HF's eager order (SDPA has no soft-cap): scores =
    tanh(scale * q.k / softcap) * softcap, masked, softmax in float32 rounded to q's dtype, times v.
    q: [B, n, H, D]; k, v: [B, KV, L, D]; mask: [B, 1, n, L] (True: may attend) -> [B * n, H * D]."""
    b, n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q.transpose(1, 2), k.transpose(2, 3)) * scale  # [B, H, n, L]
    s = torch.tanh(s / softcap) * softcap
    if mask is None and causal:  # (every chunk starts at position 0, so L == n)
        mask = torch.ones(n, k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v).transpose(1, 2).reshape(b * n, num_heads * head_dim)
