"""Rotary position embeddings (the rotate-half layout HF checkpoints use)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvflow.config import RopeConfig
from kvflow.kernels.cpu import paged_attention as cpu_kernels

# Rotary in place on x [T, heads, head_dim]: f(x, cos, sin_signed), cos and sin_signed as
# `RotaryEmbedding.lookup` returns them.
RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short kept, a smooth blend between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin for every position up to max_positions; looked up once per step."""

    def __init__(
        self, head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        # sin with the first half negated: rotate_half(x) * sin == x.roll(half) * sin_signed.
        half = head_dim // 2
        sign = torch.cat((-torch.ones(half), torch.ones(head_dim - half)))
        self.register_buffer("sin_signed", (emb.sin() * sign).to(dtype=dtype, device=device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed of shape [T, 1, head_dim], for `apply_rotary_`."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin_signed.index_select(0, positions).unsqueeze(1)


def apply_rotary_(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotary embedding of x [T, heads, head_dim] in three ops, written into `out` (default: x itself).

    x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == x.roll(half, -1) * sin_signed (the
    same products, sign included); `out` may alias x: both products are taken before it is written.
    """
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rolled, sin_signed, out=x if out is None else out)


def select_rotary(device: torch.device, dtype: torch.dtype, head_dim: int, native: bool) -> RotaryFn:
    """The in-place rotary to run on x [T, heads, head_dim] (heads contiguous, any row stride).

    `native`: the CPU's native kernel (kvflow.kernels.cpu.paged_attention.rotary_, the code the native
    decode pass runs, so a token's keys do not depend on which path computed them) where it can run
    for this device, dtype and head_dim. Otherwise, or with `native` False: `apply_rotary_`."""
    if native and device.type == "cpu" and cpu_kernels.rotary_available(dtype, head_dim):
        return cpu_kernels.rotary_
    return apply_rotary_
