"""Tool calls on /v1/chat/completions as clients assemble them, on a tiny random model (the generic
protocol; grammar-forced paths, so the checks are of the protocol, not of the model's choices):

- the raw SSE stream holds one `delta.tool_calls` entry per call index per chunk, the first one with
  the call's id, type, name and its first arguments;
- the `openai` SDK's `chat.completions.stream()` helper assembles exactly the non-streamed calls, with
  strict tools too (the SDK then parses the arguments);
- a named tool_choice is one call, as is `required` without parallel calls;
- a call cut by max_tokens is reported one way, streamed or not: in tool_calls with the arguments
  written so far (a prefix of what a larger budget writes), never as content;
- response_format together with tools: calls, or content that is the schema's JSON.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvflow.config import EngineConfig

from server_utils import LiveServer

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "What time is it in Tokyo?"}]
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}, "hours": {"type": "integer", "minimum": 0}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [TIME, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_time"}}


class City(BaseModel):
    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=10**9)


class GetTime(BaseModel):
    zone: str = Field(pattern="^(UTC|CET|JST)$")


@pytest.fixture(scope="module")
def server(model_factory):
    path, _ = model_factory("llama", max_position_embeddings=2048)  # room for the tools' system prompt
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=1024))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai(timeout=60)


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def raw_stream(server, body: dict) -> tuple[list[dict], list[tuple[str, str]], str, str | None]:
    """The chunks of a streamed chat completion, read off the wire, checked for the tool_calls rules,
    and what they assemble to: (chunks, calls, content, finish_reason)."""
    chunks, calls, ids, content, reason = [], {}, {}, "", None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            for choice in chunk["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                entries = delta.get("tool_calls") or []
                indexes = [e["index"] for e in entries]
                assert len(indexes) == len(set(indexes)), f"two entries for one call in a chunk: {entries}"
                for e in entries:
                    if e["index"] not in calls:  # a call's first entry: everything that names it
                        assert e["id"].startswith("call_") and e["type"] == "function", e
                        assert isinstance(e["function"]["name"], str) and e["function"]["name"], e
                        assert isinstance(e["function"]["arguments"], str), e
                        ids[e["index"]] = e["id"]
                        calls[e["index"]] = [e["function"]["name"], e["function"]["arguments"]]
                    else:  # then only argument fragments
                        assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}, e
                        calls[e["index"]][1] += e["function"]["arguments"]
                reason = choice.get("finish_reason") or reason
    assert sorted(calls) == list(range(len(calls)))
    return chunks, [tuple(calls[i]) for i in sorted(calls)], content, reason


def body(**kw) -> dict:
    return {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, **kw}


@pytest.mark.parametrize(
    "tool_choice,parallel",
    [(NAMED, True), (NAMED, False), ("required", False), ("required", True)],
    ids=["named", "named-serial", "required-serial", "required-parallel"],
)
def test_raw_stream_one_entry_per_index_and_equal_to_unstreamed(server, client, tool_choice, parallel):
    for seed in (0, 1, 2):
        b = body(tool_choice=tool_choice, parallel_tool_calls=parallel, seed=seed)
        r = client.chat.completions.create(model=server.model, **b)
        choice = r.choices[0]
        calls = calls_of(choice.message)
        _, streamed, content, reason = raw_stream(server, b)
        assert streamed == calls and reason == choice.finish_reason and content == (choice.message.content or "")
        if tool_choice == NAMED or not parallel:  # one call, whatever parallel_tool_calls says for a name
            assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice
            assert tool_choice != NAMED or calls[0][0] == "get_time"
        else:  # the model may end after any call; this random one may also chain calls to the limit
            assert calls and choice.finish_reason in ("tool_calls", "length"), choice
        for name, arguments in calls[:-1] if choice.finish_reason == "length" else calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_sdk_stream_helper_assembles_the_unstreamed_calls(server, client):
    # the helper merges entries by index; strict tools make it parse the arguments into the model
    tools = [openai.pydantic_function_tool(GetTime, name="get_time"), WEATHER]
    for seed in (0, 1):
        kw = dict(model=server.model, messages=MESSAGES, tools=tools, max_tokens=300, seed=seed)
        for tool_choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
            r = client.chat.completions.create(**kw, tool_choice=tool_choice, parallel_tool_calls=False)
            with client.chat.completions.stream(**kw, tool_choice=tool_choice, parallel_tool_calls=False) as stream:
                for _ in stream:
                    pass
                final = stream.get_final_completion()
            message = final.choices[0].message
            assert calls_of(message) == calls_of(r.choices[0].message) and len(message.tool_calls) == 1
            assert final.choices[0].finish_reason == "tool_calls"
            call = message.tool_calls[0]
            if call.function.name == "get_time":
                assert isinstance(call.function.parsed_arguments, GetTime)
                assert call.function.parsed_arguments == GetTime.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_a_cut_call_is_reported_one_way(server, client, tool_choice):
    """OpenAI's rule: a call cut by the token limit is in tool_calls with the arguments as far as they
    were written (finish_reason "length"); its raw text is never content. Cut earlier than its name,
    there is no call to report. With a seed the tokens are the same whatever the budget, so a cut
    call's arguments are a prefix of the whole call's."""
    b = body(tool_choice=tool_choice, parallel_tool_calls=False, seed=4)
    whole = client.chat.completions.create(model=server.model, **b)
    assert whole.choices[0].finish_reason == "tool_calls", whole
    ((name, arguments),) = calls_of(whole.choices[0].message)
    n = whole.usage.completion_tokens
    seen = set()
    # every budget through the call's opening (the generic protocol's envelope and the name), then a
    # few inside the arguments
    for max_tokens in sorted({*range(1, min(n, 24)), n // 2, n - 1} - {0}):
        cut = {**b, "max_tokens": max_tokens}
        r = client.chat.completions.create(model=server.model, **cut)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, (max_tokens, choice)
        got = calls_of(choice.message)
        assert got in ([], [(name, got[0][1] if got else "")]), (max_tokens, got)
        if got:
            assert arguments.startswith(got[0][1]), (max_tokens, got, arguments)
        seen.add(bool(got))
        _, streamed, content, reason = raw_stream(server, cut)
        assert (streamed, content, reason) == (got, "", "length"), max_tokens
    assert seen == {False, True}  # cut before the name, and after it


def test_response_format_with_tools(server, client):
    schema = City.model_json_schema()
    kinds = set()
    for seed in range(8):
        b = body(
            seed=seed,
            max_tokens=600,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        )
        r = client.chat.completions.create(model=server.model, **b)
        choice = r.choices[0]
        _, streamed, content, reason = raw_stream(server, b)
        assert (streamed, content, reason) == (
            calls_of(choice.message),
            choice.message.content or "",
            choice.finish_reason,
        )
        if choice.finish_reason == "tool_calls":
            kinds.add("call")
            for name, arguments in calls_of(choice.message):
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        elif choice.finish_reason == "stop":
            assert not choice.message.tool_calls, choice
            City.model_validate_json(choice.message.content)  # the answer, not the protocol's envelope
            kinds.add("answer")
        else:  # a random model may write whitespace up to the limit
            assert choice.finish_reason == "length", choice
    assert kinds == {"call", "answer"}  # the grammar lets the model do either
    # the SDK's parse() sends both (as openai-agents and pydantic-ai do) and reads the answer
    for seed in range(4):
        try:
            parsed = client.chat.completions.parse(
                model=server.model,
                messages=MESSAGES,
                tools=[openai.pydantic_function_tool(GetTime, name="get_time")],
                response_format=City,
                max_tokens=600,
                seed=seed,
            )
        except openai.LengthFinishReasonError:
            continue
        message = parsed.choices[0].message
        assert (message.parsed is not None) != bool(message.tool_calls), message
        for call in message.tool_calls or ():
            assert isinstance(call.function.parsed_arguments, GetTime)
    # a choice that demands a call: a call, the schema has no answer to shape
    r = client.chat.completions.create(
        model=server.model,
        **body(tool_choice="required", seed=0, response_format={"type": "json_object"}),
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


def test_structured_outputs_with_tools_is_a_400(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json=body(max_tokens=5, structured_outputs={"choice": ["a"]}),
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    server.wait_engine_idle()


def test_sse_events_stay_on_one_line():
    """JSON leaves U+0085, U+2028 and U+2029 raw, but str.splitlines() (and SSE readers built on it)
    breaks lines there: every SSE writer escapes them, so an event's data is one line."""
    from kvflow.entrypoints.openai.utils import sse

    text = "a\x85b\u2028c\u2029d é"
    event = sse({"content": text})
    assert event.splitlines() == [event[:-2], ""] and json.loads(event[len("data: ") : -2]) == {"content": text}
