"""The HTTP side of prefill/decode disaggregation: `kv_transfer_params` in a request body reaches
`SamplingParams`, and what an engine sets on `RequestOutput.kv_transfer_params` comes back top-level
in the response (streamed: on the chunk with finish_reason). The engine here is a plain one; a
producer engine's answer is imitated by setting the field on the finished outputs."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from kvflow.config import EngineConfig, ServerConfig
from kvflow.engine.async_llm import RequestHandle

from server_utils import LiveServer

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

PRODUCED = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 41234, "remote_transfer_id": "xfer-1"}
# Opaque to the HTTP layer, and asks the engine for no transfer (it has no connector here).
MARKER = {"fake_producer": True}


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = LiveServer(
        EngineConfig(model=tiny_llama[0], num_kv_blocks=128, max_num_seqs=8), ServerConfig(log_interval_s=60)
    )
    yield s
    s.stop()


@pytest.fixture
def seen(server, monkeypatch):
    """The SamplingParams of each request the server adds; a request whose kv_transfer_params are
    MARKER gets PRODUCED on its finished output, as a producer engine would set it."""
    params_of: dict[str, object] = {}
    add = server.llm.add_request

    async def recording_add(request_id, prompt, params, **kwargs):
        params_of[request_id] = params
        return await add(request_id, prompt, params, **kwargs)

    put = RequestHandle._put

    def producing_put(self, out):
        params = params_of.get(self.request_id)
        if out.finished and params is not None and params.kv_transfer_params == MARKER:
            out = dataclasses.replace(out, kv_transfer_params=dict(PRODUCED))
        put(self, out)

    monkeypatch.setattr(server.llm, "add_request", recording_add)
    monkeypatch.setattr(RequestHandle, "_put", producing_put)
    return params_of


def post(server, path, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "Once upon a time"}


@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_request_field_reaches_sampling_params_and_response_carries_it(server, seen, path, base):
    body = {**base, "max_tokens": 3, "temperature": 0, "kv_transfer_params": MARKER}
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    [params] = seen.values()
    assert params.kv_transfer_params == MARKER
    assert resp.json()["kv_transfer_params"] == PRODUCED


@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_stream_puts_it_on_the_final_chunk_only(server, seen, path, base):
    body = {
        **base,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": MARKER,
    }
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    with_params = [c for c in chunks if "kv_transfer_params" in c]
    assert len(with_params) == 1 and with_params[0]["kv_transfer_params"] == PRODUCED
    assert with_params[0]["choices"][0]["finish_reason"] == "length"
    assert "kv_transfer_params" not in chunks[-1]  # the usage chunk comes after, without it


@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_absent_unless_the_engine_sets_it(server, seen, path, base):
    resp = post(server, path, {**base, "max_tokens": 2})
    assert resp.status_code == 200
    assert "kv_transfer_params" not in resp.json()
    [params] = seen.values()
    assert params.kv_transfer_params is None
    with httpx.stream("POST", server.url + path, json={**base, "max_tokens": 2, "stream": True}, timeout=30) as r:
        assert all("kv_transfer_params" not in line for line in r.iter_lines())


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({**COMPLETION, "n": 2, "kv_transfer_params": MARKER}, "n=1"),
        ({"prompt": ["a", "b"], "kv_transfer_params": MARKER}, "single prompt"),
        ({**COMPLETION, "kv_transfer_params": [1]}, ""),
        ({**COMPLETION, "kv_transfer_params": "x"}, ""),
    ],
)
def test_refused_with_400_naming_it(server, body, fragment):
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "kv_transfer_params" and fragment in err["message"], err


def test_openapi_declares_the_field(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        field = doc["components"]["schemas"][name]["properties"]["kv_transfer_params"]
        assert {"type": "object", "additionalProperties": True} in field["anyOf"], field
