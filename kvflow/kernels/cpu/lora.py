"""Multi-LoRA compute: every adapter row of a step through one projection in one call, all adapters
at once (Punica's segmented shrink / expand), over the resident adapters stacked by slot.

`LoRAProjection` holds one projection's resident slots: A [slots, parts * rmax, in] and
(scaling * B)^T [slots, rmax, out] in float32 (parts: q/k/v of a fused qkv, gate/up of gate_up;
rmax: --max-lora-rank), and each slot's rank per part; a slot is written when an adapter is loaded
into it, never restacked per step. `LoRARows` is a step's rows under adapters, grouped by slot.
`add_lora` adds scaling * B (A pre(x)) to those rows of a projection's output: csrc/lora.cpp (the
function the fused decode pass calls too, kvflow.kernels.cpu.decode_pass), or the same sums in
torch where the native library cannot be built or the activations are not float32.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import native
from kvflow.kernels.norm import NormWeights, rms_norm

MAX_PARTS = 3  # LORA_MAX_PARTS in csrc/lora.h
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class NativeProj(ctypes.Structure):  # LoraProj in csrc/lora.h
    _fields_ = (
        [("a", _P), ("bt", _P), ("ranks", _P)]
        + [(n, _I) for n in ("in_", "out", "parts", "rmax")]
        + [("part_end", _I * MAX_PARTS)]
    )


class NativeRows(ctypes.Structure):  # LoraRows in csrc/lora.h
    _fields_ = [("rows", _P), ("seg_start", _P), ("seg_slot", _P), ("num_segments", _I)]


_SIGNATURES = {
    "kvflow_lora_add": (
        [ctypes.POINTER(NativeProj), ctypes.POINTER(NativeRows), _P, _L, _I, _P, _F, _P, _L, _I],
        None,
    ),
}


@functools.cache
def lora_library() -> ctypes.CDLL | None:
    """The native linear library with the LoRA entry point typed, or None when it cannot be built
    (looked up once: every projection of every step asks)."""
    return native.load("linear", _SIGNATURES)


PartWeights = tuple[torch.Tensor, torch.Tensor]  # one part's A [r, in] and (scaling * B)^T [r, out_part]


class LoRAProjection:
    """One projection's resident adapters, stacked by slot (see the module doc). `part_sizes`: the
    output features of its parts in fused order."""

    def __init__(self, slots: int, in_features: int, part_sizes: tuple[int, ...], max_rank: int) -> None:
        if not 1 <= len(part_sizes) <= MAX_PARTS:
            raise ValueError(f"a LoRA projection has 1 to {MAX_PARTS} parts, got {len(part_sizes)}")
        self.slots, self.in_features, self.max_rank = slots, in_features, max_rank
        self.part_sizes = part_sizes
        self.out_features = sum(part_sizes)
        parts = len(part_sizes)
        # (empty: a slot's rows past its ranks are never read, so a slot costs memory only once written)
        self.a = torch.empty(slots, parts * max_rank, in_features)
        self.bt = torch.empty(slots, max_rank, self.out_features)
        self.ranks = torch.zeros(slots, parts, dtype=torch.int32)
        self.rank_list = [[0] * parts for _ in range(slots)]  # (the torch path's copy)
        ends = [sum(part_sizes[: i + 1]) for i in range(parts)]
        self.native = NativeProj(
            self.a.data_ptr(),
            self.bt.data_ptr(),
            self.ranks.data_ptr(),
            in_features,
            self.out_features,
            parts,
            max_rank,
            (_I * MAX_PARTS)(*ends),
        )

    def set_slot(self, slot: int, parts: list[PartWeights | None] | None) -> None:
        """Write an adapter's parts into `slot` (None: a part, or the whole projection, it does not adapt)."""
        parts = parts or [None] * len(self.part_sizes)
        if len(parts) != len(self.part_sizes):
            raise ValueError(f"{len(parts)} LoRA parts for a projection of {len(self.part_sizes)} parts")
        start = 0
        for p, (w, n_out) in enumerate(zip(parts, self.part_sizes)):
            rank = 0
            if w is not None:
                a, bt = w
                rank = a.shape[0]
                if rank > self.max_rank or a.shape != (rank, self.in_features) or bt.shape != (rank, n_out):
                    raise ValueError(
                        f"LoRA part {p}: A {tuple(a.shape)} / B^T {tuple(bt.shape)} do not fit a slot of rank "
                        f"<= {self.max_rank}, {self.in_features} inputs, {n_out} outputs"
                    )
                self.a[slot, p * self.max_rank : p * self.max_rank + rank] = a
                self.bt[slot, :rank, start : start + n_out] = bt
            self.ranks[slot, p] = rank
            self.rank_list[slot][p] = rank
            start += n_out


@dataclass
class LoRARows:
    """A step's rows under adapters, grouped by slot: rows[seg_start[g]:seg_start[g + 1]] run under
    slot seg_slot[g] (int32 tensors, what the native code reads; `segments` the same for torch)."""

    rows: torch.Tensor
    seg_start: torch.Tensor
    seg_slot: torch.Tensor
    segments: list[tuple[int, torch.Tensor]]  # (slot, its rows as int64)
    native: NativeRows

    @classmethod
    def of(cls, groups: list[tuple[int, list[int]]]) -> LoRARows:
        """From (slot, its rows) per adapter of the step."""
        flat = [r for _, rows in groups for r in rows]
        starts = [0]
        for _, rows in groups:
            starts.append(starts[-1] + len(rows))
        rows_t = torch.tensor(flat, dtype=torch.int32)
        seg_start = torch.tensor(starts, dtype=torch.int32)
        seg_slot = torch.tensor([s for s, _ in groups], dtype=torch.int32)
        segments = [(s, torch.tensor(rows, dtype=torch.int64)) for s, rows in groups]
        ptrs = NativeRows(rows_t.data_ptr(), seg_start.data_ptr(), seg_slot.data_ptr(), len(groups))
        return cls(rows_t, seg_start, seg_slot, segments, ptrs)


# The op a native linear applies to each input row first (enum Prologue in csrc/linear_ops.h).
_PLAIN, _RMSNORM, _SILU_MUL = native.PLAIN, native.RMSNORM, native.SILU_MUL


def add_lora(
    proj: LoRAProjection,
    rows: LoRARows,
    x: torch.Tensor,
    out: torch.Tensor,
    norm: NormWeights | None = None,
    silu_mul: bool = False,
) -> None:
    """out[r] += scaling * B_slot (A_slot pre(x[r])) for every row r of `rows`, in place; pre: the
    RMSNorm `norm`, silu(gate) * up (`silu_mul`: x holds gate and up), or nothing. x [n, in] (or
    [n, 2 * in]), out [n, out]; native for float32 CPU tensors with unit column stride."""
    width = (2 if silu_mul else 1) * proj.in_features
    if x.dim() != 2 or x.shape[1] != width or out.dim() != 2 or out.shape[1] != proj.out_features:
        raise ValueError(
            f"LoRA of a {proj.in_features} -> {proj.out_features} projection got x {tuple(x.shape)}, "
            f"out {tuple(out.shape)} (x of {width} features)"
        )
    lib = lora_library()
    native_ok = (
        lib is not None
        and x.dtype == out.dtype == torch.float32
        and x.device.type == out.device.type == "cpu"
        and x.stride(1) == 1
        and out.stride(1) == 1
    )
    if native_ok:
        add_lora_native(lib, proj, rows, x, out, norm, silu_mul)
    else:
        add_lora_torch(proj, rows, x, out, norm, silu_mul)


def add_lora_native(
    lib: ctypes.CDLL,
    proj: LoRAProjection,
    rows: LoRARows,
    x: torch.Tensor,
    out: torch.Tensor,
    norm: NormWeights | None,
    silu_mul: bool,
) -> None:
    """`add_lora` through csrc/lora.cpp (float32 CPU tensors with unit column stride)."""
    if norm is not None:
        kind, norm_w, eps = _RMSNORM, norm.float_weight.data_ptr(), norm.eps
    else:
        kind, norm_w, eps = (_SILU_MUL if silu_mul else _PLAIN), None, 0.0
    lib.kvflow_lora_add(
        ctypes.byref(proj.native),
        ctypes.byref(rows.native),
        x.data_ptr(),
        x.stride(0),
        kind,
        norm_w,
        eps,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )


def add_lora_torch(
    proj: LoRAProjection,
    rows: LoRARows,
    x: torch.Tensor,
    out: torch.Tensor,
    norm: NormWeights | None,
    silu_mul: bool,
) -> None:
    """`add_lora` in torch: per adapter in the step, per part it adapts, a shrink and an expand
    over the slot's first rank rows (float32 sums; the sum added in out's dtype)."""
    for slot, idx in rows.segments:
        idx = idx.to(x.device)
        xs = x.index_select(0, idx)
        if norm is not None:
            xs = rms_norm(xs, norm.weight, norm.eps)
        if silu_mul:
            gate, up = xs.chunk(2, dim=-1)
            xs = F.silu(gate) * up
        xs = xs.float()
        delta = torch.zeros(len(idx), proj.out_features, device=x.device)
        start = 0
        for p, n_out in enumerate(proj.part_sizes):
            rank = proj.rank_list[slot][p]
            if rank:
                a = proj.a[slot, p * proj.max_rank : p * proj.max_rank + rank].to(x.device)
                bt = proj.bt[slot, :rank, start : start + n_out].to(x.device)
                delta[:, start : start + n_out] = (xs @ a.t()) @ bt
            start += n_out
        out.index_add_(0, idx, delta.to(out.dtype))
