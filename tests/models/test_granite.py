"""IBM Granite against HF transformers on the same tiny random weights, with Granite 3's kind of
scalars (embeddings x12, each sublayer's output x0.22, a softmax scale of its own, logits / 8):
greedy tokens through chunked prefill, preemption and a prefix-cache hit on each CPU attention
backend (the native one through the native decode pass), tied and untied embeddings, prefill
logits, bfloat16 near float32; the refusals of what is not there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import (
    TINY_DENSE,
    check_bfloat16_close_to_float32,
    check_greedy_matches_hf,
    check_prefill_logits_match_hf,
    save_tiny_model,
    shared_prefix_prompts,
)

from kvflow import LLM, SamplingParams
from kvflow.attention.backends.cpu import native_unsupported
from kvflow.config import ModelConfig
from kvflow.models.granite import GraniteForCausalLM
from kvflow.models.registry import causal_lm_class

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SCALARS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05, logits_scaling=8.0)


def make_granite(path, **overrides):
    from transformers import GraniteConfig
    from transformers import GraniteForCausalLM as HFGranite

    cfg = dict(TINY_DENSE, **SCALARS)
    cfg.update(overrides)
    return save_tiny_model(path, HFGranite, GraniteConfig(**cfg), seed=2468)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def granite(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("granite")
    return str(path), make_granite(path, tie_word_embeddings=request.param)


def test_config_reads_as_hf(granite):
    path, _ = granite
    cfg = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    assert causal_lm_class(cfg) is GraniteForCausalLM
    assert (cfg.granite.embedding_multiplier, cfg.granite.residual_multiplier) == (12.0, 0.22)
    assert (cfg.granite.attention_multiplier, cfg.granite.logits_scaling) == (0.05, 8.0)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(granite, backend):
    check_greedy_matches_hf(*granite, backend)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(granite, chunk):
    check_prefill_logits_match_hf(*granite, chunk)


def test_bfloat16_close_to_float32(granite):
    check_bfloat16_close_to_float32(granite[0])


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_logprobs_of_every_decode_step_are_hfs(granite, backend):
    """Every step's top logprobs (the logits divided by logits_scaling are what the sampler sees)
    against HF's forward over the same tokens; prefill in one step, then decode steps alone (on the
    native backend: the native decode pass, with Granite's softmax scale)."""
    if backend == "native" and native_unsupported(torch.device("cpu"), torch.float32, 4, 2, 16) is not None:
        pytest.skip("the native kernels cannot be built here")
    path, hf = granite
    prompts = shared_prefix_prompts(3, 10, 14, seed=3)
    llm = LLM(path, num_kv_blocks=64, max_model_len=64, attention_backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        c = out.outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + c.token_ids])).logits[0].double()
        ref = torch.log_softmax(logits, dim=-1)
        for step, entry in enumerate(c.logprobs):
            for token, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[len(prompt) - 1 + step, token].item(), abs=1e-4)


def test_refusals(granite):
    path, _ = granite
    base = json.loads((Path(path) / "config.json").read_text())
    for name in ("attention_bias", "mlp_bias"):
        with pytest.raises(ValueError, match=rf"GraniteForCausalLM with {name}=true is not supported"):
            ModelConfig.from_hf_config({**base, name: True})
    with pytest.raises(ValueError, match=r"logits_scaling must be a finite number > 0"):
        ModelConfig.from_hf_config({**base, "logits_scaling": 0})
