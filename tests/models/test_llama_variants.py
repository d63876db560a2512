"""Families that are the Llama decoder with a config of their own, against HF transformers on the
same tiny random weights: Seed-OSS (`SeedOssForCausalLM`: q/k/v biases, which HF's config class
turns on by default) and Ministral (`MinistralForCausalLM`: Mistral with `layer_types`, sliding
layers beside full ones). Greedy tokens through chunked prefill, preemption and a prefix-cache hit
on each CPU attention backend, prefill logits, Seed-OSS's GGUF (llama.cpp's `seed_oss`), and the
refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import TINY_DENSE, check_greedy_matches_hf, check_prefill_logits_match_hf, save_tiny_model

from kvflow.config import ModelConfig
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.registry import causal_lm_class


def make_seed_oss(path):
    """A tiny Seed-OSS with random q/k/v biases (HF starts them at zero: one left out would not show)."""
    from transformers import SeedOssConfig, SeedOssForCausalLM

    cfg = SeedOssConfig(**dict(TINY_DENSE, head_dim=16), attention_dropout=0.0, residual_dropout=0.0)
    hf = save_tiny_model(path, SeedOssForCausalLM, cfg, seed=31)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.2)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=["seed_oss", "ministral"])
def variant(request, tmp_path_factory):
    from transformers import MinistralConfig, MinistralForCausalLM

    path = tmp_path_factory.mktemp(request.param)
    if request.param == "seed_oss":
        return request.param, str(path), make_seed_oss(path)
    types = ["sliding_attention", "full_attention"] * 2
    cfg = MinistralConfig(**dict(TINY_DENSE, num_hidden_layers=4, head_dim=16), sliding_window=8, layer_types=types)
    return request.param, str(path), save_tiny_model(path, MinistralForCausalLM, cfg, seed=32)


def test_config_reads_as_hf(variant):
    name, path, hf = variant
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    assert causal_lm_class(cfg) is LlamaForCausalLM
    if name == "seed_oss":
        assert (
            cfg.attention_bias
            and ModelConfig.from_hf_config({k: v for k, v in raw.items() if k != "attention_bias"}).attention_bias
        )
        for bad in ("attention_out_bias", "mlp_bias"):
            with pytest.raises(ValueError, match=f"{bad}=true .* not supported"):
                ModelConfig.from_hf_config({**raw, bad: True})
    else:
        assert [cfg.window_of(i) for i in range(4)] == [8, None, 8, None]
        assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(variant, backend):
    name, path, hf = variant
    check_greedy_matches_hf(path, hf, backend, num_kv_blocks=20 if name == "seed_oss" else 32)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(variant, chunk):
    _, path, hf = variant
    check_prefill_logits_match_hf(path, hf, chunk)


def test_seed_oss_gguf_greedy_matches_hf(tmp_path):
    """llama.cpp's `seed_oss` (q/k/v biases, its pre-MLP norm as post_attention_norm, rows as HF
    holds them): HF's greedy tokens from the F32 file."""
    from tiny_models import shared_prefix_prompts

    from kvflow import LLM, SamplingParams

    from conftest import assert_no_leaks, hf_greedy
    from gguf_files import write_dense_gguf

    path = tmp_path / "hf"
    hf = make_seed_oss(path)
    gguf_path = tmp_path / "seed_oss.gguf"
    write_dense_gguf(gguf_path, path, "seed_oss")
    llm = LLM(str(gguf_path), num_kv_blocks=64, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    assert llm.engine.model_config.architecture == "SeedOssForCausalLM" and llm.engine.model_config.attention_bias
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = shared_prefix_prompts(3, 4, 20, seed=5)
    for p, o in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    assert_no_leaks(llm.engine)
