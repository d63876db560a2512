"""Gemma (1; HF `GemmaForCausalLM`) against HF transformers on the same tiny random weights: the
Llama layer with (1 + w) norms, GeGLU and embeddings scaled by sqrt(hidden); greedy tokens through
chunked prefill, preemption and a prefix-cache hit on each CPU attention backend, prefill logits,
bfloat16 near float32, and its legacy `hidden_act` "gelu" read as HF reads it."""

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
)

from kvflow.config import ModelConfig
from kvflow.models.gemma import GemmaForCausalLM
from kvflow.models.registry import causal_lm_class


@pytest.fixture(scope="module")
def gemma1(tmp_path_factory):
    from transformers import GemmaConfig
    from transformers import GemmaForCausalLM as HFGemma

    path = tmp_path_factory.mktemp("gemma1")
    cfg = GemmaConfig(**dict(TINY_DENSE, head_dim=16))  # (untied: the tied tiny model repeats one token)
    return str(path), save_tiny_model(path, HFGemma, cfg, seed=55, norms=(0.0, 0.3))  # (w around 0: 1 + w)


def test_config_reads_as_hf(gemma1):
    path, hf = gemma1
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    assert causal_lm_class(cfg) is GemmaForCausalLM and not cfg.gemma.post_norms
    assert cfg.gemma.query_pre_attn_scalar**-0.5 == hf.model.layers[0].self_attn.scaling
    assert ModelConfig.from_hf_config({**raw, "hidden_act": "gelu"}).gemma.hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        ModelConfig.from_hf_config({**raw, "hidden_act": "relu"})


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(gemma1, backend):
    check_greedy_matches_hf(*gemma1, backend)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(gemma1, chunk):
    check_prefill_logits_match_hf(*gemma1, chunk)


def test_bfloat16_close_to_float32(gemma1):
    check_bfloat16_close_to_float32(gemma1[0])
