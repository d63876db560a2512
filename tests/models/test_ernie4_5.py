"""ERNIE 4.5 dense (HF `Ernie4_5ForCausalLM`) against HF transformers on the same tiny random
weights: the Llama decoder with rotary over interleaved pairs (q/k rows reordered at load); greedy
tokens through chunked prefill, preemption and a prefix-cache hit on each CPU attention backend
(the native one through the fused decode pass), prefill logits, bfloat16 near float32, a LoRA
adapter against peft's merged model, and the refusals."""

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
from kvflow.models.ernie4_5 import Ernie4_5ForCausalLM
from kvflow.models.registry import causal_lm_class

from conftest import assert_no_leaks

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    from transformers import Ernie4_5Config
    from transformers import Ernie4_5ForCausalLM as HFErnie

    path = tmp_path_factory.mktemp("ernie4_5")
    cfg = Ernie4_5Config(**dict(TINY_DENSE, head_dim=16, tie_word_embeddings=True))
    return str(path), save_tiny_model(path, HFErnie, cfg, seed=2024)


def test_config_reads_as_hf(ernie):
    path, hf = ernie
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    assert causal_lm_class(cfg) is Ernie4_5ForCausalLM
    assert cfg.head_dim == hf.config.head_dim and cfg.rope.rotary_dim(cfg.head_dim) == cfg.head_dim
    with pytest.raises(ValueError, match="use_bias=true .* not supported"):
        ModelConfig.from_hf_config({**raw, "use_bias": True})


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(ernie, backend):
    check_greedy_matches_hf(*ernie, backend)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(ernie, chunk):
    check_prefill_logits_match_hf(*ernie, chunk)


def test_bfloat16_close_to_float32(ernie):
    check_bfloat16_close_to_float32(ernie[0])


def test_lora_matches_peft_merged(ernie, tmp_path, monkeypatch):
    """An adapter on every projection (its q and k rows reordered as the model's): HF's greedy
    tokens with the adapter merged by peft, through the native decode pass."""
    pytest.importorskip("peft")
    from lora_utils import adapter_with_peft_greedy

    from kvflow import LoRARequest

    path, _ = ernie
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    prompts = shared_prefix_prompts(3, 4, 12, seed=7)
    adapter, expected = adapter_with_peft_greedy(path, str(tmp_path / "adapter"), targets, 6, prompts, MAX_TOKENS)
    monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", "native")
    llm = LLM(path, num_kv_blocks=64, max_model_len=64, enable_lora=True, kernel_autotune="off")
    assert llm.engine.runner.model.native_decode is not None
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, adapter))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_no_leaks(llm.engine)
    llm.shutdown()
