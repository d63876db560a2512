"""1P1D over HTTP: `kvflow router` in pd mode in front of a real producer and consumer server
(tiny model, loopback TCP): the client gets the same greedy text as from one engine, streamed or
not, completions and chat; the KV really travelled; afterwards both engines hold no block."""

from __future__ import annotations

import json

import httpx
import pytest

from kvflow.config import EngineConfig, ServerConfig
from kvflow.router.app import build_router_app
from kvflow.router.config import RouterConfig

from server_utils import LiveServer, ThreadServer, parse_metrics, wait_for

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

MODEL = "tiny"
PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "def hello(name):\n    return f'hello {name}'\n" * 2]


def _server(model: str, role: str | None) -> LiveServer:
    kv = None if role is None else {"kv_connector": "tcp", "kv_role": role}
    return LiveServer(
        EngineConfig(model=model, num_kv_blocks=128, block_size=4, max_num_seqs=8, kv_transfer_config=kv),
        ServerConfig(log_interval_s=60, served_model_name=MODEL),
    )


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    single, producer, consumer = (
        _server(tiny_llama[0], None),
        _server(tiny_llama[0], "kv_producer"),
        _server(tiny_llama[0], "kv_consumer"),
    )
    router = ThreadServer(build_router_app(RouterConfig(port=0, prefill=[producer.url], decode=[consumer.url])))
    yield single, producer, consumer, router
    router.stop()
    for s in (single, producer, consumer):
        s.stop()


def _completion(url: str, prompt: str, stream: bool) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def _settled(server: LiveServer) -> None:
    """No request, no transfer in flight, every block free (held blocks released by the consumer)."""

    def idle() -> bool:
        return server.call(
            lambda e: (
                not e.has_unfinished_requests()
                and not e.has_pending_kv_transfers()
                and e.kv_cache.pool.num_free_blocks == e.kv_cache.pool.num_blocks
            )
        )

    wait_for(idle, 10, "the engine still holds requests, transfers or blocks")


def test_router_pd_matches_one_engine(cluster):
    single, producer, consumer, router = cluster
    for prompt in PROMPTS:
        for stream in (False, True):
            assert _completion(router.url, prompt, stream) == _completion(single.url, prompt, False)
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me about foxes and dogs " * 3}],
        "max_tokens": 10,
        "temperature": 0,
    }
    via_router = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=60).json()
    direct = httpx.post(single.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert via_router["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    for s in (producer, consumer):
        _settled(s)
    got = consumer.metrics()
    assert got['kvflow:kv_transfer_blocks_total{direction="received"}'] > 0
    assert (
        producer.metrics()['kvflow:kv_transfer_bytes_total{direction="sent"}']
        == got['kvflow:kv_transfer_bytes_total{direction="received"}']
    )
    assert got["kvflow:kv_transfer_seconds_count"] >= 1


# ---- conditional disaggregation: short prompts prefilled on the decode engine ------------------------------
THRESHOLD = 16  # prompt tokens, as the router estimates them (about 4 characters per token)
SHORT = "a red fox"  # about 2 tokens: the decode engine prefills it
LONG = "a long tale of a red fox who ran far over the hills and came home again at night " * 2  # about 40
LONG2 = "the grey dog slept all day by the fire and dreamt of rabbits in the field " * 2


@pytest.fixture(scope="module")
def conditional_router(cluster):
    _, producer, consumer, _ = cluster
    config = RouterConfig(port=0, prefill=[producer.url], decode=[consumer.url], max_local_prefill_length=THRESHOLD)
    router = ThreadServer(build_router_app(config))
    yield router
    router.stop()


def test_conditional_pd_local_and_remote_prefill_match_one_engine(cluster, conditional_router):
    single, producer, consumer, _ = cluster
    router = conditional_router
    received = 'kvflow:kv_transfer_blocks_total{direction="received"}'
    prefills = f'kvflow_router:requests_total{{backend="{producer.url}",role="prefill"}}'
    cases = [
        (SHORT, False, True),
        (SHORT, True, True),
        (LONG, False, False),
        (LONG2, True, False),
        (LONG, True, True),  # LONG's KV is in the consumer's prefix cache now: 1 token left to compute
    ]
    for prompt, stream, local in cases:
        before = parse_metrics(httpx.get(router.url + "/metrics").text)[prefills]
        fetched = consumer.metrics().get(received, 0.0)
        assert _completion(router.url, prompt, stream) == _completion(single.url, prompt, False)
        after = parse_metrics(httpx.get(router.url + "/metrics").text)[prefills]
        assert after == before + (0 if local else 1), (prompt, stream)
        if local:  # nothing was fetched: a plain request on the consumer
            assert consumer.metrics().get(received, 0.0) == fetched
        else:  # the prompt's KV travelled
            wait_for(lambda f=fetched: consumer.metrics().get(received, 0.0) > f, 10, "no KV was fetched")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi fox"}], "max_tokens": 8, "temperature": 0}
    via_router = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=60).json()
    direct = httpx.post(single.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert via_router["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    m = parse_metrics(httpx.get(router.url + "/metrics").text)
    assert m['kvflow_router:pd_decisions_total{decision="local_prefill"}'] == 4
    assert m['kvflow_router:pd_decisions_total{decision="remote_prefill"}'] == 2
    for s in (producer, consumer):
        _settled(s)
