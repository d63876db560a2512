"""Linear projections. Every projection of the model (and the lm_head) goes through a
`LinearKernel`, chosen once at load time, so a faster or quantized kernel is swapped in at one place.

Backends (`LINEAR_BACKENDS`):

* ``dense``  -- `F.linear` (MKL sgemm on CPU). Any device, any dtype. The reference path.
* ``onednn`` -- fp32 on CPU through oneDNN, the weight reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight` + `torch.ops.mkldnn._linear_pointwise`), and MKL for
  1-2 rows, where it is faster (see `OneDNNKernel`). Same maths as `dense` up to float32 summation
  order (~1e-6 relative).
* ``int8``   -- W8A8 through FBGEMM: weights int8 with one scale per output channel, packed once;
  activations quantized per token on the fly (see `Int8Kernel` in kvflow.kernels.cpu.int8_linear);
  int32 accumulation, float output. CPU only.

`select_linear_backend` picks one from (device, dtype, quantization); the environment variable
`KVFLOW_LINEAR_BACKEND=dense|onednn` overrides the unquantized choice (benchmarks, debugging).
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu.int8_linear import Int8Kernel

LINEAR_BACKENDS = ("dense", "onednn", "int8")

# Batch size oneDNN's weight layout is chosen for (measured: 8 and 32 are equally good, 1-1024).
ONEDNN_BATCH_HINT = 32


class LinearKernel(Protocol):
    """y = x @ W.T + b (+ residual) for x [..., in_features] -> [..., out_features], in x's dtype.

    `residual` (same shape as y) is added in the same call where the backend can fuse it."""

    backend: str
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) the kernel reads per call."""
        ...


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def select_linear_backend(device: torch.device, dtype: torch.dtype, quantization: str | None) -> str:
    if quantization == "int8":
        if device.type != "cpu":
            raise ValueError(f"quantization='int8' runs on FBGEMM, a CPU library; device is {device.type!r}")
        if not int8_available():
            raise ValueError("quantization='int8' needs a torch build with FBGEMM (x86-64 CPU)")
        return "int8"
    if quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}")
    override = os.environ.get("KVFLOW_LINEAR_BACKEND")
    if override:
        if override not in ("dense", "onednn"):
            raise ValueError(f"KVFLOW_LINEAR_BACKEND must be 'dense' or 'onednn', got {override!r}")
        if override == "onednn" and not (device.type == "cpu" and dtype == torch.float32 and onednn_available()):
            raise ValueError("KVFLOW_LINEAR_BACKEND=onednn needs device='cpu', dtype='float32' and oneDNN")
        return override
    if device.type == "cpu" and dtype == torch.float32 and onednn_available():
        return "onednn"
    return "dense"


class DenseKernel:
    backend = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight) + _nbytes(self.bias)


class OneDNNKernel:
    """fp32 through the faster of MKL and oneDNN for the batch: measured on this CPU, MKL's sgemv is
    1.5-3x faster than oneDNN at 1-2 rows for the attention and down projections (equal for
    gate_up, a little slower for the lm_head), oneDNN 1.2-2x faster from 4 rows up. So the kernel
    keeps the dense weight for rows <= SMALL_BATCH and a oneDNN-reordered copy for the rest (twice
    the fp32 weight memory). Inputs and outputs stay ordinary dense tensors."""

    backend = "onednn"
    SMALL_BATCH = 2

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("the onednn linear backend takes float32 CPU weights")
        self.out_features, self.in_features = weight.shape
        self.dense = weight.detach().contiguous()
        reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
        self.weight = reorder(self.dense, ONEDNN_BATCH_HINT) if reorder is not None else self.dense.to_mkldnn()
        self.bias = None if bias is None else bias.detach().contiguous().clone()
        self._op = torch.ops.mkldnn._linear_pointwise

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.SMALL_BATCH:
            if residual is not None and self.bias is None:
                return torch.addmm(residual, x, self.dense.t())
            y = F.linear(x, self.dense, self.bias)
            return y if residual is None else residual + y
        if residual is None:
            return self._op(x, self.weight, self.bias, "none", [], "")
        return self._op.binary(x, residual, self.weight, self.bias, "add")

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 4 + _nbytes(self.bias)


_KERNELS = {"dense": DenseKernel, "onednn": OneDNNKernel, "int8": Int8Kernel}


def make_linear_kernel(backend: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearKernel:
    """A kernel computing x @ weight.T + bias. `dense` keeps a reference to `weight`; the others copy
    it into their own layout (the caller may then free the original)."""
    try:
        cls = _KERNELS[backend]
    except KeyError:
        raise ValueError(f"unknown linear backend {backend!r}; choose from {LINEAR_BACKENDS}") from None
    return cls(weight, bias)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


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

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
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

    def prepare(self, backend: str) -> None:
        if self.kernel.backend == backend:
            return
        if self.weight is None:
            raise RuntimeError(f"Linear already prepared for {self.kernel.backend!r}; cannot switch to {backend!r}")
        bias = None if self.bias is None else self.bias.data
        self.kernel = make_linear_kernel(backend, self.weight.data, bias)
        if backend != "dense":
            self.weight = None
            self.bias = None

    @property
    def backend(self) -> str:
        return self.kernel.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"
