"""The quantized KV cache dtypes (int8, fp8_e4m3, fp8_e5m2, int4): every attention backend's output
against a float64 recomputation over the cache dequantized by decoders written here from the
formats' specifications (exact up to float rounding), and against the float cache within the bound
the format's rounding allows; the stored codes within that rounding of the values written; the CPU
kernel's cache write the same bytes as the torch one's; configuration and capacity."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

if os.environ.get("KVFLOW_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are decorated (first use)

import pytest
import torch

from kvflow.attention.backend import SeqLayout, kv_cache_bytes_per_token
from kvflow.attention.backends.cpu import CpuPagedAttention, native_unsupported
from kvflow.attention.backends.torch import TorchPagedAttention
from kvflow.config import EngineConfig

from conftest import paged_attention_reference

CPU = torch.device("cpu")
QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2", "int4"]


# ---- the formats, decoded from their specifications ----------------------------------------------
def _fp8_value(code: int, exp_bits: int, man_bits: int, bias: int) -> float:
    """An fp8 code's value: sign, exponent, mantissa; exponent 0 is subnormal (no implicit 1)."""
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> man_bits) & ((1 << exp_bits) - 1)
    m = code & ((1 << man_bits) - 1)
    if e == 0:
        return sign * m / (1 << man_bits) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)


E4M3 = torch.tensor([_fp8_value(c, 4, 3, 7) for c in range(256)], dtype=torch.float64)
E5M2 = torch.tensor([_fp8_value(c, 5, 2, 15) for c in range(256)], dtype=torch.float64)
NAN_CODES = {"fp8_e4m3": (0x7F, 0xFF), "fp8_e5m2": tuple(range(0x7C, 0x80)) + tuple(range(0xFC, 0x100))}


def spec_dequantize(data: torch.Tensor, scale: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """float64 values [..., head_dim] of stored codes and scales [...], by the formats' definitions."""
    raw = data.view(torch.uint8).long() if data.dtype != torch.int8 else data.long()
    if kv_dtype == "int8":
        codes = raw.double()
    elif kv_dtype == "int4":  # element 2i: low nibble of byte i, 2i + 1: high nibble; stored q + 8
        codes = torch.stack(((raw & 15) - 8, (raw >> 4) - 8), dim=-1).flatten(-2).double()
    else:
        assert not any(bool((raw == c).any()) for c in NAN_CODES[kv_dtype]), "inf / NaN code stored"
        codes = (E4M3 if kv_dtype == "fp8_e4m3" else E5M2)[raw]
    return codes * scale.double().unsqueeze(-1)


def element_bound(x: torch.Tensor, scale: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """How far a stored value may be from x (float64) given its vector's scale: half a step (int:
    scale / 2), or half an ulp of x / scale (fp8: 2^-4 or 2^-3 relative; in the subnormal range
    half the subnormal step), plus float32 rounding of x / scale."""
    s = scale.double().unsqueeze(-1)
    if kv_dtype in ("int8", "int4"):
        bound = s / 2
    elif kv_dtype == "fp8_e4m3":
        bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)
    else:
        bound = torch.maximum(x.abs() * 2.0**-3, s * 2.0**-17)
    return bound + x.abs() * 1e-6 + 1e-12


# ---- backends -----------------------------------------------------------------------------------
def _backends() -> list[str]:
    names = ["torch"]
    if native_unsupported(CPU, torch.float32, 4, 2, 16) is None:
        names.append("native")
    try:
        import triton  # noqa: F401

        names.append("triton")
    except ImportError:
        pass
    return names


def _make(name: str, block_size: int, window: int | None):
    if name == "torch":
        return TorchPagedAttention(block_size, window, CPU)
    if name == "native":
        return CpuPagedAttention(block_size, window, CPU)
    from kvflow.attention.backends.triton import TritonPagedAttention

    return TritonPagedAttention(block_size, window, CPU)


def _run_steps(attn, kv_dtype, heads, kv_heads, head_dim, dtype, gen, num_blocks=24):
    """Two steps through the backend: the contexts as prefill chunks, then decodes (a block boundary,
    mid-block) with a chunk among them. Returns the float kv written per slot, the cache, and for
    each step (seqs, q, out)."""
    cache = attn.allocate_kv_cache(1, num_blocks, kv_heads, head_dim, dtype, kv_dtype)[0]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[0:4], perm[4:7], perm[7:12]]
    steps = [
        [SeqLayout(0, 8, tables[0]), SeqLayout(0, 3, tables[1]), SeqLayout(0, 13, tables[2])],
        [SeqLayout(8, 1, tables[0]), SeqLayout(3, 6, tables[1]), SeqLayout(13, 1, tables[2])],
    ]
    written = torch.zeros(cache.scale.numel() // (2 * kv_heads), 2, kv_heads, head_dim, dtype=torch.float64)
    results = []
    for seqs in steps:
        t = sum(s.num_new for s in seqs)
        q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
        # keys and values spread over several orders of magnitude within a vector (outliers)
        kv = torch.randn(t, 2, kv_heads, head_dim, generator=gen) * torch.exp(
            2 * torch.randn(t, 2, kv_heads, head_dim, generator=gen)
        )
        kv = kv.to(dtype)
        meta = attn.build_metadata(seqs)
        out = attn.forward(q, kv, cache, meta, head_dim**-0.5)
        written[meta.slot_mapping.cpu()] = kv.double()
        results.append((seqs, q, out))
    return written, cache, results


CASES = [(4, 2, 16), (6, 2, 32), (8, 1, 64), (4, 4, 128), (4, 2, 24)]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("heads,kv_heads,head_dim", CASES)
def test_output_matches_float64_over_dequantized_cache(backend, kv_dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim + QUANTIZED.index(kv_dtype))
    attn = _make(backend, 4, None)
    written, cache, results = _run_steps(attn, kv_dtype, heads, kv_heads, head_dim, torch.float32, gen)
    scale = head_dim**-0.5
    nb, bs = cache.scale.shape[:2]
    deq = spec_dequantize(cache.data, cache.scale, kv_dtype)
    assert deq.shape == (nb, bs, 2, kv_heads, head_dim)
    # (1) the codes: each stored value within the format's rounding of the value written
    slots = written.abs().flatten(1).amax(1) > 0
    x = written[slots]
    err = (deq.flatten(0, 1)[slots] - x).abs()
    assert bool((err <= element_bound(x, cache.scale.flatten(0, 1)[slots], kv_dtype)).all())
    # ... and each vector's scale is its amax over the format's largest code magnitude
    qmax = {"int8": 127, "fp8_e4m3": 448, "fp8_e5m2": 57344, "int4": 7}[kv_dtype]
    torch.testing.assert_close(
        cache.scale.flatten(0, 1)[slots].double(), x.abs().amax(-1) / qmax, rtol=1e-6, atol=1e-12
    )
    deq_cache = SimpleNamespace(data=deq, scale=None)
    float_cache = SimpleNamespace(data=written.view(nb, bs, 2, kv_heads, head_dim), scale=None)
    k_err = element_bound(written, cache.scale.flatten(0, 1), kv_dtype)[:, 0].max()
    v_err = element_bound(written, cache.scale.flatten(0, 1), kv_dtype)[:, 1].max()
    v_max = written[:, 1].abs().max()
    for seqs, q, out in results:
        # (2) exact over the dequantized cache, up to float32 rounding
        ref = paged_attention_reference(q, deq_cache, seqs, bs, scale, None)
        tol = 2e-5 * max(1.0, float(deq[:, :, 1].abs().max()))
        assert (out.double() - ref).abs().max() < tol
        # (3) against the float cache: scores move by at most ds = scale * |q|_1 * max|dK|, so the
        # softmax weights by a factor within e^(+-2 ds); the output by max|dV| + (e^(2 ds) - 1) max|V|
        ref_float = paged_attention_reference(q, float_cache, seqs, bs, scale, None).view(len(q), heads, head_dim)
        ds = scale * q.double().abs().sum(-1) * k_err  # [T, H]
        bound = v_err + torch.expm1(2 * ds) * v_max + tol
        assert bool(((out.double().view_as(ref_float) - ref_float).abs() <= bound[..., None]).all())


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("backend", [b for b in _backends() if b != "torch"])
def test_bfloat16_model(backend, kv_dtype):
    """A bf16 model's queries and outputs around a quantized cache: within bf16 rounding of float64."""
    gen = torch.Generator().manual_seed(7)
    attn = _make(backend, 4, None)
    _, cache, results = _run_steps(attn, kv_dtype, 4, 2, 32, torch.bfloat16, gen)
    deq_cache = SimpleNamespace(data=spec_dequantize(cache.data, cache.scale, kv_dtype), scale=None)
    for seqs, q, out in results:
        ref = paged_attention_reference(q, deq_cache, seqs, 4, 32**-0.5, None)
        assert out.dtype == torch.bfloat16
        assert (out.double() - ref).abs().max() <= 2.0**-7 * ref.abs().max() + 1e-3


@pytest.mark.skipif(native_unsupported(CPU, torch.float32, 4, 2, 16) is not None, reason="no C compiler")
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_native_write_same_bytes_as_torch(kv_dtype):
    """The CPU kernel's cache write (also the native decode pass's) stores the bytes the torch
    backend's quantizer does, scales included, so a block is the same whichever path wrote it."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(40, 2, 3, 64, generator=gen) * torch.exp(2 * torch.randn(40, 2, 3, 64, generator=gen))
    kv[5] = 0.0  # an all-zero vector: zero codes, the minimum scale
    meta = SimpleNamespace(slot_mapping=torch.randperm(48, generator=gen)[:40])
    caches = []
    for attn in (TorchPagedAttention(4, None, CPU), CpuPagedAttention(4, None, CPU)):
        cache = attn.allocate_kv_cache(1, 12, 3, 64, torch.float32, kv_dtype)[0]
        attn._write_kv(kv, cache, meta)
        caches.append(cache)
    a, b = caches
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale, b.scale)


def test_fp8_encoder_rounds_to_nearest_even():
    """Values halfway between two e4m3 codes go to the even one, the largest code is the format's
    max (no NaN from a value at the top of the range); the int4 codes stay in [-7, 7]."""
    if native_unsupported(CPU, torch.float32, 1, 1, 16) is not None:
        pytest.skip("no C compiler")
    # one vector whose amax is exactly 448 (scale 1): the codes are the values themselves
    x = torch.tensor([448.0, 1.0625, 1.1875, -3.25, 0.0009765625, 2.0**-10 * 3, 240.0, 232.0] * 2)
    cache = CpuPagedAttention(1, None, CPU).allocate_kv_cache(1, 1, 1, 16, torch.float32, "fp8_e4m3")[0]
    kv = torch.stack((x, x)).view(1, 2, 1, 16)
    CpuPagedAttention(1, None, CPU)._write_kv(kv, cache, SimpleNamespace(slot_mapping=torch.tensor([0])))
    assert cache.scale.flatten().tolist() == [1.0, 1.0]
    got = E4M3[cache.data.view(torch.uint8).long()].flatten()[:8].tolist()
    # 1.0625 = 1 + 1/16: halfway between 1 and 1.125 -> 1 (even); 1.1875 -> 1.25 (even mantissa 2);
    # 2^-10 (halfway between 0 and the smallest subnormal 2^-9) -> 0; 3 * 2^-10 -> 2^-8 (even);
    # 232 halfway between 224 and 240 -> 224 (even)
    assert got == [448.0, 1.0, 1.25, -3.25, 0.0, 2.0**-8, 240.0, 224.0]


# ---- configuration and capacity -----------------------------------------------------------------
def test_config_names_and_alias():
    for name in QUANTIZED + ["auto"]:
        assert EngineConfig(model="m", kv_cache_dtype=name).kv_cache_dtype == name
    assert EngineConfig(model="m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's alias
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*fp8_e5m2.*int4.*got 'fp4'"):
        EngineConfig(model="m", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3'"):
        EngineConfig(model="m", kv_cache_dtype="fp8", attention_sinks=4, enable_prefix_caching=False)


def test_int4_needs_an_even_head_dim():
    with pytest.raises(ValueError, match="int4.*head_dim must be even, got 15"):
        TorchPagedAttention(4, None, CPU).allocate_kv_cache(1, 4, 2, 15, torch.float32, "int4")
    with pytest.raises(ValueError, match="int4.*head_dim must be even, got 15"):
        kv_cache_bytes_per_token(2, 2, 15, torch.bfloat16, "int4")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bytes_per_token_and_blocks_in_the_same_memory(head_dim):
    """Per head and token: bf16 2 * head_dim bytes; fp8 head_dim + a 4-byte scale; int4 head_dim / 2
    + 4. At head_dim 128, ~1.94x (fp8) and ~3.76x (int4) the blocks of bf16 fit in the same memory."""
    layers, kv_heads = 3, 2
    bf16 = kv_cache_bytes_per_token(layers, kv_heads, head_dim, torch.bfloat16)
    assert bf16 == 2 * layers * kv_heads * head_dim * 2
    for name, per_head in (
        ("int8", head_dim + 4),
        ("fp8_e4m3", head_dim + 4),
        ("fp8_e5m2", head_dim + 4),
        ("int4", head_dim // 2 + 4),
    ):
        got = kv_cache_bytes_per_token(layers, kv_heads, head_dim, torch.bfloat16, name)
        assert got == 2 * layers * kv_heads * per_head
        cache = TorchPagedAttention(16, None, CPU).allocate_kv_cache(1, 2, kv_heads, head_dim, torch.bfloat16, name)[0]
        held = cache.data.numel() * cache.data.element_size() + cache.scale.numel() * 4
        assert held == 2 * 16 * got // layers  # what the allocation really holds
    memory = 2**30
    blocks = {
        n: memory // (16 * kv_cache_bytes_per_token(layers, kv_heads, head_dim, torch.bfloat16, n))
        for n in ("auto", "fp8_e4m3", "int4")
    }
    ratio_fp8, ratio_int4 = blocks["fp8_e4m3"] / blocks["auto"], blocks["int4"] / blocks["auto"]
    assert math.isclose(ratio_fp8, 2 * head_dim / (head_dim + 4), rel_tol=1e-3) and ratio_fp8 > 1.85
    assert math.isclose(ratio_int4, 2 * head_dim / (head_dim / 2 + 4), rel_tol=1e-3) and ratio_int4 > 3.5


def test_roofline_counts_the_scales():
    from kvflow.bench import roofline as rf

    m = rf.MODEL_PRESETS["llama3-8b"]  # 32 layers, 8 kv heads, head_dim 128
    assert rf.kv_bytes_per_token(m, "fp8_e4m3", scales=True) == 2 * 32 * 8 * (128 + 4)
    assert rf.kv_bytes_per_token(m, "int4", scales=True) == 2 * 32 * 8 * (64 + 4)
    assert rf.kv_bytes_per_token(m, "bf16", scales=True) == 2 * 32 * 8 * 256
