"""kvflow against HF transformers on the same weights: greedy tokens and prefill logits."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks, hf_greedy, kvflow_prefill_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts_for(seed: int, count: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_hf(model_factory, arch):
    path, hf = model_factory(arch)
    llm = LLM(path, num_kv_blocks=64, max_model_len=256)
    prompts = prompts_for(1, 4)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24)
    assert_no_leaks(llm.engine)


def test_llama3_rope_scaling_matches_hf(model_factory):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }
    path, hf = model_factory("llama", rope_parameters=rope)
    llm = LLM(path, num_kv_blocks=64, max_model_len=256)
    prompts = prompts_for(2, 2, 60, 90)  # past original_max_position_embeddings
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24)


def test_linear_rope_scaling_matches_hf(model_factory):
    path, hf = model_factory("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    llm = LLM(path, num_kv_blocks=64, max_model_len=256)
    p = prompts_for(3, 1, 30, 30)[0]
    assert llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, p, 24)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(model_factory, arch, chunk):
    path, hf = model_factory(arch)
    prompt = prompts_for(4, 1, 37, 37)[0]
    ours = kvflow_prefill_logits(path, prompt, chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_unsupported_architecture_is_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path))


def test_missing_model_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"))
