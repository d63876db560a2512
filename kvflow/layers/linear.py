"""`Linear`, the projection module of the models: it holds the checkpoint's weight until
`prepare` hands it to the kernel its backend names (kvflow.layers.linear_kernels), then runs that
kernel; and `RowParallelKernel`, the wrapper tensor parallelism puts around a row-parallel one.
"""

from __future__ import annotations

import torch

from kvflow.layers.linear_kernels import DenseKernel, KernelPlan, LinearKernel, make_linear_kernel
from kvflow.quantization.gguf_blocks import BlockQuantized
from kvflow.quantization.packed_weights import Fp8Rows, GroupedBlocks, Int8Rows

# A weight kept as a quantized file stores it: GGUF blocks (a fused projection's parts), or a
# quantized HF checkpoint's int8 rows (W8A8) / blocks over permuted inputs (GPTQ act-order) / FP8 rows.
StoredWeight = list[BlockQuantized] | Int8Rows | GroupedBlocks | Fp8Rows


class RowParallelKernel:
    """A row-parallel projection (tensor parallelism): this rank multiplies its slice of the input
    features; the ranks' partial outputs are summed by one all-reduce. The residual is added by the
    first rank only, so the sum carries it once."""

    def __init__(self, kernel: LinearKernel, all_reduce, first: bool) -> None:
        self.inner, self.all_reduce, self.first = kernel, all_reduce, first
        self.backend = kernel.backend
        self.in_features, self.out_features = kernel.in_features, kernel.out_features

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.all_reduce(self.inner(x, residual if self.first else None, **kwargs))

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


class Linear(torch.nn.Module):
    """Holds the checkpoint weight until `prepare(backend)`; then runs the chosen kernel.

    After `prepare` with a backend other than `dense` the float weight is dropped (the kernel holds
    its own copy), so `weight` is None and the module no longer lists it as a parameter.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.kernel: LinearKernel = DenseKernel(self.weight, self.bias)
        self.blocks: StoredWeight | None = None  # the weight as a quantized file stores it (`load_blocks`)

    def load_blocks(self, parts: StoredWeight) -> None:
        """Take the weight in block formats (consecutive runs of output channels), or a quantized
        checkpoint's stored weight, instead of floats."""
        shapes = [p.shape for p in parts] if isinstance(parts, list) else [parts.shape]
        if sum(s[0] for s in shapes) != self.out_features or any(s[1] != self.in_features for s in shapes):
            raise ValueError(f"quantized weight of {shapes} for a Linear of {self.in_features} -> {self.out_features}")
        self.blocks = parts
        self.weight = None

    def prepare(self, backend: str, plan: KernelPlan | None = None, logits: bool = False) -> None:
        if self.kernel.backend == backend:
            return
        bias = None if self.bias is None else self.bias.data
        if self.blocks is not None:
            self.kernel, self.blocks = make_linear_kernel(backend, self.blocks, bias), None
        else:
            if self.weight is None:
                raise RuntimeError(f"Linear already prepared for {self.kernel.backend!r}; cannot switch to {backend!r}")
            self.kernel = make_linear_kernel(backend, self.weight.data, bias, plan, logits)
        if self.kernel.backend != "dense":
            self.weight = None
            self.bias = None

    @property
    def backend(self) -> str:
        return self.kernel.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"
