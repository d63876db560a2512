"""`kvflow router` against fake kvflow servers: small FastAPI apps on uvicorn in threads that record
what they are sent and answer as a prefill engine (kv_transfer_params) or a decode engine would.
No model, no engine: this is the proxy's behaviour only."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvflow.cli.main import main as kvflow_main
from kvflow.router import RouterConfig, build_router_app
from kvflow.router.pd import prefill_body, takes_prefill_step

from server_utils import ThreadServer, parse_metrics, wait_for

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

AUTH = {"Authorization": "Bearer sk-test"}


# ---- servers in threads ---------------------------------------------------------------------------------
def dead_url() -> str:
    """A 127.0.0.1 port nobody listens on (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class FakeEngine:
    """A fake kvflow server. `mode` says how POST /v1/* answers:
    prefill | no_params | error_400 | error_500 | decode (JSON or SSE, by the body's stream) |
    endless (an SSE stream that ticks until the client leaves) | broken (an SSE stream cut midway)."""

    def __init__(self, name: str, mode: str) -> None:
        self.name = name
        self.mode = mode
        self.calls: list[dict[str, Any]] = []
        self.release = threading.Event()  # decode streams wait for it after their first chunk
        self.closed = threading.Event()  # an endless stream ended (its client went away)
        self.healthy = True
        self.transfers = 0
        app = FastAPI()

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def generate(request: Request) -> Response:
            body = json.loads(await request.body())
            self.calls.append(
                {"path": request.url.path, "body": body, "authorization": request.headers.get("authorization")}
            )
            return self.answer(request.url.path, body)

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": f"model-of-{self.name}", "object": "model"}]})

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok"}, status_code=200 if self.healthy else 503)

        self.server = ThreadServer(app)
        self.url = self.server.url

    def reset(self, mode: str | None = None) -> None:
        self.calls.clear()
        self.release.clear()
        self.closed.clear()
        self.healthy = True
        if mode is not None:
            self.mode = mode

    def answer(self, path: str, body: dict[str, Any]) -> Response:
        if self.mode == "prefill":
            self.transfers += 1
            params = {
                "do_remote_prefill": True,
                "remote_host": "127.0.0.1",
                "remote_port": 41234,
                "remote_transfer_id": f"{self.name}-{self.transfers}",
            }
            return JSONResponse(
                {"object": "text_completion", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params}
            )
        if self.mode == "no_params":
            return JSONResponse({"object": "text_completion", "choices": [{"index": 0, "text": "x"}]})
        if self.mode == "error_400":
            return JSONResponse(
                {
                    "error": {
                        "message": "temperature: bad",
                        "type": "invalid_request_error",
                        "param": "temperature",
                        "code": "invalid_value",
                    }
                },
                status_code=400,
            )
        if self.mode == "error_500":
            return JSONResponse(
                {"error": {"message": "boom", "type": "server_error", "param": None, "code": "engine_error"}},
                status_code=500,
            )
        if self.mode == "overloaded":
            return JSONResponse(
                {"error": {"message": "busy", "type": "server_error", "param": None, "code": "overloaded"}},
                status_code=503,
                headers={"Retry-After": "3"},
            )
        if not body.get("stream"):
            return JSONResponse(
                {
                    "object": "text_completion",
                    "decoded_by": self.name,
                    "kv_transfer_params_seen": body.get("kv_transfer_params"),
                }
            )
        return StreamingResponse(self.stream(), media_type="text/event-stream")

    async def stream(self):
        def event(i: int) -> bytes:
            return f'data: {{"i": {i}, "by": "{self.name}"}}\n\n'.encode()

        try:
            yield event(0)
            if self.mode == "endless":
                i = 1
                while True:
                    await asyncio.sleep(0.05)
                    yield event(i)
                    i += 1
            released = await asyncio.to_thread(self.release.wait, 10)
            yield event(1) if released else b'data: "not released"\n\n'
            if self.mode == "broken":
                raise RuntimeError("the engine fell over mid-stream")  # uvicorn cuts the connection
            yield event(2)
            yield b"data: [DONE]\n\n"
        finally:
            self.closed.set()


class LiveRouter:
    def __init__(self, **config: Any) -> None:
        self.app = build_router_app(RouterConfig(port=0, connect_timeout_s=2, health_timeout_s=2, **config))
        self.router = self.app.state.router
        self.server = ThreadServer(self.app)
        self.url = self.server.url

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=AUTH, timeout=10, **kwargs)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics").text)

    def inflight(self) -> dict[str, int]:
        return {f"{b.role}:{b.url}": b.inflight for b in self.router.policy.backends()}


# ---- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    e = {
        "prefill": FakeEngine("prefill", "prefill"),
        "decode1": FakeEngine("decode1", "decode"),
        "decode2": FakeEngine("decode2", "decode"),
    }
    yield e
    for x in e.values():
        x.release.set()
        x.server.stop()


@pytest.fixture(scope="module")
def pd_router(engines):
    r = LiveRouter(prefill=[engines["prefill"].url], decode=[engines["decode1"].url, engines["decode2"].url])
    yield r
    r.server.stop()


@pytest.fixture
def fakes(engines):
    engines["prefill"].reset("prefill")
    engines["decode1"].reset("decode")
    engines["decode2"].reset("decode")
    return engines


def decode_calls(fakes) -> list[dict[str, Any]]:
    return fakes["decode1"].calls + fakes["decode2"].calls


def decoder(fakes) -> FakeEngine:
    """The decode engine the (only) request of a test went to."""
    [engine] = [e for e in (fakes["decode1"], fakes["decode2"]) if e.calls]
    return engine


def last_params(fakes) -> dict[str, Any]:
    """What the prefill fake returned last."""
    return {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 41234,
        "remote_transfer_id": f"prefill-{fakes['prefill'].transfers}",
    }


# ---- the pd flow ----------------------------------------------------------------------------------------------
def test_pd_completion_prefill_then_decode(pd_router, fakes):
    original = {
        "model": "m",
        "prompt": "The capital of France is",
        "max_tokens": 20,
        "temperature": 0,
        "min_tokens": 3,
        "priority": 2,
    }
    resp = pd_router.post("/v1/completions", original)
    assert resp.status_code == 200, resp.text

    [pre] = fakes["prefill"].calls
    assert pre["path"] == "/v1/completions"
    assert pre["authorization"] == AUTH["Authorization"]
    expected = {**original, "max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True}}
    del expected["min_tokens"]  # would make max_tokens 1 a 400
    assert pre["body"] == expected

    [dec] = decode_calls(fakes)
    params = last_params(fakes)
    assert dec["body"] == {**original, "kv_transfer_params": params}  # the original body, plus the params
    assert dec["authorization"] == AUTH["Authorization"]
    # the decode engine's answer, unchanged
    assert resp.json() == {
        "object": "text_completion",
        "decoded_by": decoder(fakes).name,
        "kv_transfer_params_seen": params,
    }
    assert all(v == 0 for v in pd_router.inflight().values())


def test_pd_chat_stream_relayed_unbuffered_in_order(pd_router, fakes):
    original = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
        "max_tokens": 40,
    }
    with httpx.stream(
        "POST", pd_router.url + "/v1/chat/completions", json=original, headers=AUTH, timeout=httpx.Timeout(3)
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        # The decode engine sends more only once this first chunk arrived: a buffering router would
        # time out here instead.
        engine = decoder(fakes)
        assert json.loads(first.removeprefix("data: ")) == {"i": 0, "by": engine.name}
        engine.release.set()
        rest = [line for line in lines if line]
    assert [json.loads(x.removeprefix("data: "))["i"] for x in rest[:-1]] == [1, 2]
    assert rest[-1] == "data: [DONE]"

    [pre] = fakes["prefill"].calls
    assert pre["path"] == "/v1/chat/completions"
    assert pre["body"] == {
        "messages": original["messages"],
        "max_completion_tokens": 1,
        "max_tokens": 1,
        "stream": False,
        "n": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    [dec] = decode_calls(fakes)
    assert dec["body"] == {**original, "kv_transfer_params": last_params(fakes)}
    wait_for(lambda: all(v == 0 for v in pd_router.inflight().values()), 5, "in-flight counts did not drop")


def test_prefill_without_params_sends_the_original_body(pd_router, fakes):
    fakes["prefill"].mode = "no_params"
    original = {"prompt": [1, 2, 3], "max_tokens": 5}
    assert pd_router.post("/v1/completions", original).status_code == 200
    [dec] = decode_calls(fakes)
    assert dec["body"] == original  # nothing to fetch: the decode engine recomputes


def test_round_robin_over_decode_engines(pd_router, fakes):
    for _ in range(4):
        assert pd_router.post("/v1/completions", {"prompt": "x"}).status_code == 200
    assert len(fakes["decode1"].calls) == len(fakes["decode2"].calls) == 2
    assert len(fakes["prefill"].calls) == 4
    ids = [c["body"]["kv_transfer_params"]["remote_transfer_id"] for c in decode_calls(fakes)]
    assert len(set(ids)) == 4  # each decode got the params of its own prefill


@pytest.mark.parametrize("body", [{"prompt": "x", "n": 2}, {"prompt": ["a", "b"]}])
def test_n_above_1_and_several_prompts_skip_the_prefill(pd_router, fakes, body):
    assert pd_router.post("/v1/completions", body).status_code == 200
    assert not fakes["prefill"].calls
    [dec] = decode_calls(fakes)
    assert dec["body"] == body


def test_prefill_4xx_is_returned_as_is(pd_router, fakes):
    fakes["prefill"].mode = "error_400"
    resp = pd_router.post("/v1/completions", {"prompt": "x", "temperature": -1})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "temperature"
    assert not decode_calls(fakes)  # a bad request stays a bad request


def test_prefill_5xx_falls_back_to_decode(pd_router, fakes):
    fakes["prefill"].mode = "error_500"
    before = pd_router.metrics().get("kvflow_router:prefill_fallbacks_total", 0)
    original = {"prompt": "x", "max_tokens": 7}
    resp = pd_router.post("/v1/completions", original)
    assert resp.status_code == 200
    [dec] = decode_calls(fakes)
    assert dec["body"] == original
    metrics = pd_router.metrics()
    assert metrics["kvflow_router:prefill_fallbacks_total"] == before + 1
    key = f'kvflow_router:errors_total{{backend="{fakes["prefill"].url}",reason="http_5xx"}}'
    assert metrics[key] >= 1


def test_decode_status_and_retry_after_relayed(pd_router, fakes):
    fakes["decode1"].mode = fakes["decode2"].mode = "overloaded"
    resp = pd_router.post("/v1/completions", {"prompt": "x", "stream": True})
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "3"
    assert resp.json()["error"]["code"] == "overloaded"


def test_client_disconnect_closes_the_upstream_stream(pd_router, fakes):
    fakes["decode1"].mode = fakes["decode2"].mode = "endless"
    with httpx.stream(
        "POST", pd_router.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=5
    ) as resp:
        assert next(line for line in resp.iter_lines() if line).startswith("data: ")
    engine = decoder(fakes)
    assert engine.closed.wait(5), "the decode engine's stream went on after the client left"
    wait_for(lambda: all(v == 0 for v in pd_router.inflight().values()), 5, "in-flight counts did not drop")


def test_decode_failing_mid_stream_ends_with_an_error_event(pd_router, fakes):
    fakes["decode1"].mode = fakes["decode2"].mode = "broken"
    for e in (fakes["decode1"], fakes["decode2"]):
        e.release.set()
    with httpx.stream(
        "POST", pd_router.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=5
    ) as resp:
        events = [line for line in resp.iter_lines() if line]
    assert json.loads(events[0].removeprefix("data: "))["i"] == 0
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "backend_stream_broken"
    assert events[-1] == "data: [DONE]"


def test_models_health_metrics(pd_router, fakes):
    models = httpx.get(pd_router.url + "/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "model-of-decode1"
    health = httpx.get(pd_router.url + "/health")
    assert health.status_code == 200, health.text
    fakes["decode2"].healthy = False
    health = httpx.get(pd_router.url + "/health")
    assert health.status_code == 503
    assert health.json()["failed"] == {fakes["decode2"].url: "HTTP 503"}

    pd_router.post("/v1/completions", {"prompt": "x"})
    text = httpx.get(pd_router.url + "/metrics").text
    assert "# TYPE kvflow_router:requests_total counter" in text
    metrics = parse_metrics(text)
    assert metrics[f'kvflow_router:requests_total{{backend="{fakes["prefill"].url}",role="prefill"}}'] >= 1
    assert metrics[f'kvflow_router:requests_total{{backend="{fakes["decode1"].url}",role="decode"}}'] >= 1


def test_unknown_route_and_bad_json(pd_router, fakes):
    resp = httpx.get(pd_router.url + "/v2/nothing")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    # not a JSON object: straight to the first decode engine, to answer it (the fake echoes nothing)
    fakes["decode1"].mode = "error_400"
    resp = httpx.post(pd_router.url + "/v1/completions", content=b'{"prompt": NaN}', timeout=10)
    assert resp.status_code == 400
    assert not fakes["prefill"].calls


# ---- conditional disaggregation (--max-local-prefill-length) ---------------------------------------------------
LOCAL = 'kvflow_router:pd_decisions_total{decision="local_prefill"}'
REMOTE = 'kvflow_router:pd_decisions_total{decision="remote_prefill"}'


def test_threshold_zero_sends_short_prompts_through_prefill_too(pd_router, fakes):
    before = pd_router.metrics()
    assert pd_router.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert len(fakes["prefill"].calls) == 1
    [dec] = decode_calls(fakes)
    assert dec["body"]["kv_transfer_params"] == last_params(fakes)
    after = pd_router.metrics()
    assert after[LOCAL] == before[LOCAL] == 0  # the series exists from the start
    assert after[REMOTE] == before[REMOTE] + 1


def test_short_prompt_goes_to_decode_alone_long_one_through_prefill(fakes):
    r = LiveRouter(prefill=[fakes["prefill"].url], decode=[fakes["decode1"].url], max_local_prefill_length=64)
    try:
        short = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of Japan?"}]}
        resp = r.post("/v1/chat/completions", short)
        assert resp.status_code == 200, resp.text
        assert not fakes["prefill"].calls
        [dec] = fakes["decode1"].calls
        assert dec["body"] == short  # untouched: the decode engine serves it as a plain request
        assert resp.json()["kv_transfer_params_seen"] is None

        long = {"model": "m", "prompt": "a long document about trains " * 100, "max_tokens": 3}
        resp = r.post("/v1/completions", long)
        assert resp.status_code == 200, resp.text
        [pre] = fakes["prefill"].calls
        assert pre["body"]["kv_transfer_params"] == {"do_remote_decode": True} and pre["body"]["max_tokens"] == 1
        assert fakes["decode1"].calls[1]["body"] == {**long, "kv_transfer_params": last_params(fakes)}

        fakes["decode1"].release.set()
        with httpx.stream("POST", r.url + "/v1/completions", json={"prompt": "hi", "stream": True}, timeout=5) as s:
            events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and len(fakes["prefill"].calls) == 1  # streamed, still local

        m = r.metrics()
        assert (m[LOCAL], m[REMOTE]) == (2, 1)
        assert m[f'kvflow_router:requests_total{{backend="{fakes["prefill"].url}",role="prefill"}}'] == 1
        assert m[f'kvflow_router:requests_total{{backend="{fakes["decode1"].url}",role="decode"}}'] == 3
        assert "# TYPE kvflow_router:pd_decisions_total counter" in httpx.get(r.url + "/metrics").text
        wait_for(lambda: all(v == 0 for v in r.inflight().values()), 5, "in-flight counts did not drop")
    finally:
        r.server.stop()


# ---- failures of whole backends ---------------------------------------------------------------------------------
def test_prefill_down_falls_back_and_is_counted(fakes):
    down = dead_url()
    r = LiveRouter(prefill=[down], decode=[fakes["decode1"].url])
    try:
        original = {"prompt": "x", "max_tokens": 3}
        resp = r.post("/v1/completions", original)
        assert resp.status_code == 200, resp.text
        assert fakes["decode1"].calls[0]["body"] == original
        metrics = r.metrics()
        assert metrics["kvflow_router:prefill_fallbacks_total"] == 1
        assert metrics[f'kvflow_router:errors_total{{backend="{down}",reason="unreachable"}}'] == 1
        health = httpx.get(r.url + "/health")
        assert health.status_code == 503 and set(health.json()["failed"]) == {down}
    finally:
        r.server.stop()


def test_decode_down_is_a_502_naming_it(fakes):
    down = dead_url()
    r = LiveRouter(prefill=[fakes["prefill"].url], decode=[down])
    try:
        for stream in (False, True):
            resp = r.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": stream})
            assert resp.status_code == 502
            err = resp.json()["error"]
            assert down in err["message"] and err["code"] == "backend_unreachable" and err["type"] == "server_error"
        assert httpx.get(r.url + "/v1/models").status_code == 502
        assert r.metrics()[f'kvflow_router:errors_total{{backend="{down}",reason="unreachable"}}'] == 3
    finally:
        r.server.stop()


def test_round_robin_policy_is_a_plain_proxy(fakes):
    r = LiveRouter(backends=[fakes["decode1"].url, fakes["decode2"].url])
    try:
        body = {"prompt": "x", "max_tokens": 4}
        got = [r.post("/v1/completions", body).json()["decoded_by"] for _ in range(4)]
        assert got == ["decode1", "decode2", "decode1", "decode2"]
        assert all(c["body"] == body for c in decode_calls(fakes))  # untouched
        assert not fakes["prefill"].calls
        assert r.metrics()[f'kvflow_router:requests_total{{backend="{fakes["decode1"].url}",role="backend"}}'] == 2
    finally:
        r.server.stop()


# ---- the protocol and the flags ------------------------------------------------------------------------------
def test_prefill_body_is_a_copy():
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}, "n": 1}
    out = prefill_body("/v1/completions", body)
    assert body["stream"] is True and "stream_options" in body  # the client's body is kept for the decode
    assert out == {
        "prompt": "x",
        "stream": False,
        "n": 1,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    # completions have no max_completion_tokens; chat sets it only when the client did
    assert "max_completion_tokens" not in prefill_body("/v1/chat/completions", {"messages": []})
    assert takes_prefill_step("/v1/completions", {"prompt": [[1, 2]]})  # one token-id prompt
    assert not takes_prefill_step("/v1/completions", {"prompt": [[1], [2]]})


def test_config_normalises_urls():
    c = RouterConfig(prefill=["http://127.0.0.1:8100/"], decode=[" http://127.0.0.1:8200"])
    assert (c.policy, c.prefill, c.decode) == ("pd", ["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"])
    assert RouterConfig(backends=["http://h:1"]).policy == "round_robin"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--prefill", "http://a:1"], "--decode"),
        (["--decode", "http://a:1"], "--prefill"),
        (["--backend", "http://a:1", "--decode", "http://b:1"], "--backend"),
        (["--policy", "round_robin", "--prefill", "http://a:1", "--decode", "http://b:1"], "--prefill"),
        (["--policy", "pd", "--backend", "http://a:1"], "--backend"),
        (["--policy", "round_robin"], "--backend"),
        ([], "--prefill"),
        (["--backend", "127.0.0.1:8100"], "--backend"),
        (["--decode", "http://a:1", "http://a:1/", "--prefill", "http://p:1"], "--decode"),
        (["--backend", "http://a:1", "--timeout-s", "0"], "--timeout-s"),
    ],
)
def test_cli_flag_errors(argv, fragment, capsys):
    assert kvflow_main(["router", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvflow: error: ") and fragment in err, err


def test_cli_unknown_policy_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        kvflow_main(["router", "--policy", "random", "--backend", "http://a:1"])
    assert e.value.code == 2 and "--policy" in capsys.readouterr().err


# ---- data-parallel replicas: retries, health, load ----------------------------------------------------------
class ReplicaFake(FakeEngine):
    """A FakeEngine that also serves /metrics with the load gauges a kvflow server exports, and
    can fail a stream before its first chunk (`early_break`)."""

    def __init__(self, name: str, mode: str = "decode") -> None:
        super().__init__(name, mode)
        self.running, self.waiting, self.kv_usage = 0, 0, 0.0

        async def metrics() -> Response:
            return Response(
                f"kvflow:num_requests_running {self.running}\nkvflow:num_requests_waiting "
                f"{self.waiting}\nkvflow:kv_cache_usage_perc {self.kv_usage}\n",
                media_type="text/plain",
            )

        self.server.app.add_api_route("/metrics", metrics, methods=["GET"])

    def answer(self, path: str, body: dict[str, Any]) -> Response:
        if self.mode == "early_break":

            async def cut():
                raise RuntimeError("died before the first token")  # uvicorn cuts the connection
                yield b""  # unreachable: makes this an async generator

            return StreamingResponse(cut(), media_type="text/event-stream")
        return super().answer(path, body)


@pytest.fixture(scope="module")
def replica_engines():
    e = [ReplicaFake("r1"), ReplicaFake("r2")]
    yield e
    for x in e:
        x.release.set()
        x.server.stop()


@pytest.fixture
def replicas(replica_engines):
    for x in replica_engines:
        x.reset("decode")
        x.running, x.waiting, x.kv_usage = 0, 0, 0.0
    return replica_engines


def _m(router: LiveRouter, name: str, url: str | None = None) -> float:
    key = name if url is None else f'{name}{{backend="{url}"}}'
    return router.metrics().get(key, 0.0)


def test_replica_5xx_is_retried_once_on_another(replicas):
    r1, r2 = replicas
    r = LiveRouter(backends=[r1.url, r2.url])
    try:
        r1.mode = "error_500"
        r2.release.set()  # its stream runs to the end
        for stream in (False, True):
            resp = r.post("/v1/completions", {"prompt": "x", "stream": stream})
            assert resp.status_code == 200, resp.text
        # round robin: r1, retried on r2; r1 again (the retry took r2's turn), retried on r2
        assert len(r1.calls) == 2 and len(r2.calls) == 2
        assert [c["body"] for c in r2.calls] == [c["body"] for c in r1.calls]  # the same body again
        assert _m(r, "kvflow_router:retries_total") == 2
        r2.mode = "overloaded"  # both fail: one retry only, then the client gets the last answer
        resp = r.post("/v1/completions", {"prompt": "x"})
        assert resp.status_code in (500, 503)
        assert len(r1.calls) + len(r2.calls) == 6 and _m(r, "kvflow_router:retries_total") == 3
        assert all(v == 0 for v in r.inflight().values())
    finally:
        r.server.stop()


def test_unreachable_replica_is_retried_and_taken_out(replicas):
    r1 = replicas[0]
    doomed = FakeEngine("doomed", "decode")
    # The first probe (at start) finds both healthy; the next one is far away.
    r = LiveRouter(backends=[doomed.url, r1.url], health_interval_s=60)
    try:
        wait_for(lambda: _m(r, "kvflow_router:backend_healthy", doomed.url) == 1, 5, "no health state")
        doomed.server.stop()  # refuses connections from now on
        for _ in range(4):
            assert r.post("/v1/completions", {"prompt": "x"}).json()["decoded_by"] == "r1"
        # out of rotation at the first refused connection, long before the next probe
        m = r.metrics()
        sent = m[f'kvflow_router:requests_total{{backend="{doomed.url}",role="backend"}}']
        assert 1 <= sent <= 2 and m["kvflow_router:retries_total"] == sent  # (a dead keep-alive may go first)
        assert m[f'kvflow_router:backend_healthy{{backend="{doomed.url}"}}'] == 0
        assert m[f'kvflow_router:backend_healthy{{backend="{r1.url}"}}'] == 1
        assert m[f'kvflow_router:backend_unhealthy_total{{backend="{doomed.url}"}}'] == 1
        for _ in range(4):
            assert r.post("/v1/completions", {"prompt": "x"}).json()["decoded_by"] == "r1"
        assert r.metrics()[f'kvflow_router:requests_total{{backend="{doomed.url}",role="backend"}}'] == sent
    finally:
        r.server.stop()


def test_health_checker_takes_replicas_out_and_back(replicas):
    r1, r2 = replicas
    r = LiveRouter(backends=[r1.url, r2.url], health_interval_s=0.05)
    try:
        r1.healthy = False
        wait_for(lambda: _m(r, "kvflow_router:backend_healthy", r1.url) == 0, 5, "r1 stayed in rotation")
        got = [r.post("/v1/completions", {"prompt": "x"}).json()["decoded_by"] for _ in range(3)]
        assert got == ["r2"] * 3
        r1.healthy = True
        wait_for(lambda: _m(r, "kvflow_router:backend_healthy", r1.url) == 1, 5, "r1 did not come back")
        got = {r.post("/v1/completions", {"prompt": "x"}).json()["decoded_by"] for _ in range(2)}
        assert got == {"r1", "r2"}
        assert _m(r, "kvflow_router:backend_unhealthy_total", r1.url) == 1
    finally:
        r.server.stop()


def test_stream_failing_before_its_first_chunk_is_retried(replicas):
    r1, r2 = replicas
    r = LiveRouter(backends=[r1.url, r2.url])
    try:
        r1.mode = "early_break"
        r2.release.set()
        with httpx.stream("POST", r.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=5) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line]
        assert [json.loads(e.removeprefix("data: "))["by"] for e in events[:-1]] == ["r2"] * 3
        assert _m(r, "kvflow_router:retries_total") == 1
        r2.mode = "early_break"  # nowhere else to go: an HTTP error, nothing was relayed yet
        resp = r.post("/v1/completions", {"prompt": "x", "stream": True})
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "backend_unreachable"
    finally:
        r.server.stop()


def test_replica_failing_mid_stream_is_not_retried(replicas):
    r1, r2 = replicas
    r = LiveRouter(backends=[r1.url, r2.url])
    try:
        r1.mode = r2.mode = "broken"
        r1.release.set()
        r2.release.set()
        with httpx.stream("POST", r.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=5) as resp:
            events = [line for line in resp.iter_lines() if line]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "backend_stream_broken"
        assert _m(r, "kvflow_router:retries_total") == 0
    finally:
        r.server.stop()


def test_least_loaded_reads_each_replicas_metrics(replicas):
    r1, r2 = replicas
    r1.running, r1.waiting = 6, 4
    r2.running = 3
    r = LiveRouter(backends=[r1.url, r2.url], policy="least_loaded", load_poll_s=0.05)
    try:
        b1, b2 = r.router.policy.backends()
        wait_for(lambda: (b1.engine_load, b2.engine_load) == (10, 3), 5, "the loads were not scraped")
        got = [r.post("/v1/completions", {"prompt": "x"}).json()["decoded_by"] for _ in range(3)]
        assert got == ["r2"] * 3
        r2.waiting = 20
        wait_for(lambda: b2.engine_load == 23, 5, "the new load was not scraped")
        assert r.post("/v1/completions", {"prompt": "x"}).json()["decoded_by"] == "r1"
    finally:
        r.server.stop()


def test_cache_aware_over_http_counts_hits_misses_and_ttfb(replicas):
    r1, r2 = replicas
    r = LiveRouter(backends=[r1.url, r2.url], policy="cache_aware")
    try:
        system = {"role": "system", "content": "You are a helpful assistant who knows a lot about trains. " * 3}
        served = [
            r.post("/v1/chat/completions", {"messages": [system, {"role": "user", "content": q}]}).json()["decoded_by"]
            for q in ("hi", "hello", "hey there")
        ]
        assert len(set(served)) == 1
        other = r.post("/v1/completions", {"prompt": "something else entirely " * 4}).json()["decoded_by"]
        assert other != served[0]  # a miss goes to the idle replica, not the same one every time
        m = r.metrics()
        assert (m["kvflow_router:cache_aware_hits_total"], m["kvflow_router:cache_aware_misses_total"]) == (2, 2)
        assert m["kvflow_router:prefix_match_ratio_count"] == 4
        assert m['kvflow_router:prefix_match_ratio_bucket{le="0.5"}'] == 2
        assert m["kvflow_router:time_to_first_byte_seconds_count"] == 4
        # every request answered: nothing left in flight, in requests or in their sized work
        backends = r.router.policy.backends()
        assert all(b.inflight == 0 and b.inflight_work == 0.0 for b in backends), backends
    finally:
        r.server.stop()
