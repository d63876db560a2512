"""The int8 linear's native path (csrc/int8_linear.cpp: prologue, per-token quantization, FBGEMM,
epilogue in one call) against a float64 recomputation of the same quantized arithmetic and against
the torch-op path; batch invariance (a row's result must not depend on the other rows: the int8
path is exact across batching, chunking and preemption); and the native rotary the int8 path uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels.cpu.int8_linear import Int8Kernel
from kvflow.kernels.cpu.paged_attention import rotary_, rotary_available
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import apply_rotary_

EPS = 1e-5


def _kernels(w: torch.Tensor, b: torch.Tensor | None, monkeypatch) -> tuple[Int8Kernel, Int8Kernel]:
    native = Int8Kernel(w, b)
    if not native.native:
        pytest.skip("no C++ compiler: the native int8 linear cannot be built")
    monkeypatch.setenv("KVFLOW_INT8_NATIVE", "0")
    reference = Int8Kernel(w, b)
    assert not reference.native
    return native, reference


def _float64_reference(k: Int8Kernel, x, residual, norm, silu_mul) -> torch.Tensor:
    """The same quantized maths in float64: prologue, per-row scale, rounding, integer products."""
    v = x.double()
    if norm is not None:
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    if silu_mul:
        g, u = v.chunk(2, dim=-1)
        v = F.silu(g) * u
    levels = k.x_zero_point - 1
    r = v.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    q = torch.round(v * levels / r)
    y = q @ k.dequantized_weight().double().T * r / levels
    if k.bias is not None:
        y = y + k.bias.double()
    return y if residual is None else y + residual.double()


@pytest.mark.parametrize("n,k", [(96, 160), (576, 576), (40, 7)])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul"])
def test_native_int8_linear_matches_float64_and_torch_path(n, k, prologue, monkeypatch):
    g = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    native, reference = _kernels(w, b, monkeypatch)
    cols = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(9, cols + 3, generator=g)[:, :cols] * 3  # a strided view, as the layers pass them
    x[2] *= 1000.0  # a token with massive activations must not flatten the others
    x[5] = 0.0  # an all-zero row quantizes to zeros, not NaN
    residual = torch.randn(9, n, generator=g)
    norm = RMSNorm(k, EPS, torch.float32, torch.device("cpu"))
    norm.weight.data = torch.rand(k, generator=g) + 0.5
    kw = {"norm": norm.kernel_args()} if prologue == "rmsnorm" else {"silu_mul": prologue == "silu_mul"}
    got = native(x, residual, **kw)
    ref = _float64_reference(native, x, residual, kw.get("norm"), kw.get("silu_mul", False))
    assert got.dtype == torch.float32 and got.shape == (9, n) and torch.isfinite(got).all()
    # float32 rounding of the prologue may move a value across a rounding boundary: one level of one
    # entry, ~r/127 * |w|, far below the tolerance; a wrong scale, offset or layout is far above it.
    torch.testing.assert_close(got.double(), ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    torch.testing.assert_close(got, reference(x, residual, **kw), rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    # Rows alone equal rows in the batch, bit for bit.
    for i in (0, 2, 8):
        assert torch.equal(native(x[i : i + 1].clone(), residual[i : i + 1].clone(), **kw), got[i : i + 1])


def test_native_int8_weight_round_trip(monkeypatch):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 96, generator=g)
    native, reference = _kernels(w, None, monkeypatch)
    assert torch.equal(native.dequantized_weight(), reference.dequantized_weight())
    assert (native.dequantized_weight() - w).abs().max() <= w.abs().amax(1).max() / 127


def test_native_int8_large_batch_and_no_residual(monkeypatch):
    """Many rows (the prefill shape: rows split over threads) without bias or residual."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(200, 128, generator=g) * 0.1
    native, reference = _kernels(w, None, monkeypatch)
    x = torch.randn(300, 128, generator=g)
    got = native(x)
    torch.testing.assert_close(got, reference(x), rtol=1e-3, atol=1e-3)
    assert torch.equal(native(x[123:124].clone()), got[123:124])


@pytest.mark.skipif(not rotary_available(torch.float32, 64), reason="no C compiler: the native rotary cannot be built")
@pytest.mark.parametrize("head_dim", [64, 16])
def test_rotary_matches_torch_path(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(5, 7 * head_dim + 24, generator=g)
    x = qkv[:, : 7 * head_dim].view(5, 7, head_dim)  # a view with a row stride, as in the layers
    cos, sin = torch.randn(5, 1, head_dim, generator=g), torch.randn(5, 1, head_dim, generator=g)
    ref = x.double() * cos.double() + x.double().roll(head_dim // 2, -1) * sin.double()
    expect = x.clone()
    apply_rotary_(expect, cos, sin)
    rotary_(x, cos, sin)
    assert torch.allclose(x.double(), ref, atol=1e-5)
    assert torch.allclose(x, expect, atol=1e-5)


def test_int8_linear_refuses_a_wrong_input_width(monkeypatch):
    native, reference = _kernels(torch.randn(8, 32), None, monkeypatch)
    for k in (native, reference):
        with pytest.raises(ValueError, match="32 inputs got rows of 31"):
            k(torch.randn(2, 31))
        with pytest.raises(ValueError, match="silu_mul takes gate and up"):
            k(torch.randn(2, 32), silu_mul=True)
        assert k(torch.randn(0, 32)).shape == (0, 8)


def test_native_int8_linear_takes_bf16_and_3d_inputs(monkeypatch):
    """A bfloat16 model's rows (an int8 self-draft of a bf16 target, `--dtype bfloat16
    --quantization int8`) and leading batch dims go through the native call as float32 rows; the
    result comes back in the input's dtype and shape."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g) * 0.1
    native, _ = _kernels(w, torch.randn(48, generator=g), monkeypatch)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    residual = torch.randn(2, 3, 48, generator=g).to(torch.bfloat16)
    got = native(x, residual)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 48)
    want = native(x.float().reshape(6, 64), residual.float().reshape(6, 48)).to(torch.bfloat16)
    assert torch.equal(got.reshape(6, 48), want)
