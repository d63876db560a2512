"""The Responses API (`POST /v1/responses`) through the real `openai` SDK, on a tiny random model:
text and message input, instructions, max_output_tokens, text.format json_schema, function tools (a
forced call), streaming (the SDK's stream helper; the raw events in OpenAI's order with their
sequence numbers), previous_response_id (the second prompt holds the first exchange), the store's
errors and limits, refused fields, and a client that goes away. Grammar-forced paths and seeds keep
the checks on the protocol, not on what the model happens to say."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from kvflow.config import EngineConfig, ServerConfig
from kvflow.entrypoints.openai.response_store import ResponseStore
from kvflow.entrypoints.openai.serving_responses import responses_param
from kvflow.entrypoints.openai.utils import APIError

from conftest import assert_no_leaks
from server_utils import LiveServer, post

pytestmark = pytest.mark.server

TIME = {
    "type": "function",
    "name": "get_time",
    "description": "The time in a zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
    "strict": True,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
}
FORCED = {"type": "function", "name": "get_time"}


class City(BaseModel):
    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=10**9)


@pytest.fixture(scope="module")
def server(model_factory):
    path, _ = model_factory("llama", max_position_embeddings=2048)
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=1024), ServerConfig(responses_store_size=64))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai(timeout=60)


def prompt_tokens(server, messages: list[dict]) -> int:
    """What /tokenize counts for a chat conversation: the prompt a response must have been given."""
    r = post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def raw_events(server, body: dict) -> list[dict]:
    """The SSE events of a streamed response, off the wire: `event:` names its data's type."""
    events, name = [], None
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(data)
    return events


def items(output) -> list[tuple]:
    """What a response said, without the ids the server made up."""
    out = []
    for item in output:
        item = item if isinstance(item, dict) else item.model_dump()
        if item["type"] == "message":
            out.append(("message", item["status"], "".join(p["text"] for p in item["content"])))
        else:
            out.append(("function_call", item["status"], item["name"], item["arguments"]))
    return out


def tokens(usage) -> tuple[int, int, int]:
    """Token counts of a usage (cached_tokens depends on what the prefix cache held at the time)."""
    usage = usage if isinstance(usage, dict) else usage.model_dump()
    return usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]


# ---- the shape of a response --------------------------------------------------------------------------
def test_text_with_instructions_and_max_output_tokens(server, client):
    r = client.responses.create(
        model=server.model, instructions="Be brief.", input="Hello there", max_output_tokens=6, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == server.model
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text
    expected = prompt_tokens(
        server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    )
    assert r.usage.input_tokens == expected and r.usage.output_tokens == 6
    assert r.usage.total_tokens == expected + 6 and r.instructions == "Be brief." and r.max_output_tokens == 6
    # message items as input: the same prompt as the string
    m = client.responses.create(
        model=server.model,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        max_output_tokens=6,
        temperature=0,
    )
    assert m.usage.input_tokens == expected and m.output_text == r.output_text


def test_text_format_json_schema(server, client):
    for seed in range(2):
        r = client.responses.parse(
            model=server.model,
            input="A city, please.",
            text_format=City,
            max_output_tokens=300,
            extra_body={"seed": seed},
        )
        assert r.status == "completed", r
        assert isinstance(r.output_parsed, City) and City.model_validate_json(r.output_text) == r.output_parsed
        assert r.text.format.type == "json_schema"


def test_forced_function_call_and_its_stream(server, client):
    kw = dict(model=server.model, input="What time is it in Tokyo?", tools=[TIME, WEATHER], max_output_tokens=300)
    for seed in range(2):
        r = client.responses.create(**kw, tool_choice=FORCED, extra_body={"seed": seed})
        assert r.status == "completed" and r.tool_choice.name == "get_time", r
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), TIME["parameters"])
        with client.responses.stream(**kw, tool_choice=FORCED, extra_body={"seed": seed}) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        assert items(final.output) == items(r.output) and tokens(final.usage) == tokens(r.usage)
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        # strict tools: the SDK parses the arguments of the final response
        assert json.loads(final.output[0].arguments) == final.output[0].parsed_arguments


def test_text_format_with_tools_is_calls_or_the_schema(server, client):
    schema = City.model_json_schema()
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    kinds = set()
    for seed in range(6):
        kw = dict(model=server.model, input="A city?", tools=[TIME], text={"format": fmt}, max_output_tokens=600)
        r = client.responses.create(**kw, extra_body={"seed": seed})
        with client.responses.stream(**kw, extra_body={"seed": seed}) as stream:
            for _ in stream:
                pass
            final = stream.get_final_response() if r.status == "completed" else None
        if r.status != "completed":  # a random model may write whitespace to the limit
            continue
        assert items(final.output) == items(r.output)
        if r.output[0].type == "function_call":
            kinds.add("call")
            jsonschema.validate(json.loads(r.output[0].arguments), TIME["parameters"])
        else:
            kinds.add("answer")
            City.model_validate_json(r.output_text)
    assert kinds == {"call", "answer"}


def test_streamed_events_in_openai_order(server, client):
    """created, in_progress, then per item: added, (part added, deltas, text done, part done) or
    (argument deltas, arguments done), done; then completed / incomplete. Sequence numbers count up
    from 0; the streamed response equals the non-streamed one."""
    for body in (
        {"input": "Hi", "max_output_tokens": 8, "temperature": 0},
        {"input": "Time?", "tools": [TIME], "tool_choice": "required", "max_output_tokens": 300, "seed": 0},
    ):
        body = {"model": server.model, **body}
        events = raw_events(server, body)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
        final = events[-1]["response"]
        i, index = 2, 0
        while i < len(events) - 1:
            added = events[i]
            assert added["type"] == "response.output_item.added" and added["output_index"] == index
            item_id = added["item"]["id"]
            if added["item"]["type"] == "message":
                assert kinds[i + 1] == "response.content_part.added"
                j = i + 2
                text = ""
                while kinds[j] == "response.output_text.delta":
                    text += events[j]["delta"]
                    j += 1
                assert kinds[j : j + 2] == ["response.output_text.done", "response.content_part.done"]
                assert events[j]["text"] == text == events[j + 1]["part"]["text"]
                j += 2
            else:
                j = i + 1
                arguments = ""
                while kinds[j] == "response.function_call_arguments.delta":
                    arguments += events[j]["delta"]
                    j += 1
                assert kinds[j] == "response.function_call_arguments.done" and events[j]["arguments"] == arguments
                j += 1
            assert kinds[j] == "response.output_item.done" and events[j]["item"]["id"] == item_id
            assert events[j]["item"] == final["output"][index]
            assert all(e.get("item_id", item_id) == item_id for e in events[i:j])
            i, index = j + 1, index + 1
        assert len(final["output"]) == index
        unstreamed = post(server, "/v1/responses", body).json()
        assert items(unstreamed["output"]) == items(final["output"])
        assert tokens(unstreamed["usage"]) == tokens(final["usage"])
        assert unstreamed["status"] == final["status"]


# ---- conversations -------------------------------------------------------------------------------------
def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(
        model=server.model, instructions="Be brief.", input="Hello", max_output_tokens=5, temperature=0
    )
    second = client.responses.create(
        model=server.model, previous_response_id=first.id, input="And then?", max_output_tokens=5, temperature=0
    )
    assert second.previous_response_id == first.id
    # the first exchange is in the prompt; the first request's instructions are not (OpenAI's rule)
    conversation = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.usage.input_tokens == prompt_tokens(server, conversation)
    third = client.responses.create(
        model=server.model, previous_response_id=second.id, input="More.", max_output_tokens=5, temperature=0
    )
    conversation += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "More."}]
    assert third.usage.input_tokens == prompt_tokens(server, conversation)
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_continuing_after_a_function_call(server, client):
    """A forced call, its result sent back as function_call_output: the prompt is the one the whole
    conversation sent as input gives, so the stored call went back in exactly."""
    kw = dict(model=server.model, tools=[TIME])
    first = client.responses.create(
        **kw, input="Time in Tokyo?", tool_choice=FORCED, max_output_tokens=300, extra_body={"seed": 1}
    )
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "10:42"}
    second = client.responses.create(**kw, previous_response_id=first.id, input=[result], max_output_tokens=4)
    whole = [
        {"role": "user", "content": "Time in Tokyo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result,
    ]
    explicit = client.responses.create(**kw, input=whole, max_output_tokens=4)
    assert second.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens


def test_store_errors_and_retrieval(server, client):
    def error(body: dict, status: int = 400) -> dict:
        r = post(server, "/v1/responses", {"model": server.model, "max_output_tokens": 2, **body})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err

    err = error({"input": "hi", "previous_response_id": "resp_nope"})
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
    unstored = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "store": False}).json()
    assert unstored["store"] is False
    err = error({"input": "hi", "previous_response_id": unstored["id"]})
    assert err["param"] == "previous_response_id" and "store: false" in err["message"]
    assert httpx.get(server.url + f"/v1/responses/{unstored['id']}").status_code == 404
    kept = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2}).json()
    assert httpx.get(server.url + f"/v1/responses/{kept['id']}").json() == kept
    deleted = httpx.delete(server.url + f"/v1/responses/{kept['id']}")
    assert deleted.json() == {"id": kept["id"], "object": "response", "deleted": True}
    assert httpx.get(server.url + f"/v1/responses/{kept['id']}").status_code == 404
    assert error({"input": "hi", "previous_response_id": kept["id"]})["code"] == "previous_response_not_found"
    wrong = httpx.post(server.url + f"/v1/responses/{kept['id']}", json={})
    assert wrong.status_code == 405 and wrong.headers["allow"] == "DELETE, GET", wrong.headers
    server.wait_engine_idle()


@pytest.mark.parametrize(
    "extra,param",
    [
        ({}, "input"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "tools": [TIME], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"input": "hi", "temperature": -1}, "temperature"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, None),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
        ({"input": "hi" * 3000}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, extra, param):
    r = post(server, "/v1/responses", {"max_output_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    ok = post(server, "/v1/responses", {"input": "fine", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["status"] == "incomplete", ok.text


def test_ignored_fields_are_accepted(server):
    r = post(
        server,
        "/v1/responses",
        {
            "input": "hi",
            "max_output_tokens": 2,
            "include": ["message.output_text.logprobs"],
            "reasoning": {"effort": "low"},
            "service_tier": "auto",
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "metadata": {"k": "v"},
            "truncation": "disabled",
            "some_future_field": 1,
        },
    )
    assert r.status_code == 200 and r.json()["metadata"] == {"k": "v"}, r.text
    assert post(server, "/v1/responses", {"model": "other", "input": "x"}).status_code == 404


def test_a_client_that_goes_away_aborts_the_response(server):
    body = {"input": "Go on", "max_output_tokens": 1000, "stream": True, "extra": "x"}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break
    server.wait_engine_idle()
    assert not server.exit_codes


def test_a_failed_response_fails_alone(server, client, monkeypatch):
    """A failure inside this request (an injected detokenizer error): the stream ends with
    response.failed naming it, the non-streamed request is a 500; a chat request beside them is
    served and nothing leaks."""
    from kvflow.engine.detokenizer import IncrementalDetokenizer
    from kvflow.engine.output_processor import OutputProcessor

    real_add, real_request = IncrementalDetokenizer.add, OutputProcessor.add_request

    def add(self, token_id):
        if getattr(self, "poisoned", False):
            raise RuntimeError("injected detokenizer failure")
        return real_add(self, token_id)

    def add_request(self, request_id, *args, **kwargs):
        real_request(self, request_id, *args, **kwargs)
        if request_id.startswith("resp_"):
            for c in self.parents[request_id].children:
                c.detokenizer.poisoned = True

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    monkeypatch.setattr(OutputProcessor, "add_request", add_request)
    events = raw_events(server, {"input": "hi", "max_output_tokens": 4})
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
    assert "injected detokenizer failure" in events[-1]["response"]["error"]["message"]
    r = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 4})
    assert r.status_code == 500 and "injected detokenizer failure" in r.json()["error"]["message"], r.text
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    monkeypatch.undo()
    server.wait_engine_idle()
    server.call(lambda e: assert_no_leaks(e))


# ---- pieces -------------------------------------------------------------------------------------------
def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, {"id": rid}, ())
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put("c", {"id": "c"}, ())
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    with pytest.raises(APIError, match="keeps the last 2"):
        store.previous("b")
    none = ResponseStore(0)
    none.put("x", {}, ())
    with pytest.raises(APIError, match="keeps no responses"):
        none.previous("x")


def test_chat_params_are_named_as_the_responses_fields():
    assert responses_param("messages.3.content") == "input"
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema") == "text.format"
    assert responses_param("tools.1.function.name") == "tools.1.name"
    assert responses_param("temperature") == "temperature" and responses_param(None) is None
