"""RMSNorm, computed in float32 as HF does, whatever the model dtype."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self._float_weight: torch.Tensor | None = None  # (see float_weight)

    def float_weight(self) -> torch.Tensor:
        """The weight in float32, as the native kernels read it (for other dtypes a copy, made once:
        native kernels only run on prepared models, whose weights no longer change)."""
        if self.weight.dtype == torch.float32:
            return self.weight
        if self._float_weight is None:
            self._float_weight = self.weight.detach().float()
        return self._float_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # The same float32 operations as below in fewer calls (x*x == x.pow(2) bit for bit;
            # w * (x * r) == (x * r) * w): 5 ops instead of 8 on the per-token decode path.
            r = (x * x).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
            return torch.mul(x, r).mul_(self.weight)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
