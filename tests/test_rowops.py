"""The int8 path's fused native row ops against float64 recomputations, and their batch invariance
(a row's result must not depend on the other rows: the int8 path is exact across batching)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.layers import rowops
from kvflow.layers.linear import make_linear_kernel
from kvflow.layers.rotary import apply_rotary_

pytestmark = pytest.mark.skipif(not rowops.available(), reason="no C compiler: the native row ops cannot be built")


def _check_row_scaled(out: rowops.RowScaled, ref: torch.Tensor) -> None:
    assert torch.allclose(out.scale.double().squeeze(1), ref.abs().amax(-1), rtol=1e-5)
    assert torch.allclose(out.x.abs().amax(-1), torch.ones(len(ref)), atol=2e-7)  # the largest entry is +-1
    assert torch.allclose(out.x.double() * out.scale.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cols", [576, 77, 16, 5])
def test_rmsnorm_row_scale(cols):
    g = torch.Generator().manual_seed(cols)
    x, w = torch.randn(9, cols, generator=g) * 3, torch.randn(cols, generator=g)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    _check_row_scaled(rowops.rmsnorm_row_scale(x, w, 1e-6), ref)


@pytest.mark.parametrize("inter", [1536, 40, 7])
def test_silu_mul_row_scale(inter):
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(6, 2 * inter, generator=g) * 4
    ref = F.silu(gu[:, :inter].double()) * gu[:, inter:].double()
    _check_row_scaled(rowops.silu_mul_row_scale(gu), ref)


def test_row_scale_strided_input_and_zero_rows():
    x = torch.randn(4, 50)[:, :33]  # a strided view
    x[2] = 0
    out = rowops.row_scale(x)
    assert torch.equal(out.x[2], torch.zeros(33)) and out.scale[2, 0] > 0  # no NaN for an all-zero row
    keep = [0, 1, 3]
    _check_row_scaled(rowops.RowScaled(out.x[keep], out.scale[keep]), x[keep].double())


@pytest.mark.parametrize("head_dim", [64, 16])
def test_rotary_matches_torch_path(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(5, 7 * head_dim + 24, generator=g)
    x = qkv[:, : 7 * head_dim].view(5, 7, head_dim)  # a view with a row stride, as in the layers
    cos, sin = torch.randn(5, 1, head_dim, generator=g), torch.randn(5, 1, head_dim, generator=g)
    ref = x.double() * cos.double() + x.double().roll(head_dim // 2, -1) * sin.double()
    expect = x.clone()
    apply_rotary_(expect, cos, sin)
    rowops.rotary_(x, cos, sin)
    assert torch.allclose(x.double(), ref, atol=1e-5)
    assert torch.allclose(x, expect, atol=1e-5)


def test_rows_do_not_depend_on_their_batch():
    g = torch.Generator().manual_seed(0)
    x, w, gu = torch.randn(33, 576, generator=g), torch.randn(576, generator=g), torch.randn(33, 3072, generator=g)
    big = (rowops.rmsnorm_row_scale(x, w, 1e-5), rowops.silu_mul_row_scale(gu), rowops.row_scale(x))
    for i in (0, 7, 32):
        alone = (rowops.rmsnorm_row_scale(x[i:i + 1].clone(), w, 1e-5), rowops.silu_mul_row_scale(gu[i:i + 1].clone()),
                 rowops.row_scale(x[i:i + 1].clone()))
        for a, b in zip(alone, big):
            assert torch.equal(a.x, b.x[i:i + 1]) and torch.equal(a.scale, b.scale[i:i + 1])


def test_int8_kernel_takes_row_scaled_input():
    """Row-scaled input from a producer gives the same result as the kernel scaling the rows itself."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 96, generator=g) * 0.05, torch.randn(5, 96, generator=g)
    k = make_linear_kernel("int8", w)
    assert torch.equal(k(rowops.row_scale(x)), k(x))
    assert torch.allclose(k(x), x @ w.T, rtol=0.05, atol=0.05)
