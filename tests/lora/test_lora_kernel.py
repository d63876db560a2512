"""The multi-LoRA shrink / expand (kvflow.kernels.cpu.lora: csrc/lora.cpp, and its torch path)
against a float64 recomputation: several adapters of different ranks in stacked slots, rows of
them interleaved with base rows, parts of a fused projection adapted or not, every input op
(none, RMSNorm, silu * mul), widths that leave vector tails. And a row's result is the same bits
whatever else is in its batch and however many threads run it."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.cpu.lora import LoRAProjection, LoRARows, add_lora_native, add_lora_torch, lora_library
from kvflow.kernels.norm import NormWeights

IN, PARTS, MAX_RANK, SLOTS = 45, (24, 9, 13), 16, 4


def _projection(gen: torch.Generator) -> tuple[LoRAProjection, dict[int, list]]:
    """Slots 0, 1 and 3 hold adapters (slot 2 stays empty): per slot, per part (A, (s B)^T) or None."""
    proj = LoRAProjection(SLOTS, IN, PARTS, MAX_RANK)
    held: dict[int, list] = {}
    for slot, ranks in {0: (3, 0, 16), 1: (8, 8, 8), 3: (1, 5, 0)}.items():
        parts = [
            None if r == 0 else (torch.randn(r, IN, generator=gen), torch.randn(r, n, generator=gen) * 0.3)
            for r, n in zip(ranks, PARTS)
        ]
        proj.set_slot(slot, parts)
        held[slot] = parts
    return proj, held


def _pre(x: torch.Tensor, kind: str, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    if kind == "rmsnorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    if kind == "silu_mul":
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return x


def _reference(held, groups, x, out, kind, norm_w, eps) -> torch.Tensor:
    ref = out.double().clone()
    v = _pre(x.double(), kind, norm_w.double(), eps)
    for slot, rows in groups:
        start = 0
        for part, n in zip(held[slot], PARTS):
            if part is not None:
                a, bt = part
                ref[rows, start : start + n] += (v[rows] @ a.double().t()) @ bt.double()
            start += n
    return ref


# Rows of slots 3, 0 and 1 in no order, rows 2, 7 and 12 of the base model (in no segment).
GROUPS = [(3, [5, 0, 9]), (0, [1, 4, 6, 8, 10, 11, 13, 14, 15, 16]), (1, [3])]
N = 17


@pytest.mark.parametrize("kind", ["none", "rmsnorm", "silu_mul"])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_matches_float64(kind, path):
    if path == "native" and lora_library() is None:
        pytest.fail("the native linear library could not be built")
    gen = torch.Generator().manual_seed(3)
    proj, held = _projection(gen)
    x = torch.randn(N, 2 * IN if kind == "silu_mul" else IN, generator=gen)
    out = torch.randn(N, sum(PARTS), generator=gen)
    norm_w = torch.rand(IN, generator=gen) + 0.5
    eps = 1e-5
    norm = NormWeights(norm_w, norm_w, eps) if kind == "rmsnorm" else None
    rows = LoRARows.of(GROUPS)
    got = out.clone()
    if path == "native":
        add_lora_native(lora_library(), proj, rows, x, got, norm, kind == "silu_mul")
    else:
        add_lora_torch(proj, rows, x, got, norm, kind == "silu_mul")
    ref = _reference(held, GROUPS, x, out, kind, norm_w, eps)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    base_rows = [2, 7, 12]
    assert torch.equal(got[base_rows], out[base_rows])  # rows of the base model are untouched
    # the adapters did change their rows (the comparison tests something)
    assert (got - out).abs()[[r for _, rs in GROUPS for r in rs]].amax(1).min() > 1e-3


def test_native_row_is_batch_and_thread_invariant():
    lib = lora_library()
    if lib is None:
        pytest.fail("the native linear library could not be built")
    gen = torch.Generator().manual_seed(5)
    proj, _ = _projection(gen)
    x = torch.randn(N, IN, generator=gen)
    out = torch.randn(N, sum(PARTS), generator=gen)
    norm_w = torch.rand(IN, generator=gen) + 0.5
    norm = NormWeights(norm_w, norm_w, 1e-6)
    full = out.clone()
    add_lora_native(lib, proj, LoRARows.of(GROUPS), x, full, norm, False)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            for slot, rows in GROUPS:
                for row in rows:  # the row alone, in a batch of its own
                    alone = out[row : row + 1].clone()
                    add_lora_native(lib, proj, LoRARows.of([(slot, [0])]), x[row : row + 1], alone, norm, False)
                    assert torch.equal(alone[0], full[row]), (n_threads, slot, row)
    finally:
        torch.set_num_threads(threads)


def test_slot_checks_shapes():
    proj = LoRAProjection(2, IN, PARTS, 4)
    with pytest.raises(ValueError, match="rank <= 4"):
        proj.set_slot(0, [(torch.zeros(5, IN), torch.zeros(5, PARTS[0])), None, None])
    with pytest.raises(ValueError, match="3 parts"):
        proj.set_slot(0, [None])
