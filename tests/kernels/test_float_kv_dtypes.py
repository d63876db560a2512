"""A float KV cache of another dtype than the model's (`--kv-cache-dtype bfloat16` under a float32
model, `float32` under a bf16 one): every attention backend stores each value rounded once to the
cache's dtype (torch's round-to-nearest-even, the same bytes from the CPU kernel's write) and attends
over exactly those values, against a float64 recomputation (the CPU kernel's bf16-product prefill
tiles: with their query rounded to bf16, within the probabilities' rounding); the bytes per token
follow the cache's dtype."""

from __future__ import annotations

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

from conftest import bf16_product_rows, bf16_query_reference, paged_attention_reference

CPU = torch.device("cpu")
NATIVE = native_unsupported(CPU, torch.float32, 4, 2, 16) is None


def _backends() -> list[str]:
    names = ["torch"] + (["native"] if NATIVE else [])
    try:
        import triton  # noqa: F401

        names.append("triton")
    except ImportError:
        pass
    return names


def _make(name: str):
    if name == "torch":
        return TorchPagedAttention(4, None, CPU)
    if name == "native":
        return CpuPagedAttention(4, None, CPU)
    from kvflow.attention.backends.triton import TritonPagedAttention

    return TritonPagedAttention(4, None, CPU)


def _run(attn, model_dtype, kv_dtype, heads, kv_heads, head_dim, gen):
    """Prefill chunks, then decodes with a chunk among them; returns (cache, kv written per slot in
    the model's dtype, [(seqs, q, out)])."""
    cache = attn.allocate_kv_cache(1, 24, kv_heads, head_dim, model_dtype, kv_dtype)[0]
    perm = torch.randperm(24, generator=gen).tolist()
    tables = [perm[0:4], perm[4:7], perm[7:12]]
    steps = [
        [SeqLayout(0, 8, tables[0]), SeqLayout(0, 3, tables[1]), SeqLayout(0, 13, tables[2])],
        [SeqLayout(8, 1, tables[0]), SeqLayout(3, 6, tables[1]), SeqLayout(13, 1, tables[2])],
    ]
    written = torch.zeros(24 * 4, 2, kv_heads, head_dim, dtype=model_dtype)
    results = []
    for seqs in steps:
        t = sum(s.num_new for s in seqs)
        q = torch.randn(t, heads, head_dim, generator=gen).to(model_dtype)
        kv = (torch.randn(t, 2, kv_heads, head_dim, generator=gen) * 3).to(model_dtype)
        meta = attn.build_metadata(seqs)
        out = attn.forward(q, kv, cache, meta, head_dim**-0.5)
        written[meta.slot_mapping.cpu()] = kv
        results.append((seqs, q, out))
    return cache, written, results


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 1, 64), (4, 4, 128), (4, 2, 24)])
def test_float32_model_bfloat16_cache(backend, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    cache, written, results = _run(_make(backend), torch.float32, "bfloat16", heads, kv_heads, head_dim, gen)
    assert cache.data.dtype == torch.bfloat16 and cache.scale is None
    # each value rounded once, to nearest even (torch's float32 -> bfloat16)
    stored = cache.data.flatten(0, 1)[: len(written)]  # (Triton's cache has a padding block more)
    assert torch.equal(stored.view(torch.int16), written.to(torch.bfloat16).view(torch.int16))
    v_max = float(cache.data[:, :, 1].float().abs().max())
    for seqs, q, out in results:
        assert out.dtype == torch.float32
        # (the native kernel's prefill tiles multiply in bf16 where the CPU can: those rows' query
        # rounded to bf16 as the kernel rounds it, and the probabilities' rounding, 2^-9 * max|v|)
        rows = bf16_product_rows(cache, seqs, heads, head_dim, native=backend == "native")
        ref = bf16_query_reference(q, cache, seqs, 4, head_dim**-0.5, None, rows)
        bound = torch.tensor([2**-9 * v_max if b else 0.0 for b in rows]) + 2e-5 * max(1.0, v_max)
        assert ((out.double() - ref).abs().amax(1) < bound).all()


@pytest.mark.parametrize("backend", _backends())
def test_bfloat16_model_float32_cache(backend):
    """A bf16 model's K/V held in float32: stored exactly; the output within bf16's rounding."""
    gen = torch.Generator().manual_seed(5)
    cache, written, results = _run(_make(backend), torch.bfloat16, "float32", 4, 2, 32, gen)
    assert cache.data.dtype == torch.float32
    assert torch.equal(cache.data.flatten(0, 1)[: len(written)], written.float())
    for seqs, q, out in results:
        assert out.dtype == torch.bfloat16
        ref = paged_attention_reference(q, cache, seqs, 4, 32**-0.5, None)
        assert (out.double() - ref).abs().max() <= 2.0**-7 * ref.abs().max() + 1e-3


@pytest.mark.skipif(not NATIVE, reason="no C compiler")
def test_native_write_same_bytes_as_torch():
    """The CPU kernel's write (also the fused decode pass's) rounds float32 to bfloat16 as torch does,
    ties and all, so a block is the same whichever path wrote it."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(40, 2, 3, 64, generator=gen) * torch.exp(2 * torch.randn(40, 2, 3, 64, generator=gen))
    # exact ties between two bfloat16 values (round half to even), both ways
    kv[7, 0, 0, :4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 2.0**-130])
    meta = SimpleNamespace(slot_mapping=torch.randperm(48, generator=gen)[:40])
    caches = []
    for attn in (TorchPagedAttention(4, None, CPU), CpuPagedAttention(4, None, CPU)):
        cache = attn.allocate_kv_cache(1, 12, 3, 64, torch.float32, "bfloat16")[0]
        attn._write_kv(kv, cache, meta)
        caches.append(cache)
    a, b = caches
    assert torch.equal(a.data.view(torch.int16), b.data.view(torch.int16))
    assert torch.equal(a.data.flatten(0, 1)[meta.slot_mapping], kv.to(torch.bfloat16))


def test_bytes_per_token_follow_the_cache_dtype():
    layers, kv_heads, head_dim = 3, 2, 64
    per = {
        (model, kv): kv_cache_bytes_per_token(layers, kv_heads, head_dim, model, kv)
        for model in (torch.float32, torch.bfloat16)
        for kv in ("auto", "float32", "bfloat16")
    }
    f32, b16 = 2 * layers * kv_heads * head_dim * 4, 2 * layers * kv_heads * head_dim * 2
    assert per == {
        (torch.float32, "auto"): f32,
        (torch.float32, "float32"): f32,
        (torch.float32, "bfloat16"): b16,
        (torch.bfloat16, "auto"): b16,
        (torch.bfloat16, "float32"): f32,
        (torch.bfloat16, "bfloat16"): b16,
    }
    cache = TorchPagedAttention(16, None, CPU).allocate_kv_cache(1, 2, kv_heads, head_dim, torch.float32, "bfloat16")
    assert cache[0].data.numel() * cache[0].data.element_size() == 2 * 16 * b16 // layers


def test_config_names():
    for name in ("float32", "bfloat16"):
        assert EngineConfig(model="m", kv_cache_dtype=name).kv_cache_dtype == name
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*float32.*bfloat16.*got 'float16'"):
        EngineConfig(model="m", kv_cache_dtype="float16")
