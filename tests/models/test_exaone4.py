"""EXAONE 4 (HF `Exaone4ForCausalLM`) against HF transformers on the same tiny random weights:
OLMo 2's layer (norms after each sublayer) with per-head q/k norms, three 8-token sliding-window
layers to one global layer, and no rotary on the global one. Greedy tokens through chunked prefill,
preemption and a prefix-cache hit on each CPU attention backend, prefill logits past the window,
bfloat16 near float32, two tensor-parallel ranks, and the config's older pattern forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import (
    TINY_DENSE,
    check_bfloat16_close_to_float32,
    check_greedy_matches_hf,
    check_prefill_logits_match_hf,
    save_tiny_model,
    shared_prefix_prompts,
)

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.models.olmo2 import Olmo2ForCausalLM
from kvflow.models.registry import causal_lm_class

from conftest import assert_no_leaks, hf_greedy


@pytest.fixture(scope="module")
def exaone4(tmp_path_factory):
    from transformers import Exaone4Config, Exaone4ForCausalLM

    path = tmp_path_factory.mktemp("exaone4")
    cfg = Exaone4Config(
        **dict(TINY_DENSE, num_hidden_layers=4, head_dim=16), sliding_window=8, sliding_window_pattern=4
    )
    return str(path), save_tiny_model(path, Exaone4ForCausalLM, cfg, seed=44)


def test_config_reads_as_hf(exaone4):
    path, hf = exaone4
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    assert causal_lm_class(cfg) is Olmo2ForCausalLM and cfg.qk_norm and cfg.qk_norm_per_head
    assert hf.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert [cfg.window_of(i) for i in range(4)] == [8, 8, 8, None]
    assert [cfg.uses_rope(i) for i in range(4)] == [True, True, True, False]
    # without layer_types: the pattern, as an int or as a string of L / G
    bare = {k: v for k, v in raw.items() if k != "layer_types"}
    for pattern, windows in ((2, [8, None, 8, None]), ("LLGL", [8, 8, None, 8])):
        assert [
            ModelConfig.from_hf_config({**bare, "sliding_window_pattern": pattern}).window_of(i) for i in range(4)
        ] == windows
    # no window: every layer global, and every layer rotates (HF's attention without sliding_window)
    plain = ModelConfig.from_hf_config({**bare, "sliding_window": None})
    assert [plain.window_of(i) for i in range(4)] == [None] * 4 and all(plain.uses_rope(i) for i in range(4))


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(exaone4, backend):
    check_greedy_matches_hf(*exaone4, backend, num_kv_blocks=36)  # (the windowed layers' blocks of their own)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(exaone4, chunk):
    check_prefill_logits_match_hf(*exaone4, chunk)


def test_bfloat16_close_to_float32(exaone4):
    check_bfloat16_close_to_float32(exaone4[0])


@pytest.mark.server  # (worker processes)
def test_tensor_parallel_matches_hf(exaone4):
    """Two ranks (per-head q/k norms need no other rank's heads; the post-norms read the all-reduced
    sums): HF's greedy tokens."""
    path, hf = exaone4
    prompts = shared_prefix_prompts(3, 4, 20, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
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
        for p, o in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
