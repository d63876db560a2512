"""--max-logprobs (vLLM's): the most top logprobs a request may ask for. Above it a request is
refused naming the option; raised, a request gets that many, each HF's log-softmax of the same
step's logits; -1 is the whole vocabulary. Beam search sizes its steps' requests within it."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.beam_search import BeamSearchParams
from kvflow.config import EngineConfig

from conftest import VOCAB_SIZE, assert_no_leaks


def test_the_limit_is_checked_and_named(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, num_kv_blocks=32, max_model_len=64)
    assert llm.engine.max_logprobs == 20  # (vLLM's default)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name} 21 exceeds max_logprobs 20 .*--max-logprobs"):
            llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2, **{name: 21}), use_tqdm=False)
    with pytest.raises(ValueError, match="needs the top 4 log-probabilities .* at most 3 are available"):
        LLM(path, num_kv_blocks=32, max_model_len=64, max_logprobs=3).beam_search(
            [[3, 4, 5]], BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True)
        )
    assert LLM(path, num_kv_blocks=32, max_model_len=64, max_logprobs=-1).engine.max_logprobs == VOCAB_SIZE
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        EngineConfig(max_logprobs=-2)
    assert_no_leaks(llm.engine)


def test_raised_limit_returns_hfs_top_logprobs(tiny_llama):
    """40 top logprobs per step (above the default), greedy: each step's are the 40 largest of HF's
    log-softmax over the same prefix, to float32 rounding."""
    path, hf = tiny_llama
    llm = LLM(path, num_kv_blocks=32, max_model_len=64, max_logprobs=40)
    prompt = [5, 17, 33, 2, 90, 11]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=40), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    for step, lps in enumerate(out.outputs[0].logprobs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens[:step]])).logits[0, -1].double(), -1)
        top = torch.topk(ref, 40)
        assert set(top.indices.tolist()) <= set(lps)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert lps[t].logprob == pytest.approx(v, abs=1e-4)
    assert_no_leaks(llm.engine)
