"""Batching never changes greedy output: batched vs alone, chunked prefill, preemption, aborts."""

from __future__ import annotations

import random

import pytest

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(1, 60))] for _ in range(16)]


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts):
    llm = LLM(tiny_llama[0], num_kv_blocks=64, max_model_len=128, block_size=4)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _batched(path, prompts, **opts):
    llm = LLM(path, max_model_len=128, **opts)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_no_leaks(llm.engine)
    return [o.outputs[0].token_ids for o in outs], llm


def test_batch_invariance(tiny_llama, prompts, alone):
    got, _ = _batched(tiny_llama[0], prompts, num_kv_blocks=512, block_size=4)
    assert got == alone


def test_chunked_prefill_tiny_budget(tiny_llama, prompts, alone):
    got, llm = _batched(tiny_llama[0], prompts, num_kv_blocks=512, block_size=4, max_num_batched_tokens=7)
    assert got == alone
    assert llm.get_stats().num_steps > sum(len(p) for p in prompts) // 7


def test_preemption_keeps_outputs(tiny_llama, prompts, alone):
    # 40 blocks of 4 tokens: far less than 16 sequences of up to 80 tokens need at once.
    got, llm = _batched(tiny_llama[0], prompts, num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    assert llm.get_stats().num_preemptions > 0
    assert got == alone


def test_max_num_seqs_limits_the_batch(tiny_llama, prompts, alone):
    llm = LLM(tiny_llama[0], max_model_len=128, num_kv_blocks=512, block_size=4, max_num_seqs=3)
    engine = llm.engine
    for p in prompts:
        engine.add_request(None, p, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out.outputs[0].token_ids
        assert engine.scheduler.num_running <= 3
    assert [finished[i] for i in range(len(prompts))] == alone
    assert_no_leaks(engine)


def test_abort_frees_everything(tiny_llama, prompts):
    llm = LLM(tiny_llama[0], max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    ids = [engine.add_request(None, p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts[:8]]
    for _ in range(5):
        engine.step()
    assert engine.kv_cache.usage > 0
    engine.abort(ids[::2])
    while engine.has_unfinished_requests():
        engine.step()
    engine.abort(ids[1::2])  # already finished: a no-op
    assert_no_leaks(engine)


def test_kv_pool_too_small_for_max_model_len(tiny_llama):
    with pytest.raises(ValueError, match=r"max_model_len=128 tokens needs 8 blocks.*num_kv_blocks"):
        LLM(tiny_llama[0], max_model_len=128, num_kv_blocks=7, block_size=16)


def test_n_completions_share_a_prompt(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=128, num_kv_blocks=64)
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_no_leaks(llm.engine)
