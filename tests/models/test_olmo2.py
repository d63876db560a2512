"""OLMo 2 against HF transformers on the same tiny random weights: no input norms, RMSNorm on the
attention and MLP outputs before each residual add, q/k RMSNorm over the whole projections. Greedy
tokens through chunked prefill, preemption and a prefix-cache hit on each CPU attention backend;
prefill logits; bfloat16 near float32; the refusals of what is not there."""

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
from kvflow.config import ModelConfig
from kvflow.layers.linear_kernels import int8_available
from kvflow.models.olmo2 import Olmo2ForCausalLM
from kvflow.models.registry import causal_lm_class

from conftest import assert_no_leaks, hf_greedy
from gguf_files import write_olmo2_gguf

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_olmo2(path, **overrides):
    """A random tiny OLMo 2 (with a tokenizer) saved to `path`, its norms random too (HF initialises
    them to ones, which would hide a norm applied in the wrong place)."""
    from transformers import Olmo2Config
    from transformers import Olmo2ForCausalLM as HFOlmo2

    cfg = dict(TINY_DENSE)
    cfg.update(overrides)
    return save_tiny_model(path, HFOlmo2, Olmo2Config(**cfg), seed=4321)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmo2")
    return str(path), make_olmo2(path)


def test_config_reads_as_hf(olmo2):
    path, hf = olmo2
    cfg = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    assert causal_lm_class(cfg) is Olmo2ForCausalLM
    assert cfg.qk_norm and not cfg.qk_norm_per_head
    attn = hf.model.layers[0].self_attn
    assert attn.q_norm.weight.shape[0] == cfg.num_heads * cfg.head_dim
    assert attn.k_norm.weight.shape[0] == cfg.num_kv_heads * cfg.head_dim
    # (HF's OLMo 2 attends to the whole context, whatever sliding_window a config carries)
    windowed = ModelConfig.from_hf_config({**json.loads((Path(path) / "config.json").read_text()), "sliding_window": 8})
    assert windowed.sliding_window is None and windowed.window_of(0) is None


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(olmo2, backend):
    check_greedy_matches_hf(*olmo2, backend, MAX_TOKENS)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(olmo2, chunk):
    check_prefill_logits_match_hf(*olmo2, chunk)


def test_bfloat16_close_to_float32(olmo2):
    check_bfloat16_close_to_float32(olmo2[0])


def test_refusals(olmo2):
    path, _ = olmo2
    base = json.loads((Path(path) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM with attention_bias=true .* not supported"):
        ModelConfig.from_hf_config({**base, "attention_bias": True})
    with pytest.raises(ValueError, match=r"runs on one rank so far .*tensor_parallel_size=1"):
        from kvflow.distributed.parallel import TPGroup, local_config

        cfg = local_config(ModelConfig.from_hf_config(base), 2)
        Olmo2ForCausalLM(cfg, None, 16, torch.float32, torch.device("cpu"), TPGroup(0, 2, None))
    if int8_available():
        with pytest.raises(ValueError, match=r"int8 quantization does not reach Olmo2ForCausalLM"):
            LLM(path, max_model_len=32, quantization="int8")


def test_gguf_greedy_matches_hf(olmo2, tmp_path):
    """An `olmo2` GGUF (F32) loads as OLMo 2: HF's greedy tokens, through chunked prefill."""
    path, hf = olmo2
    gguf_path = tmp_path / "olmo2.gguf"
    write_olmo2_gguf(gguf_path, path)
    llm = LLM(str(gguf_path), num_kv_blocks=32, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    assert llm.engine.model_config.architecture == "Olmo2ForCausalLM"
    prompts = shared_prefix_prompts(3, 4, 20, seed=5)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)
