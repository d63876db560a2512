"""OLMo 3 (HF `Olmo3ForCausalLM`) against HF transformers on the same tiny random weights: OLMo 2's
layer (norms after each sublayer, whole-projection q/k norms) with three 8-token sliding-window
layers to one full-attention layer, YaRN on the full layer's rotary only (a second table for the
sliding ones). Greedy tokens through chunked prefill, preemption and a prefix-cache hit on each CPU
attention backend, prefill logits past the window, bfloat16 near float32, an old-format config
read as HF reads it, and the GGUF file llama.cpp converts it to (`olmo2` with a sliding window)."""

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

from kvflow.config import ModelConfig
from kvflow.models.olmo2 import Olmo2ForCausalLM
from kvflow.models.registry import causal_lm_class

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10_000.0}


@pytest.fixture(scope="module")
def olmo3(tmp_path_factory):
    from transformers import Olmo3Config, Olmo3ForCausalLM

    path = tmp_path_factory.mktemp("olmo3")
    cfg = Olmo3Config(
        **dict(TINY_DENSE, num_hidden_layers=4),
        sliding_window=8,
        rope_parameters={
            "full_attention": dict(YARN),
            "sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0},
        },
    )
    return str(path), save_tiny_model(path, Olmo3ForCausalLM, cfg, seed=4322)


def test_config_reads_as_hf(olmo3):
    path, hf = olmo3
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    assert causal_lm_class(cfg) is Olmo2ForCausalLM
    assert hf.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert [cfg.window_of(i) for i in range(4)] == [8, 8, 8, None]
    assert cfg.rope.scaling_type == "yarn" and cfg.rope.factor == 4.0
    assert cfg.rope_local.scaling_type == "default" and cfg.rope_local.theta == 5_000.0
    # an old-format config: `rope_scaling` on the full layers only, `rope_theta` on both (HF's reading)
    old = {k: v for k, v in raw.items() if k != "rope_parameters"}
    old.update(rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"}, rope_theta=20_000.0)
    read = ModelConfig.from_hf_config(old)
    assert (read.rope.scaling_type, read.rope.theta) == ("yarn", 20_000.0)
    assert (read.rope_local.scaling_type, read.rope_local.theta) == ("default", 20_000.0)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(olmo3, backend):
    check_greedy_matches_hf(*olmo3, backend, num_kv_blocks=36)  # (the windowed layers' blocks of their own)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(olmo3, chunk):
    check_prefill_logits_match_hf(*olmo3, chunk)


def test_bfloat16_close_to_float32(olmo3):
    check_bfloat16_close_to_float32(olmo3[0])


def test_gguf_greedy_matches_hf(olmo3, tmp_path):
    from kvflow import LLM, SamplingParams

    from conftest import assert_no_leaks, hf_greedy
    from gguf_files import write_olmo2_gguf

    path, hf = olmo3
    gguf_path = tmp_path / "olmo3.gguf"
    write_olmo2_gguf(gguf_path, path)
    llm = LLM(str(gguf_path), num_kv_blocks=64, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    mc = llm.engine.model_config
    assert mc.architecture == "Olmo3ForCausalLM" and [mc.window_of(i) for i in range(4)] == [8, 8, 8, None]
    assert (mc.rope.scaling_type, mc.rope_local.theta) == ("yarn", 5_000.0)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = shared_prefix_prompts(3, 4, 20, seed=5)
    for p, o in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    assert_no_leaks(llm.engine)
