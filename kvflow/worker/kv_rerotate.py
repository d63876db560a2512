"""Moving cached keys to new positions: the rotary embedding of a key at position p, rotated by
R(-d), is the key at position p - d (R(p - d) k = R(-d) R(p) k), so a block whose tokens moved d
places down the cache (attention sinks: the blocks before it were dropped) needs no recomputation,
only one rotation of its keys in every layer. Values carry no position and stay as they are.

The rotation is taken from the model's own cos/sin table (the rotate-half layout,
kvflow.layers.rotary) at position d, normalised to unit length per frequency: a table that folds an
attention factor into cos and sin (YaRN-style scaling) would otherwise scale the keys again.
"""

from __future__ import annotations

import torch

from kvflow.attention.backend import LayerKVCache


class KeyRerotation:
    """R(-d) for any shift d < the table's length, applied in place to blocks of a paged KV cache."""

    def __init__(self, cos: torch.Tensor, sin_signed: torch.Tensor, head_dim: int) -> None:
        """cos, sin_signed: [positions, head_dim] as kvflow.layers.rotary.RotaryEmbedding holds them
        (sin with its first half negated)."""
        if cos.dim() != 2 or cos.shape[-1] != head_dim or sin_signed.shape != cos.shape:
            raise ValueError(
                f"attention sinks re-rotate cached keys over the whole head (rotate-half rotary); this "
                f"model's rotary table is {tuple(cos.shape)} for head_dim {head_dim}"
            )
        self.cos = cos
        self.sin_signed = sin_signed
        self.half = head_dim // 2

    def rotation(self, delta: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin_signed of R(-delta), [head_dim], unit length per frequency."""
        if not 0 < delta < self.cos.shape[0]:
            raise ValueError(f"key shift {delta} outside the rotary table's 1..{self.cos.shape[0] - 1}")
        c = self.cos[delta].double()
        s = self.sin_signed[delta].double()
        norm = torch.sqrt(c * c + s * s)
        return (c / norm).to(dtype), (-s / norm).to(dtype)  # R(-d): cos(-x) = cos x, sin(-x) = -sin x

    @torch.inference_mode()
    def apply_(self, kv_caches: list[LayerKVCache], blocks: list[int], delta: int) -> None:
        """Rotate the keys of `blocks` (every slot, every layer) back by `delta` positions, in place.
        Slots past a sequence's end hold nothing it reads (they are written before any read)."""
        if not blocks:
            return
        first = kv_caches[0]
        if first.quantized:
            raise ValueError(
                "attention sinks: a quantized KV cache (int8, fp8, int4) cannot be re-rotated (use the model dtype)"
            )
        idx = torch.tensor(blocks, dtype=torch.long, device=first.data.device)
        cos, sin_signed = self.rotation(delta, torch.float32)
        for cache in kv_caches:
            k = cache.data.index_select(0, idx)[:, :, 0].float()  # [n, block_size, kv_heads, head_dim]
            rotated = torch.addcmul(k * cos, k.roll(self.half, dims=-1), sin_signed)
            cache.data[idx, :, 0] = rotated.to(cache.data.dtype)
