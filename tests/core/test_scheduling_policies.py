"""Scheduling policies under a fake clock and a fake step-cost model (no model, no tensors): EDF
order with relegation and promotion, the step budget shrinking as a TPOT deadline nears,
admission by predicted TTFT, priority displacement at max_num_seqs, the aging bound, VTC's
fairness bound, the queue-time limit; and, with the real engine, that no policy changes a token."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request
from kvflow.core.sched import AdmissionRejected, VirtualTokenCounter
from kvflow.core.sched.policy import QueueView
from kvflow.core.sched.priority import PriorityPolicy
from kvflow.core.sched.slo import SLOPolicy
from kvflow.core.scheduler import Scheduler
from kvflow.core.step_cost import StepCostModel, chunk_pairs

from conftest import assert_no_leaks, hf_greedy

A, B, P = 0.010, 0.0001, 0.01  # the fake machine: 10 ms a step, 0.1 ms a token, 10 ms per 1M chunk pairs


def machine(tokens: int, pairs: int = 0) -> float:
    return A + B * tokens + P * pairs / 1e6


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fake_cost() -> StepCostModel:
    cost = StepCostModel()
    steps = (
        (1, 0, 100, 0),
        (64, 1, 900, 800),
        (512, 1, 3000, 2000),
        (8, 0, 4000, 0),
        (256, 1, 200, 0),
        (32, 1, 1500, 1400),
        (2048, 1, 6000, 3000),
        (16, 0, 50, 0),
        (1024, 2, 2500, 500),
        (128, 0, 800, 0),
        (700, 1, 700, 0),
        (300, 1, 5300, 5000),
    )
    for tokens, chunks, context, start in steps * 2:
        pairs = chunk_pairs(start, tokens) if chunks else 0
        cost.observe(tokens, machine(tokens, pairs), chunks, context, pairs)
    return cost


def req(
    rid: str,
    prompt: int = 8,
    *,
    arrival: float = 0.0,
    priority: int = 0,
    ttft: float | None = None,
    tpot: float | None = None,
    client: str | None = None,
    max_tokens: int = 4,
) -> Request:
    return Request(
        rid,
        rid,
        0,
        list(range(1, prompt + 1)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_tokens,
        arrival,
        priority=priority,
        client=client,
        ttft_slo=ttft,
        tpot_slo=tpot,
    )


def decoding(rid: str, *, tpot: float, first_token_time: float, outputs: int = 2) -> Request:
    """A request past its 8-token prompt with `outputs` tokens out, the first at first_token_time."""
    r = req(rid, 8, tpot=tpot, max_tokens=100)
    r.output_token_ids = [5] * outputs
    r.num_computed_tokens = r.num_tokens - 1
    r.first_token_time = first_token_time
    return r


def step(s: Scheduler) -> list[str]:
    """One step with a fake runner: every sampling sequence gets token 7. Returns the ids scheduled."""
    out = s.schedule()
    s.update_from_output(out, {q.request_id: [7] for q in out.seqs if q.sample})
    return [q.request_id for q in out.seqs]


def test_cost_model_predicts_the_fake_machine():
    cost = fake_cost()
    for tokens, chunks, context, start in ((300, 1, 1000, 700), (40, 0, 10000, 0), (3000, 1, 3000, 0)):
        pairs = chunk_pairs(start, tokens) if chunks else 0
        assert cost.predict(tokens, chunks, context, pairs) == pytest.approx(machine(tokens, pairs), rel=0.05)
    # its error is measured on each step before it sees it: small on the linear machine, large on
    # a step that is not what it learned
    assert cost.prediction_error is not None and cost.prediction_error < 0.1
    cost.observe(100, 5 * machine(100), 1, 500)
    assert cost.errors[-1] == pytest.approx(0.8, abs=0.05)


def test_slo_order_edf_plus_own_prefill_relegation_and_promotion():
    policy = SLOPolicy(fake_cost(), 512)
    now = 10.0
    tight = req("tight", 8, arrival=9.5, ttft=1.0)  # deadline 10.5
    loose = req("loose", 8, arrival=0.0, ttft=30.0)  # deadline 30
    short = req("short", 16, arrival=9.9, ttft=0.8)  # deadline 10.7: later than tight, still before loose
    long_ = req("long", 8000, arrival=9.9, ttft=0.8)  # same deadline, but 16 chunks (~1 s): cannot make it
    late = req("late", 8, arrival=9.0, ttft=0.5)  # deadline 9.5 has passed: relegated
    none = req("none", 8, arrival=1.0)  # no SLO: after every request with one
    order = [r.request_id for r in policy.waiting_order([none, late, long_, loose, short, tight], now)]
    assert order == ["tight", "short", "loose", "none", "late", "long"]
    # relegated requests are promoted once they have waited twice their SLO, so nothing starves
    order = [r.request_id for r in policy.waiting_order([none, late, loose, tight], now=9.0 + 2 * 0.5 + 0.01)]
    assert order[0] == "late"


def test_slo_started_prompt_yields_to_an_urgent_arrival():
    """A long batch prompt part-way through its chunks: an interactive request arriving behind it
    gets the next step's prefill tokens first under slo; under fcfs the started prompt keeps them."""
    for policy, first in ((SLOPolicy(fake_cost(), 64, admission_factor=None), "inter"), (None, "batch")):
        s, clock = make_scheduler(policy, budget=64)
        s.add_request(req("batch", 400, ttft=30.0, max_tokens=4))
        step(s)  # its first chunk
        clock.t = 0.1
        s.add_request(req("inter", 16, arrival=0.1, ttft=1.0, max_tokens=4))
        out = s.schedule()
        assert out.seqs[0].request_id == first
        if first == "inter":  # its whole prompt, the started one gets the rest
            assert [(q.request_id, len(q.token_ids)) for q in out.seqs] == [("inter", 16), ("batch", 48)]


def test_slo_budget_shrinks_as_the_tpot_deadline_nears():
    policy = SLOPolicy(fake_cost(), max_num_batched_tokens=2048, min_chunk=32)
    d = decoding("d", tpot=0.100, first_token_time=-0.1)  # its third token is due by -0.1 + 2 x 0.1 = 0.1
    prompt = req("p", 4000)  # no SLO of its own: the decode's deadline sizes its chunks
    view = QueueView([d], [prompt], 2048)
    times = (-0.5, 0.0, 0.03, 0.06, 0.08, 0.089, 0.095, 0.2)
    budgets = [policy.token_budget(view, now) for now in times]
    # past the deadline no chunk fits: the step is decode-only (the prompt has no TTFT to keep)
    assert budgets == sorted(budgets, reverse=True) and budgets[0] == 2048 and budgets[-1] == 1
    assert all(b == 1 or b >= 1 + 32 for b in budgets)  # never a chunk too small to be worth a step
    # in between, the chunk is the largest that fits the slack on the (learned) fake machine
    for now, budget in zip(times[1:4], budgets[1:4]):
        chunk = budget - 1
        assert machine(1 + chunk, chunk_pairs(0, chunk)) <= 0.1 - now + 0.002
        assert machine(1 + chunk + 32, chunk_pairs(0, chunk + 32)) > 0.1 - now - 0.002
    # no decode with a TPOT SLO and no TTFT SLO seen: the full budget
    assert SLOPolicy(fake_cost(), 2048).token_budget(QueueView([req("r", 8)], [prompt], 2048), 0.0) == 2048


def test_slo_small_chunk_waits_unless_a_ttft_is_at_risk():
    """No slack left for a useful chunk: decode-only, unless the first prompt's TTFT deadline is
    closer than twice its own prefill time; then it gets min_chunk tokens."""
    d = decoding("d", tpot=0.100, first_token_time=-0.1)  # due at 0.1
    policy = SLOPolicy(fake_cost(), 2048, min_chunk=32)
    policy.check_admission(req("seen", 8, ttft=0.25), QueueView([], [], 2048), 0.0)  # reserve 0.1 s
    assert policy.token_budget(QueueView([d], [req("no-slo", 4000)], 2048), 0.099) == 1
    own = policy.prefill_time(req("probe", 4000, ttft=1.0), chunk=2048)
    assert own > 0.2  # too long to go whole within twice the reserve
    relaxed = req("relaxed", 4000, arrival=0.099, ttft=30 * own)
    assert policy.token_budget(QueueView([d], [relaxed], 2048), 0.099) == 1
    urgent = req("urgent", 4000, arrival=0.099 + 1.5 * own - 3 * own, ttft=3 * own)  # 1.5x its prefill left
    assert policy.token_budget(QueueView([d], [urgent], 2048), 0.099) == 1 + 32


def test_slo_arrival_reserve_caps_the_step_and_keeps_an_urgent_prompt_whole():
    """With no decodes, a step may last `arrival_share` x the tightest TTFT SLO seen lately (a
    request arriving just after it starts waits for all of it), but the first prompt in the
    prefill order is not cut when finishing it now makes its TTFT."""
    policy = SLOPolicy(fake_cost(), 4096, arrival_share=0.4, slo_memory_s=60.0)
    batch = req("batch", 4000, ttft=30.0)
    assert policy.token_budget(QueueView([], [batch], 4096), 0.0) == 4096  # no tight SLO seen yet
    policy.check_admission(req("seen", 8, ttft=0.25), QueueView([], [], 4096), 0.0)  # a 250 ms TTFT arrives
    chunk = policy.token_budget(QueueView([], [batch], 4096), 1.0)
    assert machine(chunk, chunk_pairs(0, chunk)) <= 0.1 + 0.002 < machine(chunk + 32, chunk_pairs(0, chunk + 32))
    # ~0.17 s in one step (over the 0.1 s reserve, inside twice it): kept whole, its first token
    # within its 0.25 s TTFT instead of a step later
    urgent = req("urgent", 1500, arrival=1.0, ttft=0.25)
    assert policy.token_budget(QueueView([], [batch, urgent], 4096), 1.0) == 1500
    # not when the whole prompt would miss its TTFT anyway, nor for a step past twice the reserve
    assert policy.token_budget(QueueView([], [batch, req("u2", 1500, arrival=0.9, ttft=0.25)], 4096), 1.0) < 1500
    assert policy.token_budget(QueueView([], [batch, req("u3", 3000, arrival=1.0, ttft=1.0)], 4096), 1.0) < 3000
    # a minute later the tight SLO is forgotten: full steps again
    assert policy.token_budget(QueueView([], [batch], 4096), 62.0) == 4096


def test_slo_admission_rejects_what_is_already_late():
    policy = SLOPolicy(fake_cost(), 512, admission_factor=2.0)
    # 20k tokens due before the newcomer: 40 chunks, ~2.5 s
    queued = [req(f"q{i}", 2000, arrival=-0.5, ttft=1.0) for i in range(10)]
    view = QueueView([], queued, 512)
    newcomer = req("new", 100, arrival=0.0, ttft=1.0)
    with pytest.raises(AdmissionRejected) as e:
        policy.check_admission(newcomer, view, now=0.0)
    assert e.value.reason == "slo" and 2.0 < e.value.retry_after_s < 3.0
    assert "predicted TTFT" in str(e.value)
    policy.check_admission(req("loose", 100, ttft=60.0), view, now=0.0)  # a loose SLO is admitted
    policy.check_admission(newcomer, QueueView([], queued[:1], 512), now=0.0)  # a short queue is fine
    # work ordered after the newcomer (a later deadline) does not count against it
    later = [req(f"l{i}", 2000, arrival=0.0, ttft=5.0) for i in range(10)]
    policy.check_admission(newcomer, QueueView([], later, 512), now=0.0)


def make_scheduler(
    policy=None, fairness=None, *, max_num_seqs: int = 256, blocks: int = 256, budget: int = 64, max_queue_time_s=None
) -> tuple[Scheduler, Clock]:
    clock = Clock()
    return Scheduler(
        KVCacheManager(blocks, 4, enable_caching=False),
        budget,
        max_num_seqs,
        policy,
        fairness,
        max_queue_time_s,
        clock=clock,
    ), clock


def test_priority_displaces_at_max_num_seqs():
    s, clock = make_scheduler(PriorityPolicy(aging_s=100.0), max_num_seqs=2)
    s.add_request(req("low1", 8, priority=5, max_tokens=50))
    s.add_request(req("low2", 8, priority=5, arrival=0.1, max_tokens=50))
    step(s)
    assert {r.request_id for r in s.running} == {"low1", "low2"}
    clock.t = 1.0
    s.add_request(req("high", 8, priority=0, arrival=1.0, max_tokens=50))
    out = s.schedule()
    assert out.preempted == ["low2"]  # the least important, latest arrival
    assert {q.request_id for q in out.seqs} == {"low1", "high"}
    # a request of equal priority does not displace anyone
    s2, _ = make_scheduler(PriorityPolicy(aging_s=100.0), max_num_seqs=1)
    s2.add_request(req("a", 8, priority=1, max_tokens=50))
    step(s2)
    s2.add_request(req("b", 8, priority=1, arrival=0.5, max_tokens=50))
    assert s2.schedule().preempted == []


def test_priority_aging_bounds_the_wait():
    """A priority-9 request waiting behind a stream of priority-0 requests (one new every step,
    each 3 steps long, max_num_seqs 2) gets in once its age is worth 9 levels: here 9 * aging_s."""
    aging = 0.5
    s, clock = make_scheduler(PriorityPolicy(aging_s=aging), max_num_seqs=2)
    s.add_request(req("old", 8, priority=9, max_tokens=3))
    started = None
    for i in range(400):
        clock.t = 0.01 * i
        s.add_request(req(f"hi{i}", 8, priority=0, arrival=clock.t, max_tokens=3))
        if "old" in step(s) and started is None:
            started = clock.t
    assert started is not None and started <= 9 * aging + 0.1


def test_vtc_keeps_backlogged_clients_within_the_bound():
    """Two clients, both always backlogged, one sending 10x the requests: their service counters
    stay within VTC's bound (2 x (w_in x max prompt + w_out x max output) here), and the light
    client is served as much as the heavy one."""
    vtc = VirtualTokenCounter()
    s, clock = make_scheduler(None, vtc, max_num_seqs=4, budget=32)
    n = 0
    worst = 0.0
    for i in range(300):
        clock.t = 0.01 * i
        for _ in range(10):
            s.add_request(req(f"h{n}", 16, client="heavy", max_tokens=8, arrival=clock.t))
            n += 1
        s.add_request(req(f"l{i}", 16, client="light", max_tokens=8, arrival=clock.t))
        step(s)
        c = vtc.counters
        if i > 20:
            worst = max(worst, abs(c.get("heavy", 0) - c.get("light", 0)))
    bound = 2 * (vtc.input_weight * 16 + vtc.output_weight * 8)
    assert worst <= bound, (worst, bound)
    assert vtc.counters["light"] > 0.4 * vtc.counters["heavy"]


def test_vtc_lifts_a_returning_client():
    vtc = VirtualTokenCounter()
    vtc.counters = {"busy": 1000.0, "idle": 0.0}
    queued = [req("b1", 8, client="busy")]
    vtc.on_arrival(req("i1", 8, client="idle"), queued)
    assert vtc.counters["idle"] == 1000.0  # it cannot bank its idle time


def test_max_queue_time_ends_requests_that_never_ran():
    s, clock = make_scheduler(max_num_seqs=1, max_queue_time_s=2.0)
    s.add_request(req("runs", 8, max_tokens=1000))
    step(s)
    s.add_request(req("waits", 8, arrival=0.0))
    clock.t = 1.0
    assert s.schedule().timed_out == []
    clock.t = 2.5
    out = s.schedule()
    assert [r.request_id for r in out.timed_out] == ["waits"] and "waits" not in s.requests


@pytest.mark.parametrize("policy,fairness", [("fcfs", "none"), ("priority", "none"), ("slo", "none"), ("slo", "vtc")])
def test_policies_change_order_never_tokens(tiny_llama, policy, fairness):
    """Greedy outputs equal HF's under every policy, with a budget small enough that prefills are
    chunked and the slo policy's budget moves with the (tight) TPOT deadlines."""
    path, hf = tiny_llama
    llm = LLM(
        model=path,
        num_kv_blocks=64,
        block_size=4,
        max_model_len=128,
        max_num_batched_tokens=24,
        max_num_seqs=3,
        scheduling_policy=policy,
        fairness=fairness,
        default_ttft_slo_ms=50,
        default_tpot_slo_ms=5,
    )
    prompts = [[(7 * i + j) % 500 + 2 for j in range(5 + 9 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, priority=i % 3) for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    assert_no_leaks(llm.engine)
    stats = llm.get_stats().slo
    assert stats.attained["all"] + stats.missed["all"] == 6


@pytest.mark.server
def test_server_slo_admission_priority_and_goodput_metrics(tiny_llama):
    """Over HTTP: the scheduling extras are accepted, a request predicted to miss its TTFT SLO
    by the admission factor is a 503 with a Retry-After from the predicted drain time, counted by
    reason, and SLO attainment / goodput are exported."""
    import time as _time

    import httpx

    from kvflow.config import EngineConfig

    from server_utils import LiveServer

    s = LiveServer(
        EngineConfig(
            model=tiny_llama[0],
            num_kv_blocks=256,
            max_num_batched_tokens=32,
            scheduling_policy="slo",
            default_tpot_slo_ms=1000,
        )
    )
    try:
        runner = s.engine.runner
        real = runner.execute

        def slow(sched, *rest):  # ~20 ms a step, so 32-token chunks drain ~1.6k tokens/s
            _time.sleep(0.02)
            return real(sched, *rest)

        runner.execute = slow
        body = {"prompt": list(range(2, 200)), "max_tokens": 4, "ignore_eos": True}
        for _ in range(3):  # teach the cost model what a step costs
            assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(16) as pool:
            results = list(
                pool.map(
                    lambda i: httpx.post(
                        s.url + "/v1/completions", timeout=60, json={**body, "ttft_slo_ms": 150, "priority": i % 2}
                    ),
                    range(16),
                )
            )
        codes = [r.status_code for r in results]
        assert 200 in codes and 503 in codes, codes
        rejected = next(r for r in results if r.status_code == 503)
        assert int(rejected.headers["Retry-After"]) >= 1
        assert "TTFT SLO" in rejected.json()["error"]["message"]
        s.wait_engine_idle()
        m = s.metrics()
        assert m['kvflow:request_rejected_total{reason="slo"}'] == codes.count(503)
        assert m['kvflow:request_slo_attained_total{slo="all"}'] + m[
            'kvflow:request_slo_missed_total{slo="all"}'
        ] == 3 + codes.count(200)
        assert "kvflow:goodput_requests_per_second" in m
        assert any(k.startswith("kvflow:request_queue_time_by_priority_seconds_count") for k in m)
        bad = httpx.post(s.url + "/v1/completions", json={**body, "ttft_slo_ms": -5}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttft_slo_ms"
    finally:
        s.stop()
