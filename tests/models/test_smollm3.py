"""SmolLM3 against HF transformers on the same tiny random weights: the Llama decoder whose every
fourth layer rotates neither q nor k (NoPE). Greedy tokens through chunked prefill, preemption and
a prefix-cache hit on each CPU attention backend, prefill logits, bfloat16 near float32, the
sliding-window variant (`use_sliding_window`), and how its config is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import (
    TINY_DENSE,
    check_bfloat16_close_to_float32,
    check_blocks_follow_floats,
    check_greedy_matches_hf,
    check_prefill_logits_match_hf,
    save_tiny_model,
    shared_prefix_prompts,
)

from kvflow.config import ModelConfig
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.registry import causal_lm_class


def make_smollm3(path, **overrides):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    cfg = dict(TINY_DENSE, num_hidden_layers=4)  # (layer 3 without rotary: HF's default interval of 4)
    cfg.update(overrides)
    return save_tiny_model(path, SmolLM3ForCausalLM, SmolLM3Config(**cfg), seed=1357)


@pytest.fixture(scope="module", params=["full", "sliding"])
def smollm3(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm3")
    extra = {}
    if request.param == "sliding":  # every other layer within an 8-token window
        extra = dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)
    return str(path), make_smollm3(path, **extra)


def test_config_reads_as_hf(smollm3):
    path, hf = smollm3
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    assert causal_lm_class(cfg) is LlamaForCausalLM
    assert [cfg.uses_rope(i) for i in range(4)] == [bool(f) for f in hf.config.no_rope_layers] == [1, 1, 1, 0]
    windows = [cfg.window_of(i) for i in range(4)]
    assert windows == ([8, None, 8, None] if raw.get("use_sliding_window") else [None] * 4)
    # without no_rope_layers: HF's default from the interval
    dropped = {k: v for k, v in raw.items() if k != "no_rope_layers"} | {"no_rope_layer_interval": 2}
    assert [ModelConfig.from_hf_config(dropped).uses_rope(i) for i in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError, match="no_rope_layers must hold a 0 or 1 for each of the 4 layers"):
        ModelConfig.from_hf_config({**raw, "no_rope_layers": [1, 1]})
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        ModelConfig.from_hf_config({**raw, "mlp_bias": True})


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(smollm3, backend):
    # (the sliding variant's two KV groups: windowed layers hold only their window, as more blocks)
    sliding = ModelConfig.from_hf_config(json.loads((Path(smollm3[0]) / "config.json").read_text())).is_hybrid
    check_greedy_matches_hf(*smollm3, backend, num_kv_blocks=24 if sliding else 20)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(smollm3, chunk):
    check_prefill_logits_match_hf(*smollm3, chunk)


def test_bfloat16_close_to_float32(smollm3):
    check_bfloat16_close_to_float32(smollm3[0])


def test_nope_layers_through_the_native_decode_pass(tmp_path, monkeypatch):
    """With the native kernels every decode step of a full-attention SmolLM3 runs in the fused
    decode pass, its NoPE layers rotated by the identity: HF's greedy tokens, and every step's
    logprobs the per-layer path's bit for bit."""
    from kvflow import LLM, SamplingParams

    from conftest import assert_same_completions, hf_greedy

    monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", "native")
    path = tmp_path / "hf"
    hf = make_smollm3(path)
    llm = LLM(str(path), num_kv_blocks=64, max_model_len=64, block_size=4, kernel_autotune="off")
    model = llm.engine.runner.model
    if model.native_decode is None:
        pytest.fail("the native decode pass is unavailable here (the native library could not be built)")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = shared_prefix_prompts(3, 4, 20, seed=6)
    fused = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, fused):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    native, model.native_decode = model.native_decode, None  # the per-layer path, same engine
    per_layer = llm.generate(prompts, params, use_tqdm=False)
    model.native_decode = native
    assert_same_completions([o.outputs[0] for o in fused], [o.outputs[0] for o in per_layer], abs_tol=0.0)


def test_gguf_greedy_matches_hf(tmp_path):
    """llama.cpp's `smollm3` (converted as llama: Q/K rows permuted; no rotary on every fourth
    layer, fixed in llama.cpp as HF's default): HF's greedy tokens from the F32 file; a Q8_0 file
    on its blocks follows the same file dequantized."""
    from kvflow import LLM, SamplingParams

    from conftest import assert_no_leaks, hf_greedy
    from gguf_files import Q, write_dense_gguf

    path = tmp_path / "hf"
    hf = make_smollm3(path)  # (full attention: llama.cpp's smollm3 has no window)
    f32 = tmp_path / "smollm3.gguf"
    write_dense_gguf(f32, path, "smollm3")
    llm = LLM(str(f32), num_kv_blocks=64, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    mc = llm.engine.model_config
    assert mc.architecture == "SmolLM3ForCausalLM" and [mc.uses_rope(i) for i in range(4)] == [True] * 3 + [False]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = shared_prefix_prompts(3, 4, 20, seed=5)
    for p, o in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    assert_no_leaks(llm.engine)
    q8 = tmp_path / "smollm3-q8.gguf"
    write_dense_gguf(q8, path, "smollm3", Q.Q8_0)
    check_blocks_follow_floats(str(q8), prompts, 12)
