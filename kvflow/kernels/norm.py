"""RMSNorm as the kernels take it: plain tensors (`NormWeights`) and its maths in torch (`rms_norm`).

The native linears apply the RMSNorm that feeds a projection in the same call (`norm=`, the
RMSNORM prologue of csrc/linear_ops.h); their torch paths, and the model's own RMSNorm module
(kvflow.layers.norm), run `rms_norm`, so every path computes the norm the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class NormWeights(NamedTuple):
    """An RMSNorm's weight and eps, as a kernel's `norm=` argument."""

    weight: torch.Tensor  # in the model's dtype: what `rms_norm` multiplies by
    float_weight: torch.Tensor  # the same values in float32: what native code reads
    eps: float


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 as HF does, whatever x's dtype."""
    if x.dtype == torch.float32:
        # The same float32 operations as below in fewer calls (x*x == x.pow(2) bit for bit;
        # w * (x * r) == (x * r) * w): 5 ops instead of 8 on the per-token decode path.
        r = (x * x).mean(-1, keepdim=True).add_(eps).rsqrt_()
        return torch.mul(x, r).mul_(weight)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm_of(x: torch.Tensor, mean_square: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` of x [rows, n] given each row's mean square [rows, 1] (float32), which may span
    more than x: a norm over a whole projection of which x is one tensor-parallel rank's slice
    (and `weight` that slice of the norm's weight)."""
    r = torch.rsqrt(mean_square + eps)
    if x.dtype == torch.float32:
        return torch.mul(x, r).mul_(weight)
    return weight * (x.float() * r).to(x.dtype)
