"""The speculator's acceptance model (kvflow.spec_decode.acceptance), against its definition
recomputed by hand, and the plan it drives."""

from __future__ import annotations

import pytest

from kvflow.config import SpeculativeConfig
from kvflow.core.request import Request
from kvflow.core.step_cost import DecodePass, StepCostModel
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode import acceptance as acc
from kvflow.spec_decode.acceptance import AcceptanceModel
from kvflow.spec_decode.speculator import Speculator


def _ema(start: float, weight: float, hits: list[float]) -> float:
    for h in hits:
        start += weight * (h - start)
    return start


def test_rates_follow_their_moving_averages():
    m = AcceptanceModel()
    # request a: 4 drafts after a 4-gram match, 3 accepted (depths 2 and 3 accepted, depth 4 missed)
    m.observe("a", 4, proposed=4, accepted=3)
    first_all = _ema(acc.FIRST_PRIOR, acc.GLOBAL_WEIGHT, [1.0])
    assert m.first_by_request["a"] == pytest.approx(_ema(acc.FIRST_PRIOR, acc.REQUEST_WEIGHT, [1.0]))
    assert m.first_by_evidence[4] == pytest.approx(_ema(acc.FIRST_PRIOR, acc.EVIDENCE_WEIGHT, [1.0]))
    assert m.first_all == pytest.approx(first_all)
    assert m.continuation["a"] == pytest.approx(_ema(acc.CONTINUATION_PRIOR, acc.CONTINUATION_WEIGHT, [1, 1, 0]))
    # request b (new): starts from the averages over all requests; its first draft fails, so no
    # later depth was tested and its continuation stays where it started
    cont_all = _ema(acc.CONTINUATION_PRIOR, acc.GLOBAL_WEIGHT, [1, 1, 0])
    assert m.gain("b", None, 1) == pytest.approx(first_all)
    m.observe("b", 2, proposed=3, accepted=0)
    assert m.continuation["b"] == pytest.approx(cont_all)
    assert m.first_by_request["b"] == pytest.approx(_ema(first_all, acc.REQUEST_WEIGHT, [0.0]))
    assert m.first_by_evidence[2] == pytest.approx(_ema(first_all, acc.EVIDENCE_WEIGHT, [0.0]))
    # gain of depth j: the first rate (by evidence where given) x continuation^(j - 1)
    for depth in (1, 2, 5):
        assert m.gain("a", 4, depth) == pytest.approx(m.first_by_evidence[4] * m.continuation["a"] ** (depth - 1))
        assert m.gain("a", None, depth) == pytest.approx(m.first_by_request["a"] * m.continuation["a"] ** (depth - 1))
    assert m.first("c", 3) == pytest.approx(m.first_all)  # evidence not seen yet: the average over all
    m.release("a")
    assert "a" not in m.first_by_request and "a" not in m.continuation and 4 in m.first_by_evidence


def test_long_matches_learned_apart_from_short_ones():
    """First drafts after 4-gram matches always accepted (and then the whole span), after 2-gram
    matches never: a new request's first draft is expected to pass after a 4-gram and not after a
    2-gram, where one rate for every draft would give both the same."""
    m = AcceptanceModel()
    for i in range(200):
        m.observe(f"long{i}", 4, proposed=4, accepted=4)
        m.observe(f"short{i}", 2, proposed=4, accepted=0)
    assert m.first("new", 4) > 0.95 and m.first("new", 2) < 0.05
    assert m.gain("new", 4, 4) > 0.9  # the continuation learned over all requests
    assert m.gain("new", 2, 1) < 0.05


def _request(rid: str, prompt: list[int], output: list[int]) -> Request:
    r = Request(rid, rid, 0, prompt, SamplingParams(max_tokens=100), 100, 0.0)
    r.output_token_ids = output
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_plan_drafts_where_the_match_predicts_acceptance():
    """Batch 8 on the decode pass (a pass 10 ms, a row 0.5 ms): four requests whose text ends in a
    4-gram seen before and four ending in a 2-gram seen before, every one with a match. With first
    drafts after 4-grams learned as accepted and after 2-grams as rejected, only the first four get
    drafts, deep ones; the look-up before the plan is what tells them apart."""
    cost = StepCostModel()
    for tokens in (1, 2, 8, 16, 32, 64, 4, 40, 20, 9):
        cost.observe(tokens, 0.010 + 0.0005 * tokens)
    cost.decode_pass = DecodePass(rows_per_seq=16, max_rows=64)
    spec = Speculator(
        SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        ),
        cost=cost,
    )
    for i in range(100):
        spec.acceptance.observe(f"old{i}", 4, proposed=4, accepted=4)
        spec.acceptance.observe(f"old{i}", 2, proposed=4, accepted=0)
        spec.acceptance.release(f"old{i}")
    batch = []
    for i in range(8):
        base = 100 * (i + 1)
        prompt = [base + j for j in range(10)]
        # long: ends on the prompt's first 4 tokens; short: on 2 of them after a token never seen
        output = prompt[:4] if i < 4 else [base + 50] + prompt[:2]
        batch.append(_request(f"r{i}", prompt, output))
    spec.propose(batch)
    for i, r in enumerate(batch):
        base = 100 * (i + 1)
        expected = [base + j for j in range(4, 8)] if i < 4 else []
        assert r.spec_token_ids == expected, i
