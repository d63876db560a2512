"""Speculative decoding in the engine: outputs exactly those of plain decoding (greedy: the same
tokens; seeded random: reproducible), under batching, chunked prefill, preemption and prefix hits;
the speculation length adapts and switches off when drafts do not pay."""

from __future__ import annotations

import itertools
import random

import pytest

from kvflow import LLM, SamplingParams
from kvflow.attention.backend import DECODE_LIKE_ROWS
from kvflow.config import SpeculativeConfig
from kvflow.core.request import Request
from kvflow.core.step_cost import DecodePass, StepCostModel
from kvflow.spec_decode import speculator as speculator_module
from kvflow.spec_decode.ngram_proposer import NgramBatchProposer
from kvflow.spec_decode.speculator import Speculator

from conftest import assert_no_leaks, hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repetitive prompts: prompt lookup finds matches, so drafts are proposed and some accepted.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "hello world hello world hello world hello",
    "Paris is the capital of France. Berlin is the capital of Germany. Paris is the capital of",
    "def hello(name):\n    return f'hello {name}'\n\ndef hello(name):\n",
    "Once upon a time there was a little engine. Once upon a time",
]


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [c.token_ids for o in outs for c in o.outputs]


SELF_DRAFT = {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3}


def spec_llm(path: str, config: dict | None = None, **kw) -> LLM:
    return LLM(model=path, speculative_config={**(config or NGRAM), "adaptive": False}, **kw)


def method_configs(model_factory, arch: str) -> dict[str, dict]:
    # a smaller random model of the same family and vocabulary as the draft
    small, _ = model_factory(
        arch, num_hidden_layers=1, hidden_size=32, intermediate_size=64, **({"head_dim": 8} if arch == "qwen3" else {})
    )
    return {
        "ngram": NGRAM,
        "self-draft int8": SELF_DRAFT,
        "draft model": {"method": "draft_model", "model": small, "num_speculative_tokens": 3},
    }


# (the MoE families: a routed model verifies drafts through its experts, and its smaller draft
# model of the same family routes too)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe"])
def test_greedy_identical_to_plain_and_hf(model_factory, arch):
    path, hf = model_factory(arch)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain_llm = LLM(model=path, num_kv_blocks=256)
    plain = generate(plain_llm, PROMPTS, sp)
    assert plain[0] == hf_greedy(hf, plain_llm.tokenizer(PROMPTS[0])["input_ids"], 48)
    for name, config in method_configs(model_factory, arch).items():
        llm = spec_llm(path, config, num_kv_blocks=256)
        assert generate(llm, PROMPTS, sp) == plain, name
        stats = llm.engine.speculator.stats
        assert stats.num_draft_tokens > 20, (name, stats)  # speculation really ran
        if name != "draft model":  # (a random small model's drafts are rarely right)
            assert stats.num_accepted_tokens > 5, (name, stats)
        assert_no_leaks(llm.engine)
        proposer = llm.engine.speculator.proposer
        if hasattr(proposer, "kv"):  # the draft's own KV pool is empty again too
            assert proposer.kv.pool.num_free_blocks == proposer.kv.pool.num_blocks and not proposer.seqs


def test_greedy_under_chunking_preemption_and_prefix_hits(tiny_llama):
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS + [p + " again" for p in PROMPTS]  # shared prefixes: prefix-cache hits
    plain = generate(LLM(model=path, num_kv_blocks=256), prompts, sp)
    for config in (NGRAM, SELF_DRAFT):
        # a small pool and budget: chunked prefill and preemption while drafts are in flight
        llm = spec_llm(path, config, num_kv_blocks=40, block_size=4, max_num_batched_tokens=24, max_model_len=160)
        assert generate(llm, prompts, sp) == plain
        e = llm.engine
        assert e.scheduler.num_preemptions > 0 and e.kv_cache.prefix_stats.hits > 0
        assert e.speculator.stats.num_accepted_tokens > 0
        assert_no_leaks(e)
        # and again on the warm prefix cache: hashes registered while drafts were in flight are right
        assert generate(llm, prompts, sp) == plain


def test_stops_max_tokens_logprobs_n(tiny_llama):
    path, _ = tiny_llama
    plain, spec = LLM(model=path, num_kv_blocks=256), spec_llm(path, num_kv_blocks=256)
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = generate(plain, PROMPTS[:1], base)[0]
    # a stop token inside an accepted run ends the request there; max_tokens is exact
    stop_tok = ref[17]
    for params in (
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
    ):
        a, b = (
            plain.generate(PROMPTS[:1], params, use_tqdm=False)[0],
            spec.generate(PROMPTS[:1], params, use_tqdm=False)[0],
        )
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert a.outputs[0].text == b.outputs[0].text
    # stop strings
    text = plain.generate(PROMPTS[:1], base, use_tqdm=False)[0].outputs[0].text
    stop = text[10:14]
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    a, b = (
        plain.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0],
        spec.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0],
    )
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
        b.text,
        b.token_ids,
        b.finish_reason,
        b.stop_reason,
    )
    # logprobs of the emitted tokens equal plain decoding's
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    a, b = plain.generate(PROMPTS, p, use_tqdm=False), spec.generate(PROMPTS, p, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for da, db in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert da.keys() == db.keys()
            for t in da:
                assert da[t].logprob == pytest.approx(db[t].logprob, abs=1e-4) and da[t].rank == db[t].rank
    # n > 1, penalties and min_tokens (which never speculate) give plain decoding's output
    p = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
    assert generate(plain, PROMPTS[:2], p) == generate(spec, PROMPTS[:2], p)
    p = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, min_tokens=5)
    assert generate(plain, PROMPTS, p) == generate(spec, PROMPTS, p)
    assert_no_leaks(spec.engine)


@pytest.mark.parametrize("config", [NGRAM, SELF_DRAFT], ids=["ngram", "self-draft"])
def test_seeded_sampling_is_reproducible(tiny_llama, config):
    path, _ = tiny_llama
    p = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=30, ignore_eos=True) for s in range(5)]
    runs = [generate(spec_llm(path, config, num_kv_blocks=256), PROMPTS, p) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == len(PROMPTS)


def test_draft_model_must_share_the_vocabulary(model_factory, tiny_llama):
    other, _ = model_factory("llama", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(
            model=tiny_llama[0],
            speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 2},
        )


def test_adaptive_turns_rejected_drafts_off(tiny_llama):
    """A draft that is always wrong: the speculation length goes to 0, the output stays exact."""
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = generate(LLM(model=path, num_kv_blocks=256), PROMPTS[:2], sp)
    llm = LLM(model=path, num_kv_blocks=256, speculative_config={**NGRAM, "adaptive": True})
    spec = llm.engine.speculator
    vocab = llm.engine.model_config.vocab_size
    refs = {tuple(t) for t in plain}

    class Wrong:  # proposes a token the greedy continuation never holds, as if after a 4-gram match
        def lookup(self, token_ids, k):
            bad = next(t for t in range(vocab - 1, 0, -1) if all(t not in r for r in refs))
            return [bad] * k, 4

    spec.proposer = NgramBatchProposer(Wrong())
    drafts_per_step = []
    orig = spec.observe

    def observe(sched, sampled):
        drafts_per_step.append(sum(len(s.spec_token_ids) for s in sched.seqs))
        orig(sched, sampled)

    spec.observe = observe
    assert generate(llm, PROMPTS[:2], sp) == plain
    assert sum(drafts_per_step[:5]) > 0  # it tried
    assert sum(drafts_per_step[-24:]) <= 3  # and stopped: one probing draft every 8 steps at most
    assert spec.stats.num_accepted_tokens == 0


def test_draft_pass_timed_before_the_first_request(tiny_llama):
    """A draft model's pass is timed at start-up (its probe's blocks returned), so the first plan
    already weighs it: a draft pass dearer than the gain (here: faked 20x the target's step) gets no
    draft from the very first decode step, not after the first requests' catch-up prefills."""
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = generate(LLM(model=path, num_kv_blocks=64), PROMPTS[:2], sp)
    llm = LLM(model=path, num_kv_blocks=64, speculative_config={**SELF_DRAFT, "adaptive": True})
    spec = llm.engine.speculator
    proposer = spec.proposer
    assert len(proposer.cost.samples) == 2 and all(t > 0 for *_, t in proposer.cost.samples)
    assert proposer.kv.pool.num_free_blocks == proposer.kv.pool.num_blocks and not proposer.seqs
    # the same pass as measured, but 20x the target's step as the engine measures it
    target = StepCostModel()
    for tokens in (1, 2, 4, 8, 16):
        target.observe(tokens, 0.001 + 0.0001 * tokens)
    spec.cost = target
    proposer.cost = StepCostModel()
    for _ in range(2):
        proposer.cost.observe(1, 0.020)
    ran = []
    orig = proposer.runner.execute
    proposer.runner.execute = lambda out: ran.append(out) or orig(out)
    assert generate(llm, PROMPTS[:2], sp) == plain
    assert not ran and spec.stats.num_drafts == 0
    assert_no_leaks(llm.engine)


def _request(rid: str, n_out: int = 5) -> Request:
    r = Request(rid, rid, 0, [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=100), 100, 0.0)
    r.output_token_ids = [1] * n_out
    r.num_computed_tokens = r.num_tokens - 1
    return r


def _assume(spec: Speculator, request_id: str, rate: float) -> None:
    """Every draft of the request accepted with `rate` given the one before (first draft included)."""
    spec.acceptance.first_by_request[request_id] = rate
    spec.acceptance.continuation[request_id] = rate


def test_plan_switches_off_at_large_batch():
    """Fake cost model: a pass costs a = 10 ms, each token b = 0.5 ms (a CPU: weights dominate
    at batch 1, per-token work at batch 64)."""
    cost = StepCostModel()
    for tokens, chunks in ((1, 0), (2, 1), (8, 2), (16, 0), (32, 4), (64, 1), (4, 3), (40, 0), (20, 2), (9, 1)):
        cost.observe(tokens, 0.010 + 0.0005 * tokens + 0.002 * chunks, chunks)
    a, b, c, m, *_ = cost.coefficients
    assert a == pytest.approx(0.010, rel=0.05) and b == pytest.approx(0.0005, rel=0.05)
    assert c + m == pytest.approx(0.002, rel=0.2)  # (one multi-token sequence: c + m)
    spec = Speculator(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5}), cost=cost)
    for rid in ("x",) + tuple(f"r{i}" for i in range(64)):
        _assume(spec, rid, 0.7)
    one = [_request("x")]
    plan = spec._plan(one, {"x": 5})
    assert plan["x"] == 5  # batch 1: every draft pays
    many = [_request(f"r{i}") for i in range(64)]
    plan = spec._plan(many, {r.request_id: 5 for r in many})
    assert sum(plan.values()) == 0  # batch 64: no draft beats the step's own tokens per second
    _assume(spec, "x", 0.01)
    assert spec._plan(one, {"x": 5})["x"] <= 1  # hopeless drafts get (almost) nothing


def _costly_chunks() -> StepCostModel:
    """A fitted cost model: a pass 10 ms, a token 0.5 ms, a multi-token sequence off the decode
    pass 4 ms more (the per-layer path)."""
    cost = StepCostModel()
    for tokens, chunks in ((1, 0), (2, 1), (8, 2), (16, 0), (32, 4), (64, 1), (4, 3), (40, 0), (20, 2), (9, 1)):
        cost.observe(tokens, 0.010 + 0.0005 * tokens + 0.004 * chunks, chunks)
    return cost


def test_plan_counts_drafts_on_the_decode_pass_as_rows():
    """At batch 8 a first draft that makes its request a chunk (b + c + m) does not pay; on the
    decode pass, where a verification row is one more row (b), drafts pay until the step would
    leave the pass (max_rows), where the chunks' cost comes back."""
    cost = _costly_chunks()
    a, b, c, m, *_ = cost.coefficients
    assert a == pytest.approx(0.010, rel=0.05)
    assert b == pytest.approx(0.0005, rel=0.05) and c + m == pytest.approx(0.004, rel=0.2)
    spec = Speculator(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4}), cost=cost)
    batch = [_request(f"r{i}") for i in range(8)]
    for r in batch:
        _assume(spec, r.request_id, 0.8)
    limits = {r.request_id: 4 for r in batch}
    # off the pass: gain x T = 0.8 x (a + 8b) = 11.2 ms < (b + c + m) x E = 4.5 ms x 8
    assert sum(spec._plan(batch, limits).values()) == 0
    cost.decode_pass = DecodePass(rows_per_seq=8, max_rows=64)
    # on it a draft costs b: depth 1 (0.8 x 14 ms > 0.5 ms x 8, and on), depth 2 (0.64 x 18 > 0.5 x
    # 14.4), depth 3 (0.512 x 22 > 0.5 x 19.5) pay; depth 4 does not (0.41 x 26 < 0.5 x 23.6)
    assert spec._plan(batch, limits) == dict.fromkeys(limits, 3)
    cost.decode_pass = DecodePass(rows_per_seq=8, max_rows=10)  # two drafts, then the per-layer path
    assert sum(spec._plan(batch, limits).values()) == 2
    cost.decode_pass = DecodePass(rows_per_seq=2, max_rows=64)  # a second draft would leave the pass
    assert spec._plan(batch, limits) == dict.fromkeys(limits, 1)


def test_plan_gives_no_share_to_requests_without_a_match():
    """Prompt lookup is asked before the plan is final: of 8 decoding requests only the 4 whose
    text repeats get drafts, and they get the depth the step can afford for 4 (all 4 drafts here),
    where a plan over all 8 gave each 3 (the previous test's figures) and half of them went unused."""
    cost = _costly_chunks()
    cost.decode_pass = DecodePass(rows_per_seq=8, max_rows=64)
    spec = Speculator(
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}),
        cost=cost,
    )
    batch = []
    for i in range(8):
        base = 100 * (i + 1)
        prompt = [base + j for j in range(8)]
        r = Request(f"r{i}", f"r{i}", 0, prompt, SamplingParams(max_tokens=100), 100, 0.0)
        # even requests end on their prompt's first three tokens (a match, 4 tokens follow); odd ones on new text
        r.output_token_ids = prompt[:3] if i % 2 == 0 else [base + 50, base + 51, base + 52]
        r.num_computed_tokens = r.num_tokens - 1
        _assume(spec, r.request_id, 0.8)
        batch.append(r)
    spec.acceptance.first_by_evidence[2] = 0.8  # first drafts after a 2-gram match (the even requests')
    assert spec._plan(batch, {r.request_id: 4 for r in batch}) == {r.request_id: 3 for r in batch}
    spec.propose(batch)
    for i, r in enumerate(batch):
        assert r.spec_token_ids == ([100 * (i + 1) + j for j in range(3, 7)] if i % 2 == 0 else []), i


def _tiled_machine(rows: int) -> float:
    """A step on a pass whose kernels compute 8 rows per pass over the weights: 5 ms, 0.5 ms a row,
    and 2 ms for each pass beyond the first (a ninth row costs 2.5 ms, a tenth 0.5 ms)."""
    return 0.005 + 0.0005 * rows + 0.002 * ((rows - 1) // 8)


def _tiled_cost() -> StepCostModel:
    cost = StepCostModel()
    cost.decode_pass = DecodePass(rows_per_seq=16, max_rows=64, tile_rows=8)
    for rows in (1, 2, 4, 8, 9, 12, 16, 17, 24, 32, 40, 5, 8, 10, 16, 20, 33, 48, 8, 9):
        cost.observe(rows, _tiled_machine(rows))
    return cost


def test_step_cost_learns_the_tiles():
    cost = _tiled_cost()
    a, b, *_, t = cost.coefficients
    assert (a, b, t) == pytest.approx((0.005, 0.0005, 0.002), rel=0.05)
    for rows in (3, 8, 9, 15, 16, 17, 30, 64):
        assert cost.predict(rows) == pytest.approx(_tiled_machine(rows), rel=0.02)
    assert cost.tiles(9, chunks=1) == 0  # off the pass: no tiles counted
    assert cost.tiles(65, chunks=0) == 0  # more rows than the pass takes


@pytest.mark.parametrize("rates", [(0.8,), (0.9,) * 8, (0.95, 0.95, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3), (0.99,) * 3])
def test_plan_judges_a_tile_as_a_whole(rates):
    """Batch 8 on a tiled pass: the plan's goodput ((tokens expected) / (step time)) against the
    best allocation found by trying every one (each request 0-3 drafts), under the same cost model.
    One 0.8 draft opening a second tile does not pay; eight 0.9 drafts filling it do, where judging
    each draft alone (2.5 ms for the first) would have refused them all."""
    cost = _tiled_cost()
    spec = Speculator(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}), cost=cost)
    batch = [_request(f"r{i}") for i in range(8)]
    for r, rate in zip(batch, rates):
        _assume(spec, r.request_id, rate)
    limits = {r.request_id: 3 if i < len(rates) else 0 for i, r in enumerate(batch)}

    def goodput(plan: dict[str, int]) -> float:
        gain = sum(
            spec.acceptance.gain(rid, None, 1)
            * (1 - spec.acceptance.continuation[rid] ** n)
            / (1 - spec.acceptance.continuation[rid])
            for rid, n in plan.items()
            if n
        )
        rows = len(batch) + sum(plan.values())
        return (len(batch) + gain) / cost.predict(rows, 0, sum(r.num_tokens for r in batch) + sum(plan.values()))

    ids = [r.request_id for r in batch[: len(rates)]]
    best = max(goodput(dict(zip(ids, counts))) for counts in itertools.product(range(4), repeat=len(ids)))
    plan = spec._plan(batch, limits)
    assert goodput(plan) >= 0.99 * best, (plan, goodput(plan), best)
    if rates == (0.8,):
        assert sum(plan.values()) == 0
    if rates == (0.9,) * 8:
        assert sum(plan.values()) >= 8


def test_shape_predictor_is_predict():
    """The planner's bound predictor prices a step shape as `predict` does on its features, on and
    off a tiled decode pass, and the window the fit reads keeps the last steps in order."""
    cost = _tiled_cost()
    cost.decode_pass = DecodePass(rows_per_seq=4, max_rows=16, tile_rows=8)
    for rows in (1, 3, 20, 40):
        cost.observe(
            rows,
            _tiled_machine(rows) + 0.004 * (rows > 16),
            chunks=2 if rows > 16 else 0,
            context=50 * rows,
            pairs=999 * rows,
        )
    seconds = cost.shape_predictor()
    rng = random.Random(0)
    for _ in range(300):
        rows = rng.randrange(1, 40)
        longest = rng.randrange(1, min(rows, 8) + 1)
        multi = 0 if longest == 1 else rng.randrange(1, rows // longest + 1)
        context, pairs = rng.randrange(rows, 5000), rng.randrange(0, 10**6)
        chunks = cost.chunks(rows, longest, multi)
        assert seconds(rows, longest, multi, context, pairs) == pytest.approx(
            cost.predict(rows, chunks, context, pairs if chunks else 0), rel=1e-12
        )
    small = StepCostModel(window=16)
    for i in range(40):
        small.observe(i + 1, 0.01 + i * 1e-4, chunks=i % 3, context=7 * i, pairs=11 * i)
    assert [s[0] for s in small.samples] == list(range(25, 41)) and small.num_samples == 40
    assert small.samples[-1] == (40, 39 % 3, 7 * 39, 11 * 39, 0, pytest.approx(0.01 + 39e-4))


class _CountingLookup:
    """Prompt lookup that always finds `k` drafts after a 2-gram match, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def lookup(self, token_ids, k):
        self.calls += 1
        return [7] * k, 2


def test_declined_drafts_turn_lookups_off_between_checks():
    """Once the plan declines every draft found, the steps in between checks cost no lookup and no
    plan: lookups run every _PROBE_EVERY steps, each such check giving one request a probing draft
    (in turn), and the first check whose plan gives drafts turns speculation back on for every step.
    Steps where no request is decoding do not turn it off."""
    cost = _costly_chunks()
    cost.decode_pass = DecodePass(rows_per_seq=8, max_rows=64)
    spec = Speculator(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}), cost=cost)
    lookup = _CountingLookup()
    spec.proposer = NgramBatchProposer(lookup)
    batch = [_request(f"r{i}") for i in range(4)]
    spec.propose([])  # nothing decoding: not a decline
    assert spec._steps_off == 0
    spec.acceptance.first_by_evidence[2] = 0.01  # 2-gram matches never pay
    drafted, looked = [], []
    for _ in range(3 * speculator_module._PROBE_EVERY):
        before = lookup.calls
        spec.propose(batch)
        looked.append(lookup.calls > before)
        drafted.append([r.request_id for r in batch if r.spec_token_ids])
    every = speculator_module._PROBE_EVERY
    assert looked == ([True] + [False] * (every - 1)) * 3
    assert drafted[0] == [] and all(d == [] for i, d in enumerate(drafted) if i % every)
    probes = [drafted[i] for i in range(every, 3 * every, every)]
    assert all(len(p) == 1 for p in probes) and probes[0] != probes[1]  # one probe per check, in turn
    assert all(len(r.spec_token_ids) <= 1 for r in batch)
    spec.acceptance.first_by_evidence[2] = 0.9  # now they pay: the next check turns it back on
    results = []
    for _ in range(every + 2):
        before = lookup.calls
        spec.propose(batch)
        results.append((lookup.calls > before, sum(len(r.spec_token_ids) for r in batch)))
    on = next(i for i, (was_looked_up, _) in enumerate(results) if was_looked_up)
    assert all(was_looked_up and n > len(batch) for was_looked_up, n in results[on:])


class _DearDraftModel:
    """A draft model's proposer whose pass costs 1 s: no draft ever pays. Counts proposals."""

    def __init__(self) -> None:
        self.cost = StepCostModel()
        self.cost.observe(1, 1.0)
        self.asked: list[dict[str, int]] = []

    def propose(self, requests, plan):
        self.asked.append(dict(plan))
        return {}

    def observe(self, sched, sampled) -> None:
        pass

    def release(self, request_ids) -> None:
        pass


def test_a_draft_model_off_is_planned_only_at_checks():
    """With a draft model, a plan that declines every draft also turns speculation off until the
    next check: the plan runs every _PROBE_EVERY steps, and no probe is given (a probe would cost
    the draft model a prefill)."""
    spec = Speculator(
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 3, "quantization": "int8"}),
        proposer=_DearDraftModel(),
        cost=_costly_chunks(),
    )
    plans = []
    plan = spec._plan
    spec._plan = lambda *a, **k: plans.append(1) or plan(*a, **k)
    batch = [_request(f"r{i}") for i in range(2)]
    every = speculator_module._PROBE_EVERY
    for _ in range(3 * every):
        spec.propose(batch)
    assert len(plans) == 3 and not any(r.spec_token_ids for r in batch)
    assert all(not any(p.values()) for p in spec.proposer.asked)


def test_step_cost_chunks_on_and_off_the_decode_pass():
    cost = StepCostModel()
    assert cost.chunks(rows=9, longest=5, multi=2) == 2  # no pass: every multi-token sequence
    cost.decode_pass = DecodePass(rows_per_seq=8, max_rows=16)
    assert cost.chunks(rows=9, longest=5, multi=2) == 0  # verification rows in the pass
    assert cost.chunks(rows=17, longest=5, multi=2) == 2  # too many rows for it
    assert cost.chunks(rows=12, longest=9, multi=1) == 1  # a prefill chunk of 9: the per-layer path


def test_engine_counts_verifying_steps_in_the_pass_as_rows(tiny_llama):
    """The engine takes the runner's decode pass, and the steps that verified drafts in it are
    observed without chunks (the int8 backend always runs its steps through the pass)."""
    path, _ = tiny_llama
    llm = spec_llm(path, num_kv_blocks=256, quantization="int8")
    engine = llm.engine
    fused = engine.runner.model.native_decode
    assert fused is not None and engine.step_cost.decode_pass == DecodePass(DECODE_LIKE_ROWS, fused.max_rows)
    generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert engine.speculator.stats.num_draft_tokens > 20
    samples = list(engine.step_cost.samples)  # (tokens, chunks, context, pairs, tiles, seconds)
    verifying = [s for s in samples if 1 < s[0] <= len(PROMPTS) * (1 + NGRAM["num_speculative_tokens"])]
    assert verifying and all(s[1] == 0 for s in verifying if s[0] > len(PROMPTS))
    assert any(s[1] > 0 for s in samples)  # the prompts' prefill chunks still count
    plain = LLM(model=path, num_kv_blocks=64, attention_backend="torch").engine
    assert plain.runner.model.native_decode is None and plain.step_cost.decode_pass == DecodePass()


def test_config_errors():
    with pytest.raises(ValueError, match="method"):
        LLM(model=None, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown speculative_config key"):
        LLM(model=None, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "gamma": 3})


@pytest.mark.server
def test_server_streams_several_tokens_a_step(tiny_llama):
    import httpx

    from kvflow.config import EngineConfig, ServerConfig

    from server_utils import LiveServer, parse_metrics

    s = LiveServer(
        EngineConfig(model=tiny_llama[0], num_kv_blocks=256, speculative_config={**NGRAM, "adaptive": False}),
        ServerConfig(),
    )
    try:
        client = s.openai()
        kw = dict(model=s.model, prompt=PROMPTS[0], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        full = client.completions.create(**kw).choices[0].text
        chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
        assert "".join(chunks) == full
        m = parse_metrics(httpx.get(s.url + "/metrics").text)
        assert m["kvflow:spec_decode_num_draft_tokens_total"] > 0
        assert m["kvflow:spec_decode_num_accepted_tokens_total"] > 0
        assert m['kvflow:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
        s.wait_engine_idle()
    finally:
        s.stop()


@pytest.mark.slow
def test_default_model_self_draft_greedy_is_fp32_greedy():
    """The embedded SmolLM2-135M in float32: its int8 copy drafting for it changes nothing in greedy
    output. (On the GGUF's own blocks the verification pass, a chunk through the prefill attention,
    rounds differently from a decode step, and quantizing activations turns that into different
    tokens at near-ties: exact in distribution, not bit for bit.)"""
    chats = [
        [{"role": "user", "content": q}]
        for q in (
            "What is the capital of France?",
            "Write a haiku about autumn.",
            "Repeat exactly: the quick brown fox jumps over the lazy dog.",
        )
    ]
    sp = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(max_model_len=1024, num_kv_blocks=256, gguf_weights="dequantize")
    ref = [o.outputs[0].token_ids for o in plain.chat(chats, sp, use_tqdm=False)]
    del plain
    llm = LLM(
        max_model_len=1024,
        num_kv_blocks=256,
        gguf_weights="dequantize",
        speculative_config={**SELF_DRAFT, "num_speculative_tokens": 4, "adaptive": False},
    )
    got = [o.outputs[0].token_ids for o in llm.chat(chats, sp, use_tqdm=False)]
    assert got == ref
    stats = llm.engine.speculator.stats
    assert stats.acceptance_rate > 0.5, stats  # the int8 copy agrees with fp32 most of the time


def test_greedy_with_the_cpu_offload_tier(tiny_llama):
    """Evicted prefix blocks go to the CPU tier and come back while drafts are in flight."""
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [p + " " + q for p in PROMPTS for q in ("once", "twice")]
    plain = generate(LLM(model=path, num_kv_blocks=256), prompts, sp)
    llm = spec_llm(path, num_kv_blocks=48, block_size=4, max_model_len=160, kv_offload_cpu_gb=0.01)
    for _ in range(2):  # the second pass finds the prompts in the tier
        assert generate(llm, prompts, sp) == plain
    offload = llm.engine.get_stats().kv_offload
    assert offload is not None and offload.loaded > 0, offload
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    assert_no_leaks(llm.engine)


def test_deep_drafts_verify_in_the_decode_pass_on_a_bf16_model(tiny_llama, monkeypatch):
    """A bfloat16 model's decode pass keeps activations in float32 where the per-layer path rounds
    them to bf16: a verifying step that left the pass would round differently from the decodes it
    replaces. Up to DECODE_LIKE_ROWS - 1 drafts a request stay in the pass (the native backend
    forced: the pass takes any number of rows, as with GGUF blocks)."""
    monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", "native")
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain_llm = LLM(model=path, dtype="bfloat16", num_kv_blocks=256)
    assert plain_llm.engine.step_cost.decode_pass is not None  # (else the test shows nothing)
    plain = generate(plain_llm, PROMPTS, sp)
    k = DECODE_LIKE_ROWS - 1
    llm = spec_llm(path, {**SELF_DRAFT, "num_speculative_tokens": k}, dtype="bfloat16", num_kv_blocks=256)
    assert generate(llm, PROMPTS, sp) == plain
    stats = llm.engine.speculator.stats
    assert stats.accepted_per_pos[k - 1] > 0  # verifying steps really held k drafts, some all accepted
    assert_no_leaks(llm.engine)
