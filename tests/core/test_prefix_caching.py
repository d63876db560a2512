"""Automatic prefix caching: same greedy output on and off, shared blocks, consistent books."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BS = 4


def _workload() -> list[list[int]]:
    rng = random.Random(11)
    system = [rng.randrange(2, 500) for _ in range(16)]  # 4 full blocks
    prompts = []
    for cut in (16, 15, 17, 8, 3):  # at a block boundary, mid-block, one past, shorter prefixes
        for _ in range(2):
            prompts.append(system[:cut] + [rng.randrange(2, 500) for _ in range(rng.randint(1, 9))])
    prompts += [system[:], system[:], system[:12]]  # identical prompts; a prompt that is all cached
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=64, num_kv_blocks=256, block_size=BS, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in _workload()]


def _run(llm, prompts, aborts=()):
    engine = llm.engine
    ids = [engine.add_request(None, p, GREEDY) for p in prompts]
    done, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for i in aborts:
            if step == 3:
                engine.abort(ids[i])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done.get(i) for i in ids]


@pytest.mark.parametrize(
    "opts",
    [
        dict(num_kv_blocks=256),
        dict(num_kv_blocks=40, max_num_batched_tokens=24),
        dict(num_kv_blocks=256, max_num_batched_tokens=5),
    ],
    ids=["roomy", "preempting", "chunked"],
)
def test_same_output_with_caching(tiny_llama, reference, opts):
    llm = LLM(tiny_llama[0], max_model_len=64, block_size=BS, **opts)
    prompts = _workload()
    # Twice: the second pass finds everything the first one left in the cache.
    for _ in range(2):
        outs = _run(llm, prompts)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert_cached_free_only(llm.engine)
    stats = llm.get_stats()
    assert stats.prefix_cache_hits > 0
    if opts["num_kv_blocks"] == 40:
        assert stats.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in outs)


def test_aborts_interleaved(tiny_llama, reference):
    llm = LLM(tiny_llama[0], max_model_len=64, block_size=BS, num_kv_blocks=48, max_num_batched_tokens=24)
    prompts = _workload()
    aborted = {1, 4, 11}
    outs = _run(llm, prompts, aborts=aborted)
    for i, (o, ref) in enumerate(zip(outs, reference)):
        if i not in aborted:
            assert o.outputs[0].token_ids == ref
    assert_cached_free_only(llm.engine)


def test_identical_prompts_and_n_share_blocks(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=64, block_size=BS, num_kv_blocks=64)
    engine = llm.engine
    prompt = list(range(10, 42))  # 8 full blocks
    engine.add_request(None, prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True))
    engine.step()  # all four children admitted in one step
    tables = [engine.kv_cache.block_tables[f"0#{i}"] for i in range(4)]
    # The prompt's 7 shareable full blocks (the last token is always computed) are one set of blocks.
    assert all(t[:7] == tables[0][:7] for t in tables)
    assert engine.kv_cache.pool.ref_counts[tables[0][0]] == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert_cached_free_only(engine)


def test_caching_off_never_hits(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=64, block_size=BS, num_kv_blocks=64, enable_prefix_caching=False)
    _run(llm, [list(range(2, 30))] * 3)
    s = llm.get_stats()
    assert s.prefix_cache_hits == 0 and s.kv_memory.blocks_cached_free == 0


def test_lru_eviction_keeps_recent_prefixes(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=64, block_size=BS, num_kv_blocks=24)
    a, b = list(range(100, 120)), list(range(200, 220))
    _run(llm, [a])
    _run(llm, [b])
    pool = llm.engine.kv_cache.pool
    before = pool.num_evicted
    # A third prompt needs more blocks than are truly free: the oldest (a's) are evicted first.
    _run(llm, [list(range(300, 340))])
    assert pool.num_evicted > before
    hits = llm.get_stats().prefix_cache_hits
    _run(llm, [b])
    assert llm.get_stats().prefix_cache_hits > hits  # b, more recent, survived


def assert_cached_free_only(engine) -> None:
    """Between workloads every block is free or cached-free (nothing held), books consistent."""
    assert_no_leaks(engine)
    mem = engine.get_stats().kv_memory
    assert mem.blocks_in_use == 0
    assert mem.blocks_free + mem.blocks_cached_free == engine.kv_cache.pool.num_blocks


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 10**6)), min_size=5, max_size=60)
)
def test_books_balance_under_random_traffic(tiny_llama, ops):
    llm = _property_llm(tiny_llama[0])
    engine = llm.engine
    live: list[str] = []
    prefixes = [list(range(2, 14)), list(range(50, 70)), [7] * 9]
    for op, x in ops:
        if op == "add":
            rng = random.Random(x)
            prompt = prefixes[x % 3][: rng.randint(1, 20)] + [rng.randrange(2, 500) for _ in range(rng.randint(0, 6))]
            params = SamplingParams(
                n=rng.choice([1, 1, 2]), temperature=0.0, max_tokens=rng.randint(1, 10), ignore_eos=True
            )
            live.append(engine.add_request(None, prompt, params))
        elif op == "step":
            engine.step()
        elif live:
            engine.abort(live.pop(x % len(live)))
        engine.kv_cache.pool.check_consistency()
        held = sum(len(t) for t in engine.kv_cache.block_tables.values())
        assert held >= engine.kv_cache.pool.num_blocks - engine.kv_cache.pool.num_free_blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert_cached_free_only(engine)


_LLMS: dict = {}


def _property_llm(path):
    # One engine for all examples (start-up dominates otherwise); each example drains it.
    if path not in _LLMS:
        _LLMS[path] = LLM(
            path, max_model_len=48, block_size=BS, num_kv_blocks=30, max_num_batched_tokens=16, max_num_seqs=6
        )
    return _LLMS[path]


def test_kv_accounting_waste_within_last_block(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=64, block_size=BS, num_kv_blocks=128, max_num_batched_tokens=20)
    engine = llm.engine
    rng = random.Random(5)
    for _ in range(10):
        prompt = [rng.randrange(2, 500) for _ in range(rng.randint(3, 30))]
        engine.add_request(None, prompt, SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        mem = engine.get_stats().kv_memory
        running = engine.scheduler.running
        held = {b for r in running for b in engine.kv_cache.block_tables[r.request_id]}
        assert mem.blocks_in_use == len(held)
        assert mem.tokens_stored == sum(r.num_computed_tokens for r in running)  # no sharing here
        assert mem.token_slots_held - mem.tokens_stored <= len(running) * (BS - 1)
        assert mem.blocks_in_use + mem.blocks_cached_free + mem.blocks_free == 128
    stats = engine.get_stats()
    assert 0 < stats.kv_utilization_contiguous_mean < stats.kv_utilization_mean <= 1
