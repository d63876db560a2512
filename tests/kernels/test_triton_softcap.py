"""The Triton attention kernels with per-call windows and attention-logit soft-capping (Gemma 2),
under Triton's interpreter on the CPU (or compiled, with KVFLOW_TEST_DEVICE=cuda, as
tests/kernels/test_triton_attention.py): against the float64 brute force, decodes and prefill
chunks in one step, the backend built with another window than the call's."""

from __future__ import annotations

import os

DEVICE_NAME = os.environ.get("KVFLOW_TEST_DEVICE", "cpu")
if DEVICE_NAME == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (on first use)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvflow.attention.backend import LayerKVCache, SeqLayout  # noqa: E402

from conftest import paged_attention_reference, random_kv_cache  # noqa: E402

DEVICE = torch.device(DEVICE_NAME)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_softcap_and_window_per_call_match_float64(window, softcap):
    from kvflow.attention.backends.triton import TritonPagedAttention

    gen = torch.Generator().manual_seed(11)
    bs, heads, kv_heads, dim = 4, 8, 2, 32
    attn = TritonPagedAttention(bs, 3 if window is None else None, DEVICE)
    host = TritonPagedAttention(bs, None, torch.device("cpu"))
    cache = random_kv_cache(host, 40, kv_heads, dim, "auto", gen)
    perm = torch.randperm(40, generator=gen).tolist()
    seqs, used = [], 0
    for start, new in [(9, 1), (0, 7), (6, 19), (13, 1), (2, 1)]:  # (a chunk longer than a query tile)
        n = -(-(start + new) // bs)
        seqs.append(SeqLayout(start, new, perm[used : used + n]))
        used += n
    t = sum(s.num_new for s in seqs)
    q = torch.randn(t, heads, dim, generator=gen) * 3
    kv = torch.randn(t, 2, kv_heads, dim, generator=gen)
    dev = LayerKVCache(cache.data.to(DEVICE))
    meta = attn.build_metadata(seqs)
    out = attn.forward(q.to(DEVICE), kv.to(DEVICE), dev, meta, 0.2, window=window, softcap=softcap).cpu()
    written = LayerKVCache(dev.data.cpu())
    ref = paged_attention_reference(q, written, seqs, bs, 0.2, window, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    if softcap is not None:  # the cap matters at this scale
        assert (ref - paged_attention_reference(q, written, seqs, bs, 0.2, window)).abs().max() > 1e-2
