"""Prompt logprobs (SamplingParams.prompt_logprobs) against a full forward pass of HF transformers on
the same weights (float32): every prompt token's logprob, rank and top-N, with chunked prefill and
with the prompt already in the prefix cache (a request that asks for them computes its whole prompt)."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every prompt position, float64: row p predicts token p + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def _check(out, hf, top_n: int) -> None:
    prompt = out.prompt_token_ids
    ref = _reference(hf, prompt)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for p in range(1, len(prompt)):
        row, token, got = ref[p - 1], prompt[p], lps[p]
        assert token in got
        assert got[token].logprob == pytest.approx(row[token].item(), abs=2e-4)
        assert got[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(top_n).indices.tolist()
        # the top N (ties aside: their order may differ), ranked 1..N, plus the prompt token
        assert {t for t in got if got[t].rank <= top_n} == set(top)
        assert len(got) == top_n + (token not in top)


@pytest.mark.parametrize("chunk", [1000, 7])
def test_prompt_logprobs_match_a_full_forward(model_factory, chunk):
    path, hf = model_factory("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (1, 2, 23, 40)]
    # chunk 7: every prompt longer than 7 tokens is computed over several steps
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        _check(o, hf, 4)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)
    assert_no_leaks(llm.engine)


def test_prompt_logprobs_with_the_prompt_cached_and_n(model_factory):
    path, hf = model_factory("llama")
    prompt = list(range(3, 3 + 50))
    llm = LLM(path, num_kv_blocks=64, max_model_len=256)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # now cached
    [out] = llm.generate([prompt], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=4, prompt_logprobs=0))
    _check(out, hf, 0)
    assert len(out.outputs) == 2
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"prompt_logprobs": -1}, "prompt_logprobs must be an integer >= 0"),
        ({"prompt_logprobs": 2, "pooling": "last"}, "cannot be combined with pooling"),
        ({"prompt_logprobs": 1, "kv_transfer_params": {"do_remote_prefill": True}}, "remote prefill"),
    ],
)
def test_bad_prompt_logprobs(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)
