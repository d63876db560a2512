"""Binding of csrc/moe_experts.cpp: one Mixture-of-Experts layer's routed experts, on their native
float kernels (`NativeFloatKernel`, float32 or bfloat16 weights), for a step's rows in one call.

kvflow.layers.moe's `grouped_experts` makes the same per-expert calls from Python, one kernel call
(a parallel region of its own) per expert projection; here the pairs are grouped and every
expert runs inside one parallel region, the activations float32 throughout, and the weighted sum
over each row's slots is the per-layer path's (same float32 operations, same order). Routing stays
the caller's (torch, as HF routes).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kvflow.kernels.cpu import native
from kvflow.kernels.cpu.float_linear import NativeFloatKernel

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_SIGNATURES = {"kvflow_float_experts": ([_P, _P, _I, _I, _P, _L, _I, _I, _P, _P, _P, _I], None)}


def experts_library() -> ctypes.CDLL | None:
    return native.load("linear", _SIGNATURES)


class NativeExperts:
    """A layer's experts held here (`gate_up[i]`, `down[i]`: expert first_expert + i's kernels,
    gate | up rows [2 x width, hidden] and down [hidden, width]), run by one native call."""

    def __init__(self, gate_up: Sequence[NativeFloatKernel], down: Sequence[NativeFloatKernel]) -> None:
        lib = experts_library()
        if lib is None:
            raise RuntimeError("the native linear library cannot be built here")
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"{len(gate_up)} gate | up kernels for {len(down)} down kernels")
        self._fn = lib.kvflow_float_experts
        self._kernels = (list(gate_up), list(down))  # (what the handles point into)
        n = len(gate_up)
        # (the native decode pass reads them too: kvflow.kernels.cpu.decode_pass)
        self.gate_up_handles = (ctypes.c_void_p * n)(*[k.native_handle for k in gate_up])
        self.down_handles = (ctypes.c_void_p * n)(*[k.native_handle for k in down])
        self.hidden = gate_up[0].in_features

    def __len__(self) -> int:
        return len(self._kernels[0])

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, first_expert: int = 0
    ) -> torch.Tensor:
        """For x [tokens, hidden], each token's `experts` and `weights` [tokens, k]: the sum over its
        slots of weight x expert(x), float32 [tokens, hidden] (0 for pairs of experts held elsewhere)."""
        tokens, top_k = experts.shape
        h = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
        ids = experts.to(torch.int64).contiguous()
        w = weights.to(torch.float32).contiguous()
        out = torch.empty(tokens, self.hidden, dtype=torch.float32)
        self._fn(
            self.gate_up_handles,
            self.down_handles,
            len(self),
            first_expert,
            h.data_ptr(),
            h.stride(0),
            tokens,
            top_k,
            ids.data_ptr(),
            w.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out
