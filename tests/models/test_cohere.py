"""Cohere's Command R (HF `CohereForCausalLM`) and Command R7B (`Cohere2ForCausalLM`) against HF
transformers on the same tiny random weights: one LayerNorm feeding attention and MLP in parallel,
interleaved rotary (q/k rows reordered at load), Cohere 2's sliding layers beside global ones
without rotary, the logits scaled, tied embeddings; greedy tokens through chunked prefill,
preemption and a prefix-cache hit on each CPU attention backend, prefill logits, bfloat16 near
float32, a LoRA adapter against peft's merged model, two tensor-parallel ranks, GGUF files
(llama.cpp's `command-r` and `cohere2`: F32 against HF, Q8_0 blocks against the dequantized
file), and the refusals."""

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

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.models.cohere import CohereForCausalLM
from kvflow.models.registry import causal_lm_class

from conftest import assert_no_leaks, hf_greedy
from gguf_files import Q, write_dense_gguf

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(TINY_DENSE, num_hidden_layers=4, logit_scale=0.5, tie_word_embeddings=True)


@pytest.fixture(scope="module", params=["cohere", "cohere2"])
def cohere(request, tmp_path_factory):
    from transformers import Cohere2Config, Cohere2ForCausalLM, CohereConfig
    from transformers import CohereForCausalLM as HFCohere

    path = tmp_path_factory.mktemp(request.param)
    if request.param == "cohere":
        return str(path), save_tiny_model(path, HFCohere, CohereConfig(**COMMON), seed=77)
    # three 8-token sliding layers (rotary) then a global one (no rotary)
    cfg = Cohere2Config(**COMMON, sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    return str(path), save_tiny_model(path, Cohere2ForCausalLM, cfg, seed=78)


def test_config_reads_as_hf(cohere):
    path, hf = cohere
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    assert causal_lm_class(cfg) is CohereForCausalLM
    assert cfg.cohere.logit_scale == hf.config.logit_scale and cfg.rms_norm_eps == hf.config.layer_norm_eps
    if raw["model_type"] == "cohere2":
        assert [cfg.window_of(i) for i in range(4)] == [8, 8, 8, None]
        assert [cfg.uses_rope(i) for i in range(4)] == [True, True, True, False]
    else:
        assert [cfg.window_of(i) for i in range(4)] == [None] * 4 and cfg.uses_rope(3)
    for bad, match in (({"use_qk_norm": True}, "use_qk_norm=true"), ({"attention_bias": True}, "attention_bias=true")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_config({**raw, **bad})


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(cohere, backend):
    # (Command R7B's windowed layers take blocks of their own: kvflow.core.kv_groups)
    check_greedy_matches_hf(*cohere, backend, num_kv_blocks=20 if cohere[1].config.model_type == "cohere" else 36)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(cohere, chunk):
    check_prefill_logits_match_hf(*cohere, chunk)


def test_bfloat16_close_to_float32(cohere):
    check_bfloat16_close_to_float32(cohere[0])


def test_lora_matches_peft_merged(cohere, tmp_path):
    pytest.importorskip("peft")
    from lora_utils import adapter_with_peft_greedy

    from kvflow import LoRARequest

    path, _ = cohere
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    prompts = shared_prefix_prompts(3, 4, 12, seed=9)
    adapter, expected = adapter_with_peft_greedy(path, str(tmp_path / "adapter"), targets, 8, prompts, MAX_TOKENS)
    llm = LLM(path, num_kv_blocks=64, max_model_len=64, enable_lora=True)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, adapter))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_no_leaks(llm.engine)
    llm.shutdown()


@pytest.mark.server  # (worker processes)
def test_tensor_parallel_matches_hf(cohere):
    path, hf = cohere
    prompts = shared_prefix_prompts(3, 4, 20, seed=4)
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
        for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def test_gguf_greedy_matches_hf(cohere, tmp_path):
    path, hf = cohere
    arch = {"cohere": "command-r", "cohere2": "cohere2"}[hf.config.model_type]
    f32 = tmp_path / f"{arch}.gguf"
    write_dense_gguf(f32, path, arch)
    llm = LLM(str(f32), num_kv_blocks=128, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    mc = llm.engine.model_config
    assert mc.architecture == type(hf).__name__ and mc.cohere.logit_scale == hf.config.logit_scale
    assert [mc.window_of(i) for i in range(4)] == ([8, 8, 8, None] if arch == "cohere2" else [None] * 4)
    prompts = shared_prefix_prompts(3, 4, 20, seed=5)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)
    q8 = tmp_path / f"{arch}-q8.gguf"
    write_dense_gguf(q8, path, arch, Q.Q8_0)
    check_blocks_follow_floats(str(q8), prompts, MAX_TOKENS, num_kv_blocks=128)  # (R7B: blocks per window group)


def test_refusals(cohere):
    with pytest.raises(ValueError, match="SmoothQuant"):
        LLM(cohere[0], quantization="int8", num_kv_blocks=64, max_model_len=32)
