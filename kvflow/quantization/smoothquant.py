"""SmoothQuant-style activation smoothing for the int8 linear backends (int8 weights, activations
quantized per token on the fly).

Some input channels of some projections carry activations far larger than the rest (the input of
the last layers' down_proj reaches ~470 where the median is ~40 on SmolLM2-135M). A per-tensor
activation scale then flattens every other channel to a few levels. Smoothing divides input
channel j by s_j and multiplies weight column j by s_j (exact in real arithmetic), with
s_j = amax|X_j|^alpha / amax|W_j|^(1 - alpha), moving part of the range into the weights, which
are quantized per output channel. The division is folded into the op that produces X (an RMSNorm
weight, the up half of gate_up, the v rows of qkv: `LlamaForCausalLM.apply_smoothing`), so it
costs nothing at run time.
"""

from __future__ import annotations

import torch

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
