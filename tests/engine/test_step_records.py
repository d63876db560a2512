"""Step records and diagnosis: a request is explained by the steps it waited through (whose
prefill chunks, preemptions), and the ring stays bounded."""

from __future__ import annotations

import random

from kvflow import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


def _run(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_short_request_behind_a_long_prompt_is_explained_by_its_chunks(tiny_llama):
    with LLM(tiny_llama[0], num_kv_blocks=128, block_size=4, max_model_len=256, max_num_batched_tokens=16) as llm:
        engine = llm.engine
        engine.add_request("long", _ids(120, 0), GREEDY)
        engine.step()  # the long prompt's first chunk: the short one arrives while it prefills
        engine.add_request("short", _ids(5, 1), GREEDY)
        _run(engine)
        answer = engine.explain_request("short")
        assert answer is not None and answer["status"] == "finished" and answer["prompt_tokens"] == 5
        [seq] = answer["sequences"]
        pre = seq["before_first_token"]
        behind = {(b["request_id"], b["kind"]): b for b in pre["behind"]}
        # 120 tokens in chunks of 16: after the first, the short prompt waited through the rest
        assert ("long", "prefill") in behind
        assert behind["long", "prefill"]["tokens"] >= 64 and behind["long", "prefill"]["steps"] >= 4
        assert pre["steps"] > pre["steps_scheduled"] >= 1 and pre["own_tokens"] == 5
        assert pre["excess_s"] > 0 and pre["step_tokens"]["prefill"] >= 64 + 5
        waited = [s for s in pre["step_list"] if s["own"] is None]
        assert waited and all(s["others"][0]["request_id"] == "long" for s in waited)
        assert all(s["excess_s"] == s["duration_s"] for s in waited)  # none of that step was its own work
        assert seq["first_token_step"] == pre["step_list"][-1]["step"]
        between = seq["between_tokens"]
        assert between["gaps"] == GREEDY.max_tokens - 1 and between["own_tokens"] == GREEDY.max_tokens - 1
        # the long one: its own 8 chunks (the short prompt shared only the room its last one left)
        long_pre = engine.explain_request("long")["sequences"][0]["before_first_token"]
        assert long_pre["steps"] == long_pre["steps_scheduled"] == 8 and long_pre["own_tokens"] == 120
        assert long_pre["behind"] == [{"request_id": "short", "kind": "prefill", "tokens": 5, "steps": 1}]


def test_a_request_admitted_alone_is_its_own_prefill(tiny_llama):
    with LLM(tiny_llama[0], num_kv_blocks=64, block_size=4, max_model_len=128) as llm:
        engine = llm.engine
        engine.add_request("alone", _ids(20, 2), GREEDY)
        engine.step()
        running = engine.explain_request("alone")
        assert running["status"] == "running" and running["sequences"][0]["status"] == "running"
        _run(engine)
        [seq] = engine.explain_request("alone")["sequences"]
        pre = seq["before_first_token"]
        assert pre["steps"] == pre["steps_scheduled"] == 1 and pre["behind"] == [] and pre["own_tokens"] == 20
        [step] = pre["step_list"]
        assert step["own"] == {"kind": "prefill", "tokens": 20, "start_pos": 0, "sampled": True}
        assert step["others"] == [] and step["tokens"]["prefill"] == 20 and step["own_share_s"] == step["duration_s"]
        assert seq["between_tokens"]["behind"] == [] and seq["between_tokens"]["preemptions"] == []
        assert engine.explain_request("nobody") is None


def test_n_completions_are_explained_as_sequences(tiny_llama):
    with LLM(tiny_llama[0], num_kv_blocks=64, block_size=4, max_model_len=128) as llm:
        engine = llm.engine
        engine.add_request("pair", _ids(8, 3), SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True))
        _run(engine)
        answer = engine.explain_request("pair")
        assert [s["id"] for s in answer["sequences"]] == ["pair#0", "pair#1"]


def test_a_preemption_shows_in_the_preempted_request(tiny_llama):
    # 24 blocks of 4 tokens: far less than 8 sequences of 30 + 16 tokens need at once.
    with LLM(tiny_llama[0], num_kv_blocks=24, block_size=4, max_model_len=64, max_num_batched_tokens=64) as llm:
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for i in range(8):
            engine.add_request(f"r{i}", _ids(30, 10 + i), params)
        _run(engine)
        assert engine.get_stats().num_preemptions > 0
        victims = {rid: rec.index for rec in engine.step_records.steps for rid in rec.preempted}
        assert victims
        rid, step = next(iter(victims.items()))
        [seq] = engine.explain_request(rid)["sequences"]
        spans = seq["before_first_token"]["preemptions"] + seq["between_tokens"]["preemptions"]
        assert step in spans
        # it was computed again: a recompute chunk (or a prefill again, preempted before its first token)
        kinds = {s["own"]["kind"] for s in seq["before_first_token"]["step_list"] if s["own"]}
        for gap in seq["between_tokens"]["worst_gaps"]:
            kinds |= {s["own"]["kind"] for s in gap["step_list"] if s["own"]}
        assert kinds & {"recompute", "prefill"}


def test_the_ring_is_bounded_and_old_requests_expire(tiny_llama):
    with LLM(tiny_llama[0], num_kv_blocks=64, block_size=4, max_model_len=128, step_record_capacity=4) as llm:
        engine = llm.engine
        engine.add_request("old", _ids(6, 4), GREEDY)
        _run(engine)
        assert engine.explain_request("old") is not None
        for i in range(6):
            engine.add_request(f"new{i}", _ids(6, 5 + i), GREEDY)
            _run(engine)
        records = engine.step_records
        assert len(records.steps) == 4 and len(records.requests) <= 4
        assert records.steps[0].index == records.next_index - 4
        assert engine.explain_request("old") is None  # its steps left the ring
        assert engine.explain_request("new5") is not None


def test_records_off(tiny_llama):
    with LLM(tiny_llama[0], num_kv_blocks=64, block_size=4, max_model_len=128, step_record_capacity=0) as llm:
        engine = llm.engine
        engine.add_request("x", _ids(6, 4), GREEDY)
        _run(engine)
        assert not engine.step_records.steps and engine.explain_request("x") is None
