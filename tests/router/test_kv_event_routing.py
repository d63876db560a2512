"""`kvflow serve --data-parallel-size 2 --router-kv-events` end to end (two replicas of a tiny random
model, a subprocess under `nice -n 19`, everything killed afterwards):

- the router follows each replica's KV events: a repeat prompt goes to the replica that still holds
  it after the replica the router had sent it to evicted it (under requests the router never saw),
  which its prompt-text view alone would get wrong;
- balance before affinity: 32 concurrent chat requests sharing only a short system prompt spread
  over the two idle replicas (neither takes more than 60 %).

Which replica got a request: the router's `kvflow_router:requests_total{backend}`; that it held the
prompt: the replica's own `kvflow:prefix_cache_hits_total`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvflow.utils.processes import free_port

from server_utils import descendants, parse_metrics

pytestmark = pytest.mark.server  # starts a server and its replica processes: not in `make test-fast`

STARTUP_S = 120  # about 15 s on an idle 2-core machine
BS = 16


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    port = free_port()
    cmd = [
        "nice", "-n", "19", sys.executable, "-m", "kvflow.cli.main", "serve",
        "--data-parallel-size", "2", "--router-kv-events",
        "--model", tiny_llama[0], "--served-model-name", "tiny",
        "--num-kv-blocks", "24", "--block-size", str(BS), "--max-model-len", "256",
        "--port", str(port), "--log-interval-s", "60", "--shutdown-grace-s", "2",
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("dp-kv-events"))}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvflow serve exited with {proc.returncode}:\n{proc.communicate()[0]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.25)
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            for p in descendants(proc.pid) | {proc.pid}:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p, signal.SIGKILL)
            proc.wait(10)


def _router_metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=5).text)


def _by_backend(metrics: dict[str, float], name: str) -> dict[str, float]:
    prefix = name + '{backend="'
    return {k[len(prefix) :].split('"')[0]: v for k, v in metrics.items() if k.startswith(prefix)}


def _sent(url: str) -> dict[str, float]:
    return _by_backend(_router_metrics(url), "kvflow_router:requests_total")


def _complete(url: str, prompt: str, max_tokens: int = 2) -> None:
    resp = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text


def _routed(url: str, prompt: str) -> str:
    """The replica the router sends `prompt` to."""
    before = _sent(url)
    _complete(url, prompt)
    after = _sent(url)
    [target] = [u for u in after if after[u] != before.get(u, 0)]
    return target


def _hits(replica: str) -> float:
    return parse_metrics(httpx.get(replica + "/metrics", timeout=5).text)["kvflow:prefix_cache_hits_total"]


def _events_settled(url: str) -> None:
    """Until the router's count of applied event batches stops moving (the replicas publish a
    step's events before its outputs go out: they are on their way when the last answer came)."""
    last, deadline = None, time.monotonic() + 20
    while True:
        now = _by_backend(_router_metrics(url), "kvflow_router:kv_event_batches_total")
        if now == last:
            return
        assert time.monotonic() < deadline, "the router's KV event counts do not settle"
        last = now
        time.sleep(0.3)


def test_repeat_prompt_goes_where_it_is_held_after_an_eviction_the_router_never_saw(server):
    url = server
    replicas = [r["url"] for r in httpx.get(url + "/replicas", timeout=5).json()["replicas"]]
    prompt = "The quick brown fox jumps over the lazy dog, again and again. " * 5
    n_tokens = len(httpx.post(url + "/tokenize", json={"prompt": prompt}, timeout=5).json()["tokens"])
    assert n_tokens >= 4 * BS  # several blocks to hold
    _events_settled(url)

    x = _routed(url, prompt)  # the router sends it to x: its prompt-text view says x holds it
    [y] = [r for r in replicas if r != x]
    _complete(y, prompt)  # y computes it too, by a request the router never saw
    for i in range(6):  # x evicts it: other clients' prompts fill its 24-block pool (384 tokens)
        _complete(x, f"{i} Paris is the capital of France, number {i}. " * 8)
    _events_settled(url)

    hits_y = _hits(y)
    assert _routed(url, prompt) == y  # the events say: only y still holds it
    assert _hits(y) - hits_y >= n_tokens // BS * BS - BS  # and y's prefix cache served it

    m = _router_metrics(url)
    assert all(v > 0 for v in _by_backend(m, "kvflow_router:kv_event_batches_total").values())
    assert sum(_by_backend(m, "kvflow_router:kv_event_lost_batches_total").values()) == 0
    assert m.get("kvflow_router:tokenize_failures_total", 0) == 0
    gpu = {k: v for k, v in m.items() if k.startswith("kvflow_router:kv_view_blocks") and 'medium="GPU"' in k}
    assert len(gpu) == 2 and all(0 < v <= 24 for v in gpu.values())


def test_concurrent_chats_sharing_a_short_prefix_spread_over_both_replicas(server):
    url = server

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(i: int) -> int:
                resp = await client.post(
                    url + "/v1/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [
                            {"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": f"Question {i}: what is {i} times {i + 3}?"},
                        ],
                        "max_tokens": 4,
                        "temperature": 0,
                    },
                )
                return resp.status_code

            return await asyncio.gather(*(one(i) for i in range(32)))

    _events_settled(url)
    before = _sent(url)
    assert asyncio.run(burst()) == [200] * 32
    after = _sent(url)
    counts = sorted(after[u] - before.get(u, 0) for u in after)
    assert sum(counts) == 32 and counts[-1] <= 0.6 * 32, counts
