"""Embeddings (LLM.embed, SamplingParams.pooling): pooled final hidden states equal to HF's."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks, hf_embedding


def _prompts(seed: int, count: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _check(outs, prompts, hf, pooling):
    for p, o in zip(prompts, outs, strict=True):
        got = torch.tensor(o.outputs.embedding)
        assert got.shape == (hf.config.hidden_size,)
        assert got.norm().item() == pytest.approx(1.0, abs=1e-5)
        assert torch.allclose(got, hf_embedding(hf, p, pooling), atol=1e-5)
        assert o.prompt_token_ids == p


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_matches_hf(tiny_llama, pooling):
    path, hf = tiny_llama
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, pooling=pooling)
    prompts = _prompts(1, 4)
    _check(llm.embed(prompts, use_tqdm=False), prompts, hf, pooling)
    assert_no_leaks(llm.engine)
    # the per-call override
    other = "mean" if pooling == "last" else "last"
    _check(llm.embed(prompts[:2], pooling=other, use_tqdm=False), prompts[:2], hf, other)
    assert_no_leaks(llm.engine)
    assert not llm.engine.runner._pool_sums


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_chunked_prefill_with_generation(tiny_llama, pooling):
    """A prompt spans several steps (max_num_batched_tokens 16), in the same batches as
    generation requests, which decode as they would alone."""
    path, hf = tiny_llama
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16, enable_prefix_caching=True)
    engine = llm.engine
    prompts = _prompts(2, 3, 30, 60)
    gen_prompts = _prompts(3, 2, 5, 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(gen_prompts, greedy, use_tqdm=False)
    gen_ids = [engine.add_request(None, p, greedy) for p in gen_prompts]
    emb_ids = [engine.add_request(None, p, engine.embedding_params(pooling)) for p in prompts]
    # a second embedding of the first prompt: prefix-cache hits for "last", none for "mean"
    emb_ids.append(engine.add_request(None, prompts[0], engine.embedding_params(pooling)))
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert steps > 4
    for rid, p in zip(emb_ids, [*prompts, prompts[0]]):
        out = finals[rid]
        assert out.error is None and out.outputs[0].token_ids == []
        assert torch.allclose(torch.tensor(out.embedding), hf_embedding(hf, p, pooling), atol=1e-5)
    for rid, ref in zip(gen_ids, alone):
        assert finals[rid].outputs[0].token_ids == ref.outputs[0].token_ids
        assert finals[rid].embedding is None
    assert_no_leaks(engine)
    assert not engine.runner._pool_sums


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_after_preemption(tiny_llama, pooling):
    """Too few blocks for everyone: embedding requests are preempted mid-prefill (decodes grow)
    and recomputed from scratch."""
    path, hf = tiny_llama
    llm = LLM(path, num_kv_blocks=28, block_size=4, max_model_len=96, max_num_batched_tokens=16, pooling=pooling)
    engine = llm.engine
    preempted: list[str] = []
    preempt = engine.scheduler._preempt

    def record(req):
        preempted.append(req.request_id)
        preempt(req)

    engine.scheduler._preempt = record
    prompts = _prompts(4, 6, 40, 80)
    gen = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    gen_ids = [engine.add_request(None, p, gen) for p in _prompts(5, 3, 6, 10)]
    ids = [engine.add_request(None, p, engine.embedding_params()) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(preempted) & set(ids), preempted
    for rid, p in zip(ids, prompts):
        assert torch.allclose(torch.tensor(finals[rid].embedding), hf_embedding(hf, p, pooling), atol=1e-5)
    assert all(len(finals[r].outputs[0].token_ids) == 60 for r in gen_ids)
    assert_no_leaks(engine)
    assert not engine.runner._pool_sums


def test_embed_refuses_bad_input(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, num_kv_blocks=32, max_model_len=128)
    with pytest.raises(ValueError, match="out of range"):
        llm.embed([[3, 10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling"):
        llm.embed([[3, 4]], pooling="max", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling needs n=1"):
        SamplingParams(n=2, pooling="last")
    with pytest.raises(ValueError, match="pooling"):
        LLM(path, num_kv_blocks=32, max_model_len=128, pooling="cls")
    assert_no_leaks(llm.engine)
