"""The linear over block-quantized weights on the CPU: `BlockQuantKernel`, csrc/block_linear.cpp's
integer dot products over GGUF's blocks as stored (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) with activations
quantized per 32 values to int8, the norm / activation that feeds the projection and the residual
in the same call. The ``gguf`` and ``int4`` backends of kvflow.layers.linear_kernels.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref

import torch

from kvflow.kernels.cpu import native
from kvflow.kernels.norm import NormWeights, rms_norm
from kvflow.quantization.gguf_blocks import BlockQuantized, quantize

logger = logging.getLogger(__name__)

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "kvflow_block_pack": ([_I, _I, _I, _P, _P, _P, _P], _P),
    "kvflow_block_free": ([_P], None),
    "kvflow_block_linear": ([_P, _P, _L, _I, _I, _P, _F, _P, _P, _L, _P, _I], None),
    "kvflow_block_repacked": ([_P, _I], _I),
    "kvflow_block_nbytes": ([_P], _L),
    "kvflow_block_rows": ([_P, _P, _I, _P], None),
    "kvflow_block_tile_rows": ([_P], _I),
    "kvflow_block_amx": ([_I], _I),
}


def block_library(name: str = "linear") -> ctypes.CDLL | None:
    """The native library of the block kernels: the one the engine runs ("linear"), or the test build
    that emulates the AMX-INT8 instructions ("block_amx_emulated", native.LIBRARIES)."""
    return native.load(name, _SIGNATURES)


def block_amx(lib: ctypes.CDLL | None = None, enable: bool | None = None) -> bool:
    """Whether `lib`'s block kernels (the engine's by default) run calls of 8 rows and more on AMX-INT8
    tiles here; `enable` first turns that path on or off (tests and benchmarks compare the two)."""
    lib = lib or block_library()
    return lib is not None and bool(lib.kvflow_block_amx(-1 if enable is None else int(enable)))


@functools.cache
def block_kernels_unavailable() -> str | None:
    """Why the block kernels cannot run here (no compiler, no AVX2), or None."""
    lib = block_library()
    if lib is None:
        return "the native linear library could not be built (see the log)"
    probe = quantize(torch.ones(4, 32), "Q8_0")
    handle = _pack(lib, [probe], 4, 32)
    if handle is None:
        return "this CPU lacks the AVX2 / F16C / FMA instructions the block kernels use"
    lib.kvflow_block_free(handle)
    return None


@functools.cache
def _amx_checked(lib: ctypes.CDLL) -> None:
    """Once per process and library: where the block kernels run on AMX-INT8 tiles, 24 rows through
    the tiles (a block of 16 and one of 8) must give the vector tiles' bits (they are built to);
    where they do not, the vector tiles run from here on, and the log says so, rather than a CPU's
    tiles giving other tokens."""
    if not block_amx(lib):
        return
    g = torch.Generator().manual_seed(0)
    weight = quantize(torch.randn(32, 64, generator=g), "Q4_1")
    handle = _pack(lib, [weight], 32, 64)
    x = torch.randn(24, 64, generator=g)
    outs = []
    for on in (True, False):
        block_amx(lib, enable=on)
        outs.append(native.call_linear(lib.kvflow_block_linear, handle, x, None, None, False, None, 32))
    lib.kvflow_block_free(handle)
    if torch.equal(*outs):
        block_amx(lib, enable=True)
    else:
        logger.warning("the block kernels' AMX-INT8 tiles disagree with their vector tiles here: tiles off")


def _pack(lib: ctypes.CDLL, parts: list[BlockQuantized], n: int, k: int) -> int | None:
    count = len(parts)
    types = (ctypes.c_int * count)(*(p.format.ggml_type for p in parts))
    rows = (ctypes.c_int * count)(*(p.shape[0] for p in parts))
    row_bytes = (ctypes.c_long * count)(*(p.data.shape[1] for p in parts))
    data = (ctypes.c_void_p * count)(*(p.data.data_ptr() for p in parts))
    return lib.kvflow_block_pack(n, k, count, types, rows, row_bytes, data)


class BlockQuantKernel:
    """y = residual + W . pre(x) + bias with W kept in block formats: `parts` are consecutive runs of
    output channels (a fused projection keeps each part's own format), all over the same inputs.

    Takes `norm=` / `silu_mul=` as the other native kernels do, so the per-layer path and the fused
    decode pass (kvflow.models.decode_pass) run the same code on a token."""

    backend = "gguf"

    def __init__(
        self, parts: list[BlockQuantized], bias: torch.Tensor | None = None, *, lib: ctypes.CDLL | None = None
    ) -> None:
        """`lib`: another build of the block kernels to call (benchmarks/block_linear_ab.py, the AMX
        test); the engine's by default."""
        reason = None if lib is not None else block_kernels_unavailable()
        if reason is not None:
            raise RuntimeError(f"block-quantized weights cannot run natively here: {reason}")
        widths = {p.shape[1] for p in parts}
        if len(widths) != 1:
            raise ValueError(f"the parts of a block-quantized projection must share their inputs, got {sorted(widths)}")
        parts = [p.with_rows(p.data.contiguous()) for p in parts]
        self.in_features = widths.pop()
        self.out_features = sum(p.shape[0] for p in parts)
        self.formats = [p.format.name for p in parts]
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        self._lib = lib or block_library()
        _amx_checked(self._lib)
        handle = _pack(self._lib, parts, self.out_features, self.in_features)
        if handle is None:
            raise ValueError(f"no block kernel for {self.formats} over {self.in_features} inputs")
        self.native_handle = handle
        weakref.finalize(self, self._lib.kvflow_block_free, handle)
        # Parts the kernel repacked into its own copy are dropped; the others it reads in place.
        self._kept = [None if self._lib.kvflow_block_repacked(handle, i) else p for i, p in enumerate(parts)]
        # (the kernel's count: a repacked Q4_K holds 1,184 bytes per 8 channels x 256 inputs, GGUF 1,152)
        self._nbytes = self._lib.kvflow_block_nbytes(handle)
        # Rows one pass over the weight computes together: a call of more reads it again per tile.
        self.tile_rows = self._lib.kvflow_block_tile_rows(handle)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 output channels `ids` of W, [*ids.shape, in_features] (an embedding lookup: the
        kernel holds the embedding's only copy)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.in_features)
        self._lib.kvflow_block_rows(self.native_handle, flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.view(*ids.shape, self.in_features)

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        norm: NormWeights | None = None,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        return native.fused_linear(
            self, self._lib.kvflow_block_linear, x, residual, norm, silu_mul, "block-quantized linear"
        )

    def dequantized_weight(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    @property
    def nbytes(self) -> int:
        return self._nbytes + (0 if self.bias is None else self.bias.numel() * 4)


class GroupedInputKernel:
    """A block kernel with what its blocks cannot hold of a group-wise 4/8-bit format:

    * `perm` -- inputs permuted, y = W' x[:, perm] (GPTQ's act-order: the checkpoint's columns were
      permuted at load so each quantization group is contiguous);
    * `offsets` -- float32 [out, groups] added per group of `group` (contiguous) inputs,
      y += offsets . (sums of x over each group): an asymmetric format's zero point,
      w = s * (q - z) = s * (q - 8) + s * (8 - z), with the first term in Q4_0 blocks and
      offsets = s * (8 - z) (exact in float32), so groups of 64 / 128 hold 4.5 + 32 / group bits a
      weight instead of Q4_1's 5 (see kvflow.quantization.packed_weights). The group sums are of
      the float inputs (not the kernel's int8-rounded ones).

    Both need the projection's input, so the norm / activation that feeds it runs here in torch
    first, and the fused decode pass leaves such a projection out (it has no `native` kernel)."""

    backend = "gguf"

    def __init__(
        self,
        inner: BlockQuantKernel,
        perm: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        group: int = 0,
    ) -> None:
        n = inner.in_features
        if perm is not None and perm.shape != (n,):
            raise ValueError(f"a permutation of {n} inputs, got {tuple(perm.shape)}")
        if offsets is not None and (group <= 0 or n % group or offsets.shape != (inner.out_features, n // group)):
            raise ValueError(
                f"offsets of {inner.out_features} x {n} // group ({group}) expected, got {tuple(offsets.shape)}"
            )
        self.inner = inner
        self.perm = None if perm is None else perm.to(torch.int64).contiguous()
        self.offsets = None if offsets is None else offsets.float().contiguous()
        self.group = group
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.bias = inner.bias

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        norm: NormWeights | None = None,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        if norm is not None:
            x = rms_norm(x, norm.weight, norm.eps)
        if silu_mul:
            gate, up = x.chunk(2, dim=-1)
            x = torch.nn.functional.silu(gate) * up
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        x = x.contiguous()
        if self.offsets is None:
            return self.inner(x, residual)
        sums = x.float().unflatten(-1, (-1, self.group)).sum(-1)
        y = sums @ self.offsets.t()
        return self.inner(x, y if residual is None else y + residual)

    def dequantized_weight(self) -> torch.Tensor:
        w = self.inner.dequantized_weight()
        if self.offsets is not None:
            w = w + self.offsets.repeat_interleave(self.group, dim=1)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    @property
    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.perm, self.offsets) if t is not None)
        return self.inner.nbytes + extra
