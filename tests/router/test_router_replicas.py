"""Two real kvflow servers (tiny random model) behind `kvflow router --policy cache_aware`:
shared-prefix chat traffic lands on one replica per system prompt (and hits that engine's prefix
cache); then one replica is stopped under load: every request completes or gets an HTTP error or an
SSE error event (none hangs), and later requests all go to the survivor."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvflow.config import EngineConfig, ServerConfig
from kvflow.router.app import build_router_app
from kvflow.router.config import RouterConfig

from server_utils import LiveServer, ThreadServer, parse_metrics, wait_for

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

MODEL = "tiny"
CHAT = "/v1/chat/completions"
# ~320 characters each (~175 tokens), far longer than a question: a repeat is a cache_aware hit.
SYSTEMS = [
    "You are the quick brown fox. You jump over the lazy dog whenever anyone asks, and you tell "
    "everyone about the little engine that served many requests at once. " * 2,
    "You are a Python tutor. def hello(name): return f'hello {name}' is your favourite function, "
    "and Paris is the capital of France, Berlin the capital of Germany. " * 2,
]
CLIENT_TIMEOUT = httpx.Timeout(30, connect=5)  # a request that outlives this is a hang: the test fails


def _server(model: str) -> LiveServer:
    return LiveServer(
        EngineConfig(model=model, num_kv_blocks=96, max_model_len=256, max_num_seqs=8),
        ServerConfig(log_interval_s=60, served_model_name=MODEL),
    )


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    servers = [_server(tiny_llama[0]), _server(tiny_llama[0])]
    config = RouterConfig(
        port=0,
        backends=[s.url for s in servers],
        policy="cache_aware",
        health_interval_s=0.2,
        load_poll_s=0.1,
        connect_timeout_s=2,
        health_timeout_s=2,
        timeout_s=20,
        # An in-flight request counts 16 tokens of queue, not 128: eight at once (16 x 8 = 128) stay
        # below what a ~175-token cached system prompt saves, so the affinity the test checks does
        # not hinge on how fast the replicas drain (on a busy host two queued requests at 128 each
        # would rightly send the next one to the idle replica).
        load_cost_tokens=16,
    )
    router = ThreadServer(build_router_app(config))
    stopped: set[int] = set()
    yield servers, router, stopped
    router.stop()
    for i, s in enumerate(servers):
        if i not in stopped:
            s.stop()


def _body(system: str, question: str, *, stream: bool = False, max_tokens: int = 4) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _router_metrics(router: ThreadServer) -> dict[str, float]:
    return parse_metrics(httpx.get(router.url + "/metrics", timeout=5).text)


def _sent(router: ThreadServer, url: str) -> float:
    return _router_metrics(router).get(f'kvflow_router:requests_total{{backend="{url}",role="backend"}}', 0.0)


def _finished(server: LiveServer) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("kvflow:request_success_total"))


def test_shared_prefixes_stick_to_one_replica_each(cluster):
    servers, router, _ = cluster
    urls = [s.url for s in servers]
    before = [_finished(s) for s in servers]
    served: dict[int, list[str]] = {0: [], 1: []}
    for q in range(4):
        for p, system in enumerate(SYSTEMS):
            counts = [_sent(router, u) for u in urls]
            resp = httpx.post(
                router.url + CHAT, json=_body(system, f"What is question number {q}?"), timeout=CLIENT_TIMEOUT
            )
            assert resp.status_code == 200, resp.text
            [target] = [u for u, c in zip(urls, counts) if _sent(router, u) == c + 1]
            served[p].append(target)
    assert len(set(served[0])) == 1 and len(set(served[1])) == 1, served
    assert served[0][0] != served[1][0]  # the second prompt's first request (a miss) went to the idle replica
    metrics = _router_metrics(router)
    assert metrics["kvflow_router:cache_aware_hits_total"] == 6
    assert metrics["kvflow_router:cache_aware_misses_total"] == 2
    # the engines agree: four requests each, and the repeats found their prefix in the engine's cache
    for s, b in zip(servers, before):
        assert _finished(s) - b == 4
        assert s.metrics()["kvflow:prefix_cache_hits_total"] > 0

    # concurrent traffic keeps the affinity (loads stay far below --balance-abs-threshold, and their
    # queue below the cached prefix's worth)
    before = [_finished(s) for s in servers]
    threads = [
        threading.Thread(
            target=httpx.post,
            args=(router.url + CHAT,),
            kwargs={"json": _body(SYSTEMS[i % 2], f"Concurrent {i}?"), "timeout": CLIENT_TIMEOUT},
        )
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    wait_for(
        lambda: sum(_finished(s) for s in servers) - sum(before) == 8, 10, "the concurrent requests did not finish"
    )
    for p in (0, 1):
        server = servers[urls.index(served[p][0])]
        assert _finished(server) - before[servers.index(server)] == 4


def _request(url: str, i: int) -> str:
    """One chat request through the router: ok | http_<status> | sse_error; anything else
    (a stream cut without an error event, a client timeout) is a failure of the router."""
    stream = i % 2 == 0
    body = _body(SYSTEMS[i % 2], f"Under load {i}?", stream=stream, max_tokens=16)
    try:
        if not stream:
            resp = httpx.post(url + CHAT, json=body, timeout=CLIENT_TIMEOUT)
            if resp.status_code != 200:
                assert "error" in resp.json()
                return f"http_{resp.status_code}"
            assert resp.json()["choices"]
            return "ok"
        with httpx.stream("POST", url + CHAT, json=body, timeout=CLIENT_TIMEOUT) as resp:
            if resp.status_code != 200:
                resp.read()
                return f"http_{resp.status_code}"
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"truncated: {events[-1:]}"
        if any("error" in json.loads(e) for e in events[:-1]):
            return "sse_error"
        return "ok"
    except httpx.HTTPError as e:
        return f"exception: {type(e).__name__}: {e}"


def test_a_replica_stopped_under_load_fails_over(cluster):
    servers, router, stopped = cluster
    victim, survivor = servers
    outcomes: list[str] = []
    stop = threading.Event()
    counter = iter(range(10**6))
    lock = threading.Lock()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                i = next(counter)
            try:
                outcome = _request(router.url, i)
            except Exception as e:  # e.g. an error body that is not OpenAI's: reported below
                outcome = f"bad answer: {type(e).__name__}: {e}"
            with lock:
                outcomes.append(outcome)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        wait_for(lambda: len(outcomes) >= 4, 30, "no traffic flowed before the stop")
        [backend] = [b for b in router.app.state.router.policy.backends() if b.url == victim.url]
        wait_for(lambda: backend.inflight > 0, 10, "nothing in flight on the victim", 0.005)
        # Abruptly: uvicorn cancels what is in flight at once (its default grace would let most finish).
        victim.server.config.timeout_graceful_shutdown = 0.05
        victim.stop()
        stopped.add(0)
        wait_for(
            lambda: _router_metrics(router)[f'kvflow_router:backend_healthy{{backend="{victim.url}"}}'] == 0,
            10,
            "the stopped replica stayed in rotation",
        )
        time.sleep(0.5)  # some more traffic, all to the survivor
    finally:
        stop.set()
        deadline = time.monotonic() + 40  # past the client timeout: only a hang is still running
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
    assert not any(w.is_alive() for w in workers), "a request hung"
    bad = [o for o in outcomes if o != "ok" and o != "sse_error" and not o.startswith("http_")]
    assert not bad, bad
    assert outcomes.count("ok") >= 4

    # from now on every request goes to the survivor, and succeeds
    sent_to_victim = _sent(router, victim.url)
    before = _finished(survivor)
    for i in range(6):
        assert _request(router.url, i) == "ok"
    assert _sent(router, victim.url) == sent_to_victim
    wait_for(lambda: _finished(survivor) - before == 6, 10, "the survivor did not serve them all")
    metrics = _router_metrics(router)
    assert metrics[f'kvflow_router:backend_unhealthy_total{{backend="{victim.url}"}}'] == 1
    assert metrics[f'kvflow_router:backend_healthy{{backend="{survivor.url}"}}'] == 1
    survivor.wait_engine_idle()
