"""The router in front of two real engines, driven by the real `openai` and `anthropic` clients: the
Responses API (a conversation continued across turns lands on the engine that stores it, retrieve and
delete find it), Anthropic's Messages API (the x-api-key header reaches the engines), embeddings, scores and reranks
pass through the router as they are answered by one engine directly."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from kvflow.config import EngineConfig, ServerConfig
from kvflow.router import RouterConfig, build_router_app
from kvflow.router.prefix_tree import prompt_texts

from server_utils import LiveServer, ThreadServer

pytestmark = pytest.mark.server

KEY = "sk-router-test"


@pytest.fixture(scope="module")
def engines(model_factory):
    path, _ = model_factory("llama", max_position_embeddings=2048)
    servers = [
        LiveServer(EngineConfig(model=path, num_kv_blocks=256), ServerConfig(api_key=KEY, responses_store_size=64))
        for _ in range(2)
    ]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def router(engines):
    # Round robin: without the router finding a stored response's engine, every other turn of a
    # conversation would go to the engine that does not have it.
    app = build_router_app(
        RouterConfig(port=0, backends=[e.url for e in engines], policy="round_robin", health_interval_s=60)
    )
    server = ThreadServer(app)
    yield server.url, app.state.router
    server.stop()


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_a_responses_conversation_follows_its_store(router, engines):
    url, r = router
    client = _openai(url)
    resp = client.responses.create(model=engines[0].model, input="Say hello.", max_output_tokens=6, temperature=0)
    ids = [resp.id]
    for turn in range(4):  # round robin alternates engines: each turn must find the previous one's
        resp = client.responses.create(
            model=engines[0].model,
            input=f"And again, turn {turn}.",
            previous_response_id=resp.id,
            max_output_tokens=6,
            temperature=0,
        )
        assert resp.error is None and resp.usage.output_tokens > 0  # (incomplete: max_output_tokens reached)
        ids.append(resp.id)
    # Each response is stored on exactly one engine, and the router retrieves every one of them.
    for rid in ids:
        held = [httpx.get(f"{e.url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {KEY}"}) for e in engines]
        assert sorted(h.status_code for h in held) == [200, 404]
        assert client.responses.retrieve(rid).id == rid
    # Stored where the turn before it was stored: the whole chain on one engine.
    homes = {r._response_homes[rid].url for rid in ids[:-1]}
    assert len(homes) == 1
    client.responses.delete(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.BadRequestError, match="resp_nowhere"):  # the engine's own answer
        client.responses.create(
            model=engines[0].model, input="x", previous_response_id="resp_nowhere", max_output_tokens=2
        )


def test_a_continued_response_equals_the_engine_answering_directly(router, engines):
    url, _ = router
    via_router = _openai(url)
    first = via_router.responses.create(model=engines[0].model, input="Count:", max_output_tokens=5, temperature=0)
    home = next(
        e
        for e in engines
        if httpx.get(f"{e.url}/v1/responses/{first.id}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    )
    args = dict(
        model=engines[0].model, input="More.", previous_response_id=first.id, max_output_tokens=5, temperature=0
    )
    direct = _openai(home.url).responses.create(**args)
    routed = via_router.responses.create(**args)
    assert routed.output_text == direct.output_text
    # Streamed through the router: the same text, events in order, ending as the direct answer did.
    with via_router.responses.stream(**args) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == f"response.{direct.status}"
    assert events[-1].response.output_text == direct.output_text


def test_anthropic_messages_through_the_router(router, engines):
    url, _ = router
    body = dict(
        model=engines[0].model,
        max_tokens=6,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Hi there"}],
    )
    direct = anthropic.Anthropic(base_url=engines[0].url, api_key=KEY, max_retries=0).messages.create(**body)
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)  # sends x-api-key
    routed = client.messages.create(**body)
    assert routed.content[0].text == direct.content[0].text and routed.usage == direct.usage
    with client.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == direct.content[0].text
    count = client.messages.count_tokens(model=body["model"], messages=body["messages"])
    assert count.input_tokens == direct.usage.input_tokens
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**body)


def test_embeddings_through_the_router(router, engines):
    url, _ = router
    inputs = ["the first text", "a second, longer text to embed"]
    direct = _openai(engines[1].url).embeddings.create(model=engines[0].model, input=inputs)
    for _ in range(2):  # round robin: both engines answer once
        routed = _openai(url).embeddings.create(model=engines[0].model, input=inputs)
        for a, b in zip(routed.data, direct.data, strict=True):
            assert a.embedding == pytest.approx(b.embedding, abs=1e-5)


def test_score_and_rerank_through_the_router(router, engines):
    url, _ = router
    body = {"query": "a capital city", "documents": ["Paris is a city", "a fox", "Berlin"]}
    direct = httpx.post(engines[1].url + "/v1/rerank", json=body, headers={"Authorization": f"Bearer {KEY}"}).json()
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        routed = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert routed.status_code == 200, routed.text
        got = routed.json()["results"]
        assert [x["index"] for x in got] == [x["index"] for x in direct["results"]]
        assert [x["relevance_score"] for x in got] == pytest.approx([x["relevance_score"] for x in direct["results"]])
    for path in ("/score", "/v1/score"):
        routed = httpx.post(
            url + path,
            json={"text_1": "a", "text_2": ["b", "c"]},
            headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": f"r{len(path)}"},
        )
        assert routed.status_code == 200 and len(routed.json()["data"]) == 2, routed.text
        # the client's X-Request-Id reaches the engine and comes back
        assert routed.json()["id"] == f"score-r{len(path)}" and routed.headers["x-request-id"] == f"r{len(path)}"


def test_prompt_texts_of_the_new_apis():
    """What the cache-aware policy matches on: the same words in the same order as a chat request
    with the same conversation."""
    chat = prompt_texts(
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    )
    messages = prompt_texts(
        "/v1/messages",
        {"system": "Be brief.", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
    )
    responses = prompt_texts("/v1/responses", {"instructions": "Be brief.", "input": "Hi"})
    assert chat == messages == responses
    assert prompt_texts("/v1/embeddings", {"input": ["a", "b"]}) == ["a", "b"]
