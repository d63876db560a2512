"""Which kernel runs a linear projection: the linear backends, the float paths among which the
``auto`` backend chooses per shape and row count, and that choice (`KernelPlan`, measured by
kvflow.worker.autotune -- which imports this module, not the reverse -- or `default_choice`).

Every projection of the model (and the lm_head) goes through a `LinearKernel`, chosen once at
load time (kvflow.layers.linear.Linear.prepare), so a faster or quantized kernel is swapped in at
one place. Backends (`LINEAR_BACKENDS`):

* ``auto``   -- CPU float32 / bfloat16: per projection shape and row count, the path the
  `KernelPlan` names (`TunedKernel`): one of
* ``native`` -- fp32 / bf16 through the native register-tiled GEMM, norm / activation and
  residual in the same call (`NativeFloatKernel` in kvflow.kernels.cpu.float_linear); few rows.
* ``dense``  -- `F.linear` (MKL sgemm on CPU). Any device, any dtype. The reference path.
* ``onednn`` -- oneDNN, the weight reordered once into its blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight` + `torch.ops.mkldnn._linear_pointwise`).
* ``int8``   -- W8A8 through FBGEMM: weights int8 with one scale per output channel, packed once;
  activations quantized per token on the fly (see `Int8Kernel` in kvflow.kernels.cpu.int8_linear);
  int32 accumulation, float output. CPU only.
* ``int8_mm`` -- the same W8A8 maths through `torch._int_mm` (cuBLASLt on CUDA: ``quantization="int8"``
  there; `IntMMKernel` in kvflow.kernels.int_mm); projections whose features are not multiples of 8
  stay ``dense``.
* ``gguf``   -- weights in GGUF block formats as the file stores them (Q8_0, Q4_0, Q4_1, Q4_K,
  Q6_K), integer dot products with activations quantized per 32 values (`BlockQuantKernel` in
  kvflow.kernels.cpu.block_linear); a float tensor among them takes the ``auto`` default. CPU only.
* ``int4``   -- float weights rounded at load into the same kernel's 4-bit blocks (`INT4_FORMAT`;
  the logits projection into Q8_0).

The float paths compute the same maths up to float32 summation order (~1e-6 relative).
`select_linear_backend` picks one from (device, dtype, quantization); the environment variable
`KVFLOW_LINEAR_BACKEND=dense|onednn|native` forces one path for every call (benchmarks, debugging).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu.block_linear import BlockQuantKernel, GroupedInputKernel, block_kernels_unavailable
from kvflow.kernels.cpu.float_linear import WEIGHT_TYPES, NativeFloatKernel, float_library
from kvflow.kernels.cpu.int8_linear import Int8Kernel
from kvflow.kernels.int_mm import IntMMKernel
from kvflow.kernels.norm import NormWeights, rms_norm
from kvflow.quantization.gguf_blocks import BlockQuantized, quantize
from kvflow.quantization.packed_weights import Fp8Rows, GroupedBlocks, Int8Rows

LINEAR_BACKENDS = ("auto", "dense", "onednn", "native", "int8", "int8_mm", "gguf", "int4")
FORCED_PATHS = ("dense", "onednn", "native")
# Backends whose kernels take `norm=` / `silu_mul=` (the op feeding the projection, in the same call).
FUSED_PROLOGUE = ("auto", "native", "int8", "gguf", "int4")
# int4: 4 bits with a scale and an offset per 32 weights (GGML's Q4_1, 5 bits per weight in all);
# the logits projection, whose errors every token's distribution sees, in 8 bits (Q8_0).
INT4_FORMAT, INT4_LOGITS_FORMAT = "Q4_1", "Q8_0"

# Batch size oneDNN's weight layout is chosen for (8 and 32 did equally well from 1 to 1024 rows).
ONEDNN_BATCH_HINT = 32

# The float paths of the ``auto`` backend, and the row counts a choice is made for: a call with m
# rows runs the choice of the first bucket >= m (the last bucket's beyond it).
PATHS = ("native", "dense", "onednn")
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

Shape = tuple[int, int]  # (out_features, in_features)


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


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def native_available(dtype: torch.dtype) -> bool:
    return dtype in WEIGHT_TYPES and float_library() is not None


@functools.cache
def onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN's blocked-weight linear for `dtype` on this CPU (bf16 needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT; probed by reordering a small weight, as the check lives inside oneDNN)."""
    if (
        dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def candidates(dtype: torch.dtype) -> list[str]:
    return [
        p
        for p in PATHS
        if p == "dense" or (p == "native" and native_available(dtype)) or (p == "onednn" and onednn_available(dtype))
    ]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_choice(dtype: str) -> dict[int, str]:
    """The choice where nothing was measured (`--kernel-autotune off`, or no plan): the native GEMV
    up to 4 rows (where it builds), oneDNN's blocked layout from 8 (where it runs for the dtype),
    else `F.linear`. A fixed rule, not a measurement, near what the autotune chooses for the
    default model's shapes on the CPUs it was run on (docs/benchmarks/results/)."""
    paths = candidates(getattr(torch, dtype))
    small = "native" if "native" in paths else "dense"
    large = "onednn" if "onednn" in paths else "dense"
    return {b: small if b <= 4 else large for b in ROW_BUCKETS}


@dataclass
class KernelPlan:
    """The chosen path per (shape, row bucket), and the decode pass's row limit (0: never): what the
    autotune measured (kvflow.worker.autotune.plan_kernels), or its documented default."""

    dtype: str
    choices: dict[Shape, dict[int, str]]
    decode_pass_rows: int
    source: str  # "measured" (this start), "cache" (an earlier start), "default" (autotune off)
    pass_shapes: tuple[Shape, ...] = ()  # one decoder layer's projections: what the decode pass runs
    seconds: float = 0.0  # spent measuring at this start
    # decode_pass_rows is only the bound to time the pass up to (the autotune's measure_pass_rows),
    # not yet a limit
    pass_unmeasured: bool = False
    weights_cold: bool = False  # timed with the weights evicted from the last-level cache (plan_kernels)

    def choice(self, shape: Shape) -> dict[int, str]:
        return self.choices.get(shape) or default_choice(self.dtype)

    def describe(self) -> str:
        """One line per shape: row ranges and their path; then the decode pass."""
        lines = []
        for (n, k), by_rows in sorted(self.choices.items()):
            spans: list[list] = []  # [first bucket, last bucket, path]
            for b, path in by_rows.items():
                if spans and spans[-1][2] == path:
                    spans[-1][1] = b
                else:
                    spans.append([b, b, path])
            text = ", ".join(f"{lo}{'' if lo == hi else f'-{hi}'} {path}" for lo, hi, path in spans)
            lines.append(f"{n}x{k}: {text}")
        rows = self.decode_pass_rows
        lines.append(
            f"decode pass: {'off' if not rows else f'timed on the model up to {rows} rows' if self.pass_unmeasured else f'up to {rows} rows'}"
        )
        took = f" in {self.seconds:.1f} s" if self.source == "measured" else ""
        return f"linear kernels ({self.source}{took}, {self.dtype}): " + "; ".join(lines)


def select_linear_backend(
    device: torch.device, dtype: torch.dtype, quantization: str | None, block_weights: bool = False
) -> str:
    """`block_weights`: the checkpoint's tensors came quantized (GGUF blocks, GPTQ / AWQ /
    compressed-tensors), kept as stored."""
    if block_weights and quantization is not None:
        raise ValueError(
            f"quantization={quantization!r} re-quantizes float weights; this checkpoint's weights are already "
            "quantized (leave --quantization unset)"
        )
    if block_weights or quantization == "int4":
        name = (
            "quantized weights kept as stored (GGUF blocks, GPTQ, AWQ, compressed-tensors)"
            if block_weights
            else "quantization='int4'"
        )
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"{name} run on the CPU block kernels in float32; got {device.type}, {dtype}")
        reason = block_kernels_unavailable()
        if reason is not None:
            raise ValueError(f"{name} cannot run here: {reason}")
        return "gguf" if block_weights else "int4"
    if quantization == "int8":
        if device.type == "cuda":
            return "int8_mm"
        if device.type != "cpu":
            raise ValueError(f"quantization='int8' runs on the CPU (FBGEMM) or CUDA; device is {device.type!r}")
        if not int8_available():
            raise ValueError("quantization='int8' needs a torch build with FBGEMM (x86-64 CPU)")
        return "int8"
    if quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}")
    override = os.environ.get("KVFLOW_LINEAR_BACKEND")
    if override:
        if override not in FORCED_PATHS:
            raise ValueError(f"KVFLOW_LINEAR_BACKEND must be one of {FORCED_PATHS}, got {override!r}")
        if override != "dense" and not (device.type == "cpu" and override in candidates(dtype)):
            raise ValueError(
                f"KVFLOW_LINEAR_BACKEND={override} cannot run here ({device.type}, {dtype}); "
                f"available: {', '.join(candidates(dtype)) if device.type == 'cpu' else 'dense'}"
            )
        return override
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return "auto"
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
    """oneDNN's matmul with the weight reordered once into its blocked layout (float32 or bfloat16,
    CPU). Inputs and outputs stay ordinary dense tensors."""

    backend = "onednn"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
            raise ValueError("the onednn linear backend takes float32 or bfloat16 CPU weights")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
        w = weight.detach().contiguous()
        self.weight = reorder(w, ONEDNN_BATCH_HINT) if reorder is not None else w.to_mkldnn()
        self.bias = None if bias is None else bias.detach().contiguous().clone()
        self._op = torch.ops.mkldnn._linear_pointwise

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return self._op(x, self.weight, self.bias, "none", [], "")
        return self._op.binary(x, residual, self.weight, self.bias, "add")

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize + _nbytes(self.bias)


class TunedKernel:
    """The ``auto`` backend: each call runs the path `choice` names for its row count (row bucket
    -> path, from a `KernelPlan`; a call with m rows takes the first bucket >= m, the last bucket
    beyond). Only the paths the choice uses are built, so a shape that one path wins everywhere
    holds one copy of its weight. Takes `norm=` / `silu_mul=` as the native kernel does, applying
    them in torch for the other paths."""

    backend = "auto"

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, choice: dict[int, str], with_native: bool = False
    ) -> None:
        """`with_native`: build the native path even where `choice` does not use it (the fused
        decode pass runs it on this projection: one more, packed, copy of the weight)."""
        self.out_features, self.in_features = weight.shape
        paths = [*choice.values(), *(["native"] if with_native else [])]
        self.paths: dict[str, LinearKernel] = {p: make_path_kernel(p, weight, bias) for p in dict.fromkeys(paths)}
        buckets = sorted(choice)
        self._max_rows = buckets[-1]
        # rows (1..max bucket) -> kernel; index 0 unused
        self._by_rows: list[LinearKernel] = [self.paths[choice[buckets[-1]]]]
        for m in range(1, self._max_rows + 1):
            self._by_rows.append(self.paths[choice[next(b for b in buckets if b >= m)]])
        self.native: NativeFloatKernel | None = next(
            (k for k in self.paths.values() if isinstance(k, NativeFloatKernel)), None
        )
        self.bias = bias

    def kernel_for(self, rows: int) -> LinearKernel:
        return self._by_rows[min(rows, self._max_rows)]

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        norm: NormWeights | None = None,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        kernel = self.kernel_for(x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1])
        if kernel is self.native:
            return kernel(x, residual, norm=norm, silu_mul=silu_mul)
        if norm is not None:
            x = rms_norm(x, norm.weight, norm.eps)
        if silu_mul:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        return kernel(x, residual)

    @property
    def nbytes(self) -> int:
        """Bytes one call reads (one path's weight), not the memory every path holds."""
        return max(k.nbytes for k in self.paths.values())


_PATHS = {"dense": DenseKernel, "onednn": OneDNNKernel, "native": NativeFloatKernel}


def make_path_kernel(path: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearKernel:
    """One float path (`FORCED_PATHS`) over `weight`."""
    return _PATHS[path](weight, bias)


def make_linear_kernel(
    backend: str,
    weight: torch.Tensor | BlockQuantized | list[BlockQuantized] | Int8Rows | GroupedBlocks | Fp8Rows,
    bias: torch.Tensor | None = None,
    plan: KernelPlan | None = None,
    logits: bool = False,
) -> LinearKernel:
    """A kernel computing x @ weight.T + bias. `dense` keeps a reference to `weight`; the others
    copy it into their own layout (the caller may then free the original). `auto` takes the choice
    for this shape from `plan` (None: `default_choice`), with the native path
    as well on the projections the plan's decode pass runs. `weight` in block formats (one part,
    or a fused projection's parts) needs `gguf`; `logits`: the logits projection (int4 keeps it in
    8 bits). A quantized checkpoint's `Int8Rows` (W8A8), `GroupedBlocks` (act-order, group offsets)
    and `Fp8Rows` (FP8, on the native float kernel) need `gguf` too (the backend of weights kept as
    stored)."""
    if isinstance(weight, (Int8Rows, GroupedBlocks, Fp8Rows)):  # a quantized checkpoint's weights, as stored
        if backend != "gguf":
            raise ValueError(f"a quantized checkpoint's weights run on the gguf backend, not {backend!r}")
        if isinstance(weight, Int8Rows):
            return Int8Kernel(None, bias, quantized=(weight.q, weight.scale))
        if isinstance(weight, Fp8Rows):
            return NativeFloatKernel(weight.q, bias, scale=weight.scale, activations=weight.activations)
        return GroupedInputKernel(BlockQuantKernel(weight.parts, bias), weight.perm, weight.offsets, weight.group)
    if isinstance(weight, BlockQuantized):
        weight = [weight]
    if isinstance(weight, list):
        if backend != "gguf":
            raise ValueError(f"block-quantized weights run on the gguf backend, not {backend!r}")
        return BlockQuantKernel(weight, bias)
    if backend == "gguf":  # a float tensor among a GGUF's block ones
        backend = "auto"
    if backend == "int4":
        return BlockQuantKernel([quantize(weight, INT4_LOGITS_FORMAT if logits else INT4_FORMAT)], bias)
    if backend == "auto":
        shape = tuple(weight.shape)
        if plan is None:
            return TunedKernel(weight, bias, default_choice(dtype_name(weight.dtype)))
        return TunedKernel(
            weight, bias, plan.choice(shape), with_native=plan.decode_pass_rows > 0 and shape in plan.pass_shapes
        )
    if backend == "int8":
        return Int8Kernel(weight, bias)
    if backend == "int8_mm":
        return IntMMKernel(weight, bias) if IntMMKernel.supports(weight) else DenseKernel(weight, bias)
    if backend not in _PATHS:
        raise ValueError(f"unknown linear backend {backend!r}; choose from {LINEAR_BACKENDS}")
    return make_path_kernel(backend, weight, bias)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
