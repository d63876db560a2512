"""Symmetric int8 quantization, shared by the int8 linear kernels (kvflow.kernels.cpu.int8_linear,
kvflow.kernels.int_mm) and the int8 KV cache (the attention backends' cache write).

Weights: one scale per output channel (row), q = round(w / s), s = max|row| / 127.
KV cache: one scale per (token, kv head), the same rule over the head_dim values.
Rounding is to nearest, so |dequant(q) - x| <= s / 2 element-wise.
"""

from __future__ import annotations

import torch

# Scales never go below this, so an all-zero row/vector quantizes to zeros instead of NaN.
_MIN_SCALE = 1e-12


def quantize_symmetric(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float32 scales, one scale per slice along `dim` (amax reduced over it).

    Returns (q [same shape as x, int8], scale [x.shape without `dim`, float32]).
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=dim, keepdim=True) / 127.0).clamp_min_(_MIN_SCALE)
    q = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.squeeze(dim)


def dequantize_symmetric(
    q: torch.Tensor, scale: torch.Tensor, dim: int = -1, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype).unsqueeze(dim)


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in], scale [out]) with one scale per output channel."""
    return quantize_symmetric(weight, dim=1)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 [..., head_dim], scale [...] float32), one scale per vector.

    Same rule as `quantize_symmetric` in fewer ops (this runs per layer per step): no clamp, as
    |x| / (max|x| / 127) <= 127 (+ rounding) already."""
    scale = x.abs().amax(-1).float().mul_(1 / 127).clamp_min_(_MIN_SCALE)
    q = torch.round(x / scale.unsqueeze(-1)).to(torch.int8)
    return q, scale
