"""RMSNorm, computed in float32 as HF does, whatever the model dtype (kvflow.kernels.norm.rms_norm);
Gemma's offset RMSNorm; Cohere's LayerNorm without a bias."""

from __future__ import annotations

import torch

from kvflow.kernels.norm import NormWeights, rms_norm


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self._float_weight: torch.Tensor | None = None  # (see float_weight)
        self._kernel_args: NormWeights | None = None
        self._offset_version = -1  # (OffsetRMSNorm: the weight version its float weight was made from)

    def float_weight(self) -> torch.Tensor:
        """The weight in float32, as the native kernels read it (for other dtypes a copy, made once:
        native kernels only run on prepared models, whose weights no longer change)."""
        if self.weight.dtype == torch.float32:
            return self.weight
        if self._float_weight is None:
            self._float_weight = self.weight.detach().float()
        return self._float_weight

    def kernel_args(self) -> NormWeights:
        """This norm as a linear kernel's `norm=` argument (made once, as `float_weight`)."""
        if self._kernel_args is None:
            self._kernel_args = NormWeights(self.weight, self.float_weight(), self.eps)
        return self._kernel_args

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, rounded to x's dtype
    at the end (HF Gemma2RMSNorm / Gemma3RMSNorm; checkpoints store w, zero-centred). The native
    kernels' fused norm multiplies by `float_weight()`, here 1 + w."""

    def float_weight(self) -> torch.Tensor:
        # Recomputed when the weight changes (loading writes it in place after construction).
        version = self.weight._version
        if self._float_weight is None or self._offset_version != version:
            self._float_weight = 1.0 + self.weight.detach().float()
            self._offset_version = version
            self._kernel_args = None
        return self._float_weight

    def kernel_args(self) -> NormWeights:
        w = self.float_weight()
        if self._kernel_args is None:
            self._kernel_args = NormWeights(w, w, self.eps)
        return self._kernel_args

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.float_weight()
        if x.dtype == torch.float32:
            return rms_norm(x, w, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)


class LayerNorm(torch.nn.Module):
    """LayerNorm without a bias, in float32 as HF's CohereLayerNorm: (x - mean) * rsqrt(var + eps) *
    w, rounded to x's dtype at the end. (No native kernel fuses it: its models run it in torch.)"""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        centred = h - mean
        h = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)
