"""Symmetric int8 quantization helpers shared by the int8 linear backend and the int8 KV cache.

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


def dequantize_symmetric(q: torch.Tensor, scale: torch.Tensor, dim: int = -1,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(dtype) * scale.to(dtype).unsqueeze(dim))


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


# ---- SmoothQuant-style activation smoothing (int8 weights + dynamically quantized activations) ----
#
# Some input channels of some projections carry activations far larger than the rest (the input of
# the last layers' down_proj reaches ~470 where the median is ~40 on SmolLM2-135M). A per-tensor
# activation scale then flattens every other channel to a few levels. Smoothing divides input
# channel j by s_j and multiplies weight column j by s_j (exact in real arithmetic), with
# s_j = amax|X_j|^alpha / amax|W_j|^(1 - alpha), moving part of the range into the weights, which
# are quantized per output channel. The division is folded into the op that produces X (an RMSNorm
# weight, the up half of gate_up, the v rows of qkv), so it costs nothing at run time.

SMOOTH_ALPHA = 0.5

# Fixed English calibration text (not the text benchmarks/quality.py scores). Only per-channel
# activation maxima are taken from it, in one forward pass at load time.
CALIBRATION_TEXT = (
    "The history of science is the study of the development of science and scientific knowledge, including "
    "both the natural and social sciences. Science is a body of empirical, theoretical, and practical knowledge "
    "about the natural world, produced by scientists who emphasize the observation, explanation, and prediction "
    "of real-world phenomena.\n\nOnce upon a time, in a small village by the sea, there lived an old fisherman who "
    "told stories to the children every evening. He spoke of storms and whales, of islands that appeared only at "
    "dawn, and of a lighthouse whose keeper had never been seen.\n\nTo make a simple bread, mix flour, water, salt "
    "and yeast, knead the dough for ten minutes, let it rise for an hour, shape it, and bake it in a hot oven until "
    "the crust is golden brown.\n\nQ: What is the capital of Japan?\nA: Tokyo is the capital of Japan. It is one of "
    "the largest cities in the world.\n\ndef mean(values):\n    return sum(values) / len(values)\n"
)


def smoothing_scales(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """Per input channel s (shape [in]): quantize (X / s) and (W * s) instead of X and W."""
    w_amax = weight.abs().amax(dim=0).float().clamp_min(1e-5)
    s = act_amax.float().clamp_min(1e-5).pow(alpha) / w_amax.pow(1 - alpha)
    return s.clamp_min(1e-5)
