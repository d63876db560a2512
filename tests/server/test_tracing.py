"""OpenTelemetry traces (--otlp-traces-endpoint) of a P/D request through the router: a local OTLP/HTTP
receiver (the protobuf the exporters post, decoded with opentelemetry-proto) gets the spans of the
router, the prefill engine and the decode engine under one trace id, each engine's span the child of
the router's call to it, the client's traceparent kept; streamed or not."""

from __future__ import annotations

import json
import secrets
import threading
import time

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.requests import Request
from starlette.responses import Response

from kvflow.config import EngineConfig, ServerConfig
from kvflow.router.app import build_router_app
from kvflow.router.config import RouterConfig
from kvflow.tracing import traces_url

from server_utils import LiveServer, ThreadServer

pytestmark = pytest.mark.server


class Receiver:
    """An OTLP/HTTP trace receiver: every span posted, flattened."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        app = FastAPI()

        @app.post("/v1/traces")
        async def traces(request: Request) -> Response:
            req = ExportTraceServiceRequest()
            req.ParseFromString(await request.body())
            with self.lock:
                for rs in req.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            self.spans.append(
                                {
                                    "service": service,
                                    "name": s.name,
                                    "trace_id": s.trace_id.hex(),
                                    "span_id": s.span_id.hex(),
                                    "parent": s.parent_span_id.hex(),
                                    "attrs": {a.key: _value(a.value) for a in s.attributes},
                                    "events": [e.name for e in s.events],
                                    "start": s.start_time_unix_nano,
                                    "end": s.end_time_unix_nano,
                                }
                            )
            return Response(b"", media_type="application/x-protobuf")

        self.server = ThreadServer(app)
        self.url = self.server.url

    def trace(self, trace_id: str, want: int, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            if len(spans) >= want:
                return spans
            time.sleep(0.1)
        return spans


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def traced(tiny_llama):
    receiver = Receiver()

    def server(role: str) -> LiveServer:
        return LiveServer(
            EngineConfig(
                model=tiny_llama[0],
                num_kv_blocks=128,
                block_size=4,
                kv_transfer_config={"kv_connector": "tcp", "kv_role": role},
            ),
            ServerConfig(log_interval_s=60, served_model_name="tiny", otlp_traces_endpoint=receiver.url),
        )

    producer, consumer = server("kv_producer"), server("kv_consumer")
    router = ThreadServer(
        build_router_app(
            RouterConfig(port=0, prefill=[producer.url], decode=[consumer.url], otlp_traces_endpoint=receiver.url)
        )
    )
    yield receiver, router
    router.stop()
    for s in (producer, consumer):
        s.stop()
    receiver.server.stop()


def _one(spans: list[dict], service: str, name: str, **attrs) -> dict:
    found = [
        s
        for s in spans
        if s["service"] == service and s["name"] == name and all(s["attrs"].get(k) == v for k, v in attrs.items())
    ]
    assert len(found) == 1, (service, name, attrs, [(s["service"], s["name"], s["attrs"]) for s in spans])
    return found[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_pd_request_is_one_trace(traced, stream):
    receiver, router = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    # (a prompt of its own: one the decode engine already holds would need no transfer)
    prompt = f"the {'streamed' if stream else 'whole'} brown fox jumps over the lazy dog " * 3
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": stream}
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
    if stream:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "text" in json.loads(events[0][6:])["choices"][0]
    else:
        r = httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    spans = receiver.trace(trace_id, want=6)
    request = _one(spans, "kvflow-router", "kvflow.router.request")
    prefill_call = _one(spans, "kvflow-router", "kvflow.router.prefill")
    decode_call = _one(spans, "kvflow-router", "kvflow.router.decode")
    producer = _one(spans, "kvflow-engine", "kvflow.request", **{"kvflow.role": "kv_producer"})
    consumer = _one(spans, "kvflow-engine", "kvflow.request", **{"kvflow.role": "kv_consumer"})
    # parent links: client -> router request -> its calls -> the engines' requests
    assert request["parent"] == client_span
    assert prefill_call["parent"] == decode_call["parent"] == request["span_id"]
    assert producer["parent"] == prefill_call["span_id"]
    assert consumer["parent"] == decode_call["span_id"]
    # what the engine spans say: the prompt's prefill on the producer, the generated tokens on the consumer
    n_prompt = producer["attrs"]["gen_ai.usage.prompt_tokens"]
    assert n_prompt > 20 and consumer["attrs"]["gen_ai.usage.prompt_tokens"] == n_prompt
    assert "prefill_chunk" in producer["events"] and "first_token" in producer["events"]
    assert consumer["attrs"]["gen_ai.usage.completion_tokens"] == 6
    assert "first_token" in consumer["events"]
    # the decode engine fetched the prompt's KV: a span of its own under the consumer's request
    transfer = _one(spans, "kvflow-engine", "kv_transfer")
    assert transfer["parent"] == consumer["span_id"] and transfer["attrs"]["kvflow.ok"] is True
    assert consumer["start"] <= transfer["start"] <= transfer["end"] <= consumer["end"]
    # time nests: the router's request spans its calls, and each call its engine's request
    assert request["start"] <= prefill_call["start"] <= producer["start"] <= producer["end"] <= prefill_call["end"]
    assert decode_call["start"] <= consumer["start"] and consumer["end"] <= request["end"] + 50_000_000


def test_without_a_client_traceparent_the_router_starts_the_trace(traced):
    receiver, router = traced
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi " * 8}], "max_tokens": 3, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with receiver.lock:
            roots = [s for s in receiver.spans if s["name"] == "kvflow.router.request" and not s["parent"]]
        if roots:
            break
        time.sleep(0.1)
    [root] = roots
    spans = receiver.trace(root["trace_id"], want=6)
    assert {(s["service"], s["name"]) for s in spans} == {
        ("kvflow-router", "kvflow.router.request"),
        ("kvflow-router", "kvflow.router.prefill"),
        ("kvflow-router", "kvflow.router.decode"),
        ("kvflow-engine", "kvflow.request"),
        ("kvflow-engine", "kv_transfer"),
    }


def test_otlp_endpoint_checks():
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces" == traces_url("http://c:4318/v1/traces/")
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        ServerConfig(otlp_traces_endpoint="collector:4318")
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        RouterConfig(backends=["http://a:1"], otlp_traces_endpoint="grpc://x")
