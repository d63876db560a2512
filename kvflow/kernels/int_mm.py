"""W8A8 through `torch._int_mm`: the int8 linear of devices other than the x86 CPU FBGEMM serves
(on CUDA, cuBLASLt's int8 GEMM with int32 accumulation; torch's own CPU implementation runs the
same maths, which is how it is tested without a GPU).

Weights int8 with one scale per output channel (`quantize_weight_per_channel`, as the CPU int8
path), activations quantized per token on the fly (round(127 x / max|x|)), y = (x_q @ W_q^T) *
x_scale * w_scale + bias. cuBLASLt wants more than 16 rows and both feature counts a multiple of 8:
fewer rows are padded with zero rows (a decode step), and a projection whose features are not a
multiple of 8 keeps float weights (`IntMMKernel.supports`).
"""

from __future__ import annotations

import torch

from kvflow.quantization.int8 import quantize_weight_per_channel

_MIN_ROWS = 32  # > 16 (cuBLASLt's int8 minimum), a multiple of 8


class IntMMKernel:
    backend = "int8_mm"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        if not self.supports(weight):
            raise ValueError(
                f"int8 through torch._int_mm needs features that are multiples of 8, got "
                f"{self.in_features} -> {self.out_features}"
            )
        q, scale = quantize_weight_per_channel(weight.detach().float())
        self.weight_t = q.t()  # [in, out], a column-major view of the row-major int8 weight
        self.scale = scale.float().flatten()
        self.bias = None if bias is None else bias.detach().float().clone()
        self.pad_rows = weight.device.type == "cuda"

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return weight.shape[0] % 8 == 0 and weight.shape[1] % 8 == 0

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        x_scale = x2.abs().amax(-1, keepdim=True).clamp_min_(1e-8).div_(127)
        xq = torch.round(x2 / x_scale).to(torch.int8)
        m = xq.shape[0]
        if self.pad_rows and m < _MIN_ROWS:
            xq = torch.cat((xq, xq.new_zeros(_MIN_ROWS - m, self.in_features)))
        y = torch._int_mm(xq, self.weight_t)[:m].float().mul_(x_scale).mul_(self.scale)
        if self.bias is not None:
            y += self.bias
        y = y.to(x.dtype).view(*lead, self.out_features)
        return y if residual is None else y.add_(residual)

    @property
    def nbytes(self) -> int:
        return self.weight_t.numel() + 4 * self.scale.numel() + (0 if self.bias is None else 4 * self.bias.numel())
