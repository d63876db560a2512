"""Gemma 2 and Gemma 3 (text) against HF transformers on the same tiny random weights: the config
as HF builds it, prefill logits (whole and in chunks crossing the window), greedy tokens through
the engine with each attention backend the CPU runs (prompts longer than the window, chunked
prefill, a prefix hit), tensor parallelism; and attention-logit soft-capping in each backend
against a float64 brute force."""

from __future__ import annotations

import os

if os.environ.get("KVFLOW_TEST_DEVICE", "cpu") == "cpu":
    # The Triton backend runs under Triton's interpreter on the CPU (as in tests/kernels): set
    # before its kernels are first decorated.
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_gemmas

from kvflow import LLM, SamplingParams
from kvflow.attention.backend import SeqLayout
from kvflow.attention.backends.cpu import CpuPagedAttention, native_unsupported
from kvflow.attention.backends.torch import TorchPagedAttention
from kvflow.config import ModelConfig
from kvflow.models.decode_pass import native_decode_unsupported

from conftest import (
    assert_no_leaks,
    hf_greedy,
    kvflow_prefill_logits,
    paged_attention_reference,
    random_kv_cache,
)

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
WINDOW = 8  # shorter than every prompt below

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
    initializer_range=0.1,
    sliding_window=WINDOW,
    query_pre_attn_scalar=24,  # (not head_dim: a scale taken from head_dim would show)
)
# Gemma 2: sliding / full alternating, caps small enough to change the scores and the logits.
# Gemma 3: five local layers to one global, then a local one again; the global rope scaled.
VARIANTS = {
    "gemma2": dict(num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    "gemma3": dict(
        num_hidden_layers=7,
        final_logit_softcapping=None,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ),
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return tiny_gemmas(tmp_path_factory, lambda family: {**_COMMON, **VARIANTS[family]}, seed=1234)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(2, 500) for _ in range(12)]
    return [shared + [rng.randrange(2, 500) for _ in range(n)] for n in (9, 17)] + [
        [rng.randrange(2, 500) for _ in range(n)] for n in (11, 26)
    ]


@pytest.mark.parametrize("family", list(VARIANTS))
def test_config_reads_as_hf_builds_it(gemma, family):
    path, hf = gemma(family)
    cfg = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    windows = [layer.self_attn.sliding_window for layer in hf.model.layers]
    assert list(cfg.layer_windows) == windows and cfg.is_hybrid
    assert cfg.gemma.query_pre_attn_scalar**-0.5 == hf.model.layers[0].self_attn.scaling
    assert cfg.qk_norm == (family == "gemma3")
    if family == "gemma2":
        assert cfg.gemma.attn_logit_softcapping == 2.0 and cfg.gemma.final_logit_softcapping == 5.0
        assert windows[0] == WINDOW and windows[1] is None
    else:
        assert windows == [WINDOW] * 5 + [None, WINDOW]
        assert (cfg.rope.theta, cfg.rope.scaling_type, cfg.rope.factor) == (1_000_000.0, "linear", 4.0)
        assert cfg.rope_local.theta == 10_000.0 and cfg.rope_local.scaling_type == "default"
        assert cfg.gemma.attn_logit_softcapping is None  # (HF's Gemma3Attention does not apply it)


def test_config_errors(gemma):
    path, _ = gemma("gemma2")
    base = json.loads((Path(path) / "config.json").read_text())
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        ModelConfig.from_hf_config({**base, "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_config({**base, "layer_types": ["sliding_attention"]})
    with pytest.raises(ValueError, match="attn_logit_softcapping must be positive"):
        ModelConfig.from_hf_config({**base, "attn_logit_softcapping": 0})
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        ModelConfig.from_hf_config({**base, "sliding_window": None})


@pytest.mark.parametrize("family", list(VARIANTS))
@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(gemma, family, chunk):
    """Every prompt position's logits, the prompt (26 tokens, window 8) whole or 5 tokens a step."""
    path, hf = gemma(family)
    prompt = _prompts()[3]
    ours = kvflow_prefill_logits(path, prompt, chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(VARIANTS))
@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_greedy_matches_hf(gemma, family, backend, monkeypatch):
    """Four prompts longer than the window at once, through 4-token blocks, a 10-token step
    budget (chunks crossing the window, several prompts' chunks in one step) and 24 KV blocks
    (preemption), after one of them alone (a prefix hit): HF's greedy tokens, and every block back
    in the pool. Every layer keeps all its blocks here (the hybrid KV layout, where windowed layers
    drop theirs, has its own tests): what is checked is the attention of each layer. With the native
    attention, the native linear kernels too (whose fused norm prologue Gemma layers do not use),
    and no native decode pass (it runs Llama layers)."""
    if backend == "native":
        if native_unsupported(torch.device("cpu"), torch.float32, 4, 2, 16) is not None:
            pytest.skip("the native attention kernel cannot be built here")
        monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", "native")
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed")
    path, hf = gemma(family)
    prompts = _prompts()
    llm = LLM(
        path,
        num_kv_blocks=24,
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=10,
        attention_backend=backend,
        enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=True,
    )
    first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    assert first[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)
    model = llm.engine.runner.model
    assert model.native_decode is None and native_decode_unsupported(model) == "Gemma layers run on the per-layer path"


@pytest.mark.parametrize("family", list(VARIANTS))
def test_bfloat16_close_to_float32(gemma, family):
    """bfloat16 weights and activations: logits within bf16's rounding of the float32 model's, and
    the engine runs end to end."""
    path, _ = gemma(family)
    prompt = _prompts()[3]
    f32 = kvflow_prefill_logits(path, prompt, 7)
    bf16 = kvflow_prefill_logits(path, prompt, 7, dtype=torch.bfloat16)
    assert ((bf16 - f32).abs().amax(dim=-1) / f32.abs().amax()).max() < 0.03
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=128, max_model_len=64, block_size=4)
    assert len(llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS
    assert_no_leaks(llm.engine)


def test_int8_refused(gemma):
    with pytest.raises(ValueError, match="SmoothQuant"):
        LLM(gemma("gemma2")[0], quantization="int8", num_kv_blocks=64, max_model_len=32, block_size=4)


@pytest.mark.server  # (worker processes)
def test_tensor_parallel_matches_hf(gemma):
    """Gemma 2 over two ranks (heads and feed-forward split; the norms after o_proj and down_proj
    read the all-reduced sums; the logits gathered, then soft-capped): HF's greedy tokens."""
    path, hf = gemma("gemma2")
    prompts = _prompts()
    llm = LLM(
        path,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        tensor_parallel_size=2,
        disable_hybrid_kv_cache_manager=True,  # (the worker processes take one block table per sequence)
    )
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


# ---- soft-capping in each backend against a float64 brute force -------------------------------------
def _cpu_backends():
    out = [("torch", lambda bs, w: TorchPagedAttention(bs, w, torch.device("cpu")))]
    if native_unsupported(torch.device("cpu"), torch.float32, 8, 2, 32) is None:
        out.append(("native", lambda bs, w: CpuPagedAttention(bs, w, torch.device("cpu"))))
    return out


@pytest.mark.parametrize("name,make", _cpu_backends(), ids=[n for n, _ in _cpu_backends()])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_softcap_and_window_per_call_match_float64(name, make, window, softcap):
    """A step of decodes and chunks (mid-sequence, crossing blocks); the backend built with another
    window than the call's, so only the per-call value can give the reference. Scores large enough
    (q scaled up) that a missing cap changes the output."""
    gen = torch.Generator().manual_seed(11)
    bs, heads, kv_heads, dim = 4, 8, 2, 32
    attn = make(bs, 3 if window is None else None)
    cache = random_kv_cache(attn, 40, kv_heads, dim, "auto", gen)
    perm = torch.randperm(40, generator=gen).tolist()
    seqs, used = [], 0
    for start, new in [(9, 1), (0, 7), (6, 9), (13, 1), (2, 1)]:
        n = -(-(start + new) // bs)
        seqs.append(SeqLayout(start, new, perm[used : used + n]))
        used += n
    t = sum(s.num_new for s in seqs)
    q = torch.randn(t, heads, dim, generator=gen) * 3
    kv = torch.randn(t, 2, kv_heads, dim, generator=gen)
    out = attn.forward(q, kv, cache, attn.build_metadata(seqs), 0.2, window=window, softcap=softcap)
    ref = paged_attention_reference(q, cache, seqs, bs, 0.2, window, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    if softcap is not None:  # the cap matters at this scale
        assert (ref - paged_attention_reference(q, cache, seqs, bs, 0.2, window)).abs().max() > 1e-2
