"""Mistral with a sliding window on every layer, shorter than the prompts, against HF transformers
(whose sliding-window mask lets a query at position p see keys p - window + 1 .. p): greedy tokens
through prefill chunks that cross the window and a prefix-cache hit, on each attention backend
that runs on the CPU (torch, native, and Triton under its interpreter); and prefill logits."""

from __future__ import annotations

import os

if os.environ.get("KVFLOW_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are decorated (on first use)

import importlib.util
import random

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.attention.backends.cpu import native_unsupported

from conftest import VOCAB_SIZE, assert_no_leaks, hf_greedy

WINDOW = 8
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Three prompts of 19-37 tokens (2-4 windows), the first two sharing 16 tokens."""
    rng = random.Random(17)
    shared = [rng.randrange(2, VOCAB_SIZE) for _ in range(16)]
    return [
        shared + [rng.randrange(2, VOCAB_SIZE) for _ in range(21)],
        shared + [rng.randrange(2, VOCAB_SIZE) for _ in range(3)],
        [rng.randrange(2, VOCAB_SIZE) for _ in range(29)],
    ]


def _skip_unless_runs(backend: str) -> None:
    if backend == "native":
        why = native_unsupported(torch.device("cpu"), torch.float32, 4, 2, 16)
        if why is not None:
            pytest.skip(f"the native kernels cannot be built here: {why}")
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed")


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_greedy_matches_hf(model_factory, backend):
    """6-token steps over 4-token blocks: every prompt is prefilled in chunks that start inside an
    earlier window and end past it; the first prompt is then sent again (a prefix-cache hit: its
    cached blocks, windowed, give the same tokens). HF's greedy tokens throughout."""
    _skip_unless_runs(backend)
    path, hf = model_factory("mistral", sliding_window=WINDOW)
    assert hf.config.sliding_window == WINDOW
    prompts = _prompts()
    assert all(len(p) > 2 * WINDOW for p in prompts)
    llm = LLM(
        path,
        num_kv_blocks=64,
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=6,
        attention_backend=backend,
    )
    assert llm.engine.model_config.sliding_window == WINDOW
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits = llm.get_stats().prefix_cache_hits
    again = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits >= hits + 16  # (at least the shared blocks, found)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert again[0].outputs[0].token_ids == expected[0]
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("chunk", [1000, 3])
def test_prefill_logits_match_hf(model_factory, chunk):
    """Every position's logits, the prompt whole or in 3-token chunks through the torch backend: the
    window applied inside a chunk and across chunks."""
    path, hf = model_factory("mistral", sliding_window=WINDOW)
    prompt = _prompts()[0]
    ours = _windowed_prefill_logits(path, prompt, chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # (the window matters here: HF without it gives other logits)
    hf.config.sliding_window = None
    try:
        with torch.no_grad():
            full = hf(torch.tensor([prompt])).logits[0].float()
    finally:
        hf.config.sliding_window = WINDOW
    assert (full - ref).abs().max() > 1e-2


def _windowed_prefill_logits(path: str, prompt: list[int], chunk: int) -> torch.Tensor:
    """As conftest's kvflow_prefill_logits, with the model's window given to the attention backend."""
    from kvflow.attention.backend import SeqLayout
    from kvflow.attention.backends.torch import TorchPagedAttention
    from kvflow.config import ModelConfig
    from kvflow.core.kv_cache_manager import KVCacheManager
    from kvflow.models.loader import load_checkpoint
    from kvflow.models.registry import causal_lm_class

    ckpt = load_checkpoint(path)
    cfg = ModelConfig.from_hf_config(ckpt.hf_config)
    assert cfg.sliding_window == WINDOW
    dev, blocks = torch.device("cpu"), 32
    attn = TorchPagedAttention(block_size=4, sliding_window=cfg.sliding_window, device=dev)
    model = causal_lm_class(cfg)(cfg, attn, blocks * 4, torch.float32, dev)
    model.load_weights(ckpt.weights)
    kv = KVCacheManager(num_blocks=blocks, block_size=4, enable_caching=False)
    caches = attn.allocate_kv_cache(cfg.num_layers, blocks, cfg.num_kv_heads, cfg.head_dim, torch.float32)

    class Seq:
        request_id, num_computed_tokens = "x", 0

    seq, logits = Seq(), []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            ids = prompt[start : start + chunk]
            assert kv.allocate_slots(seq, len(ids))
            meta = attn.build_metadata([SeqLayout(start, len(ids), kv.block_tables["x"])])
            logits.append(model.compute_logits(model(torch.tensor(ids), meta.positions, caches, meta)))
            seq.num_computed_tokens += len(ids)
    return torch.cat(logits)
