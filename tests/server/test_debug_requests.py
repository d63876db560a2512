"""GET /debug/requests/{id}: what a finished request waited through (the engine's step records),
behind the API key, with OpenAI's 404 for an unknown id."""

from __future__ import annotations

import httpx
import pytest

from kvflow.config import EngineConfig, ServerConfig

from server_utils import LiveServer

pytestmark = pytest.mark.server

KEY = {"Authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = LiveServer(EngineConfig(model=tiny_llama[0], num_kv_blocks=64), ServerConfig(api_key="sekret"))
    yield s
    s.stop()


def test_a_finished_chat_completion_is_explained(server):
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 3,
        "n": 2,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    chat = httpx.post(server.url + "/v1/chat/completions", json=body, headers=KEY, timeout=60)
    assert chat.status_code == 200, chat.text
    rid = chat.json()["id"]
    r = httpx.get(f"{server.url}/debug/requests/{rid}", headers=KEY)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["request_id"] == rid and answer["status"] == "finished" and answer["prompt_tokens"] > 0
    assert answer["ring"]["capacity"] == 4096
    assert [s["id"] for s in answer["sequences"]] == [f"{rid}#0", f"{rid}#1"]
    for seq in answer["sequences"]:
        pre = seq["before_first_token"]
        assert pre["steps_scheduled"] >= 1 and pre["own_tokens"] == answer["prompt_tokens"]
        assert pre["step_list"][-1]["own"]["sampled"] and pre["duration_s"] > 0
        assert {"step", "time", "duration_s", "predicted_s", "tokens", "others", "excess_s"} <= set(pre["step_list"][0])
        assert seq["between_tokens"]["gaps"] == 2


def test_a_completion_of_several_prompts_is_explained_per_prompt(server):
    body = {"model": server.model, "prompt": ["one", "two"], "max_tokens": 2}
    done = httpx.post(server.url + "/v1/completions", json=body, headers=KEY, timeout=60)
    assert done.status_code == 200, done.text
    rid = done.json()["id"]
    answer = httpx.get(f"{server.url}/debug/requests/{rid}", headers=KEY).json()
    assert [p["request_id"] for p in answer["prompts"]] == [f"{rid}-0", f"{rid}-1"]


def test_unknown_id_is_a_404_in_openais_shape(server):
    r = httpx.get(f"{server.url}/debug/requests/chatcmpl-nope", headers=KEY)
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "not_found" and error["param"] == "request_id" and error["type"]
    assert "chatcmpl-nope" in error["message"] and "expired" in error["message"]


def test_the_route_needs_the_api_key(server):
    r = httpx.get(f"{server.url}/debug/requests/chatcmpl-nope")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/debug/requests/chatcmpl-nope", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_the_debug_route_is_not_in_the_public_spec(server):
    spec = httpx.get(server.url + "/openapi.json", headers=KEY).json()
    assert not any(p.startswith("/debug/") for p in spec["paths"])
