"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the real `anthropic`
SDK and by raw HTTP, on a tiny random model whose chat template renders tools (Qwen2.5 / hermes style).

What is checked is the protocol, not the tiny model's choices: tool calls are forced by the grammar
(tool_choice any / tool), stop reasons are provoked (max_tokens, a stop sequence taken from the
greedy output itself), the prompt is compared with the template rendered by hand."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time

import anthropic
import httpx
import jsonschema
import pytest

from kvflow.config import EngineConfig, ServerConfig

from conftest import assert_no_leaks
from server_utils import LiveServer, wait_for

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

KEY = "sekret"
GREEDY = {"temperature": 0.0}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {
            "zone": {"enum": ["UTC", "CET", "JST"]},
            "hours": {"type": "integer", "minimum": 0, "maximum": 23},
        },
        "required": ["zone"],
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# A call whose input cannot end before max_tokens (the grammar holds the string open): an answer that
# is sure to last, whatever the model would rather do.
LONG = {
    "model": None,
    "max_tokens": 400,
    "messages": MESSAGES,
    "tools": [
        {
            "name": "write",
            "input_schema": {
                "type": "object",
                "properties": {"text": {"type": "string", "minLength": 2000}},
                "required": ["text"],
            },
        }
    ],
    "tool_choice": {"type": "tool", "name": "write"},
}

# A Qwen2.5-style template that renders `tools` and earlier calls as <tool_call>...</tool_call> (the
# server picks the hermes format from it), tool results as `tool` turns.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    import shutil

    from transformers import AutoTokenizer

    path, _ = model_factory("llama", max_position_embeddings=2048)
    hermes = str(tmp_path_factory.mktemp("anthropic-model"))
    shutil.copytree(path, hermes, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(hermes)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(hermes)
    s_tok = tok
    s = LiveServer(
        EngineConfig(model=hermes, num_kv_blocks=1024),
        ServerConfig(api_key=KEY, max_request_body_bytes=200_000, log_interval_s=60),
    )
    s.hf_tokenizer = s_tok
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": KEY, **(headers or {})}, timeout=60)


def without_ids(message) -> dict:
    """A message as a dict, without what is unique to each response (its id, its tool_use ids)."""
    d = message.model_dump()
    d.pop("id")
    for block in d["content"]:
        block.pop("id", None)
    return d


def assert_error(r: httpx.Response, status: int, error_type: str, *fragments: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type, body
    for f in fragments:
        assert f in body["error"]["message"], body
    return body["error"]["message"]


def iter_sse(r: httpx.Response):
    """(event name, data) of each SSE event as it arrives, checking that each data's type is its name."""
    name = None
    for line in r.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == name, (name, data)
            yield name, data


def sse_events(r: httpx.Response) -> list[tuple[str, dict]]:
    return list(iter_sse(r))


# ---- text --------------------------------------------------------------------------------------------
def test_create_and_stream_give_the_same_message(server, client):
    kw = dict(model=server.model, max_tokens=24, system="Answer briefly.", messages=MESSAGES, extra_body=GREEDY)
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == server.model
    assert m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 24 and m.usage.input_tokens > 0
    assert [b.type for b in m.content] in (["text"], [])
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert without_ids(final) == without_ids(m)
    assert text == (m.content[0].text if m.content else "")


def test_max_tokens_and_stop_sequences(server, client):
    kw = dict(model=server.model, messages=MESSAGES, extra_body=GREEDY)
    m = client.messages.create(max_tokens=5, **kw)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5, m
    full = client.messages.create(max_tokens=40, **kw).content[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]  # something the greedy output is sure to hold
    assert stop.strip(), full
    m = client.messages.create(max_tokens=40, stop_sequences=["\x00never", stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, m
    assert m.content[0].text == full[: full.index(stop)]
    with client.messages.stream(max_tokens=40, stop_sequences=[stop], **kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert without_ids(final) == without_ids(m)


# ---- tools -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}],
)
def test_forced_tool_call_streamed_and_not(server, client, tool_choice):
    kw = dict(
        model=server.model, max_tokens=300, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, extra_body=GREEDY
    )
    m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use", m
    assert [b.type for b in m.content] == ["tool_use"], m.content  # one call, no text: the grammar's
    call = m.content[0]
    assert call.id.startswith("toolu_")
    if tool_choice["type"] == "tool":
        assert call.name == "get_weather"
    jsonschema.validate(call.input, SCHEMAS[call.name])
    with client.messages.stream(**kw) as stream:
        fragments = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    assert without_ids(final) == without_ids(m)
    assert len(fragments) > 1 and json.loads("".join(fragments)) == call.input  # streamed as input_json_delta


def test_auto_tool_choice_streamed_equals_non_streamed(server, client):
    # Whatever the model writes (text, calls or both), the stream assembles into the same message.
    for system in ("Be brief.", "Use the tools."):
        kw = dict(model=server.model, max_tokens=60, system=system, messages=MESSAGES, tools=TOOLS, extra_body=GREEDY)
        m = client.messages.create(**kw)
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert without_ids(final) == without_ids(m)
        assert (m.stop_reason == "tool_use") == any(b.type == "tool_use" for b in m.content) or (
            m.stop_reason == "max_tokens"
        )


def _conversation(call) -> list[dict]:
    return [
        *MESSAGES,
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 degrees"}]},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]


def test_conversation_continues_after_a_tool_result(server, client):
    forced = dict(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    call = client.messages.create(model=server.model, max_tokens=300, messages=MESSAGES, **forced).content[0]
    messages = _conversation(call)
    m = client.messages.create(model=server.model, max_tokens=300, messages=messages, **forced)
    assert m.stop_reason == "tool_use" and m.content[0].name == "get_weather"
    jsonschema.validate(m.content[0].input, SCHEMAS["get_weather"])
    # The prompt is the template's rendering of the same conversation in chat form, by hand here.
    tok = server.llm.tokenizer
    chat = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.input}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    functions = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS]
    text = tok.apply_chat_template(chat, tools=functions, tokenize=False, add_generation_prompt=True)
    assert "<tool_call>\n" in text and "18 degrees" in text
    assert m.usage.input_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


def test_a_final_assistant_message_is_continued(server, client):
    # Anthropic's prefill: the answer continues the last assistant message. The reference is
    # transformers' rendering with continue_final_message, completed greedily on /v1/completions.
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    text = server.hf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("My favourite is")
    ref = post(server, "/v1/completions", {"prompt": text, "max_tokens": 16, "add_special_tokens": False, **GREEDY})
    assert ref.status_code == 200, ref.text
    ref = ref.json()
    kw = dict(model=server.model, max_tokens=16, messages=messages, extra_body=GREEDY)
    m = client.messages.create(**kw)
    assert "".join(b.text for b in m.content) == ref["choices"][0]["text"]
    assert m.usage.input_tokens == ref["usage"]["prompt_tokens"]
    with client.messages.stream(**kw) as stream:
        assert [b.text for b in stream.get_final_message().content] == [b.text for b in m.content]
    assert client.messages.count_tokens(model=server.model, messages=messages).input_tokens == m.usage.input_tokens
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}
    for last, extra, fragment in (
        ({"role": "assistant", "content": "My favourite is "}, {}, "cannot end with trailing whitespace"),
        ({"role": "assistant", "content": [call]}, {"tools": TOOLS}, "with tool_use blocks cannot be continued"),
        ({"role": "assistant", "content": "It is"}, {"tools": TOOLS}, "cannot be combined with tools in use"),
    ):
        body = {"model": server.model, "max_tokens": 4, "messages": [messages[0], last], **extra}
        assert_error(post(server, "/v1/messages", body), 400, "invalid_request_error", "messages.1", fragment)
    body = {
        "model": server.model,
        "max_tokens": 4,
        "messages": [messages[0], {"role": "assistant", "content": "It is"}],
    }
    ok = post(server, "/v1/messages", {**body, "tools": TOOLS, "tool_choice": {"type": "none"}})
    assert ok.status_code == 200, ok.text


def test_count_tokens_equals_the_usage_of_the_same_request(server, client):
    cases = [
        dict(system="Answer briefly.", messages=MESSAGES),
        dict(
            system=[{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}],
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_time"},
        ),
        dict(messages=MESSAGES, tools=TOOLS, tool_choice={"type": "none"}),
    ]
    for kw in cases:
        counted = client.messages.count_tokens(model=server.model, **kw).input_tokens
        m = client.messages.create(model=server.model, max_tokens=2, extra_body=GREEDY, **kw)
        assert counted == m.usage.input_tokens, kw
    with_tools = client.messages.count_tokens(model=server.model, messages=MESSAGES, tools=TOOLS).input_tokens
    no_tools = client.messages.count_tokens(
        model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "none"}
    ).input_tokens
    assert with_tools > no_tools  # tool_choice none renders no tools


# ---- raw SSE -----------------------------------------------------------------------------------------
_ORDER = re.compile(
    r"message_start (content_block_start ping (content_block_delta )+content_block_stop )"
    r"(content_block_start (content_block_delta )*content_block_stop )*message_delta message_stop "
)


@pytest.mark.parametrize("tools", [False, True])
def test_raw_event_order_is_anthropics(server, tools):
    body = {"model": server.model, "max_tokens": 300, "messages": MESSAGES, "stream": True, **GREEDY}
    if tools:
        body |= {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}}
    with httpx.stream(
        "POST",
        server.url + "/v1/messages",
        json=body,
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    names = "".join(name + " " for name, _ in events)
    assert _ORDER.fullmatch(names), names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    first = events[1][1]
    assert first["index"] == 0
    deltas = [d["delta"] for name, d in events if name == "content_block_delta"]
    stop = events[-2][1]
    if tools:
        assert first["content_block"] == {
            "type": "tool_use",
            "id": first["content_block"]["id"],
            "name": "get_time",
            "input": {},
        }
        assert {d["type"] for d in deltas} == {"input_json_delta"}
        arguments = json.loads("".join(d["partial_json"] for d in deltas))
        jsonschema.validate(arguments, SCHEMAS["get_time"])
        assert stop["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    else:
        assert first["content_block"] == {"type": "text", "text": ""}
        assert {d["type"] for d in deltas} == {"text_delta"}
        assert stop["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert stop["usage"]["output_tokens"] >= 1


# ---- auth and errors ---------------------------------------------------------------------------------
def test_api_key_headers(server):
    body = {"model": server.model, "max_tokens": 2, "messages": MESSAGES}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert_error(r, 401, "authentication_error", "missing API key")
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=60)
    assert_error(r, 401, "authentication_error", "invalid API key")
    assert post(server, "/v1/messages", body).status_code == 200  # x-api-key
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert post(server, "/v1/messages/count_tokens", {"model": server.model, "messages": MESSAGES}).status_code == 200
    r = post(server, "/v1/messages", {k: v for k, v in body.items() if k != "model"})  # model: the served one
    assert r.status_code == 200 and r.json()["model"] == server.model, r.text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(**body)


def test_the_gate_and_routing_errors_have_anthropics_shape(server):
    big = {"model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 300_000}]}
    assert_error(post(server, "/v1/messages", big), 413, "request_too_large", "200000")
    r = httpx.get(server.url + "/v1/messages", headers={"x-api-key": KEY})
    assert_error(r, 405, "invalid_request_error")
    r = httpx.post(server.url + "/v1/messages", content=b"{nope", headers={"x-api-key": KEY})
    assert_error(r, 400, "invalid_request_error", "not valid JSON")
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", json={}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    "change,status,error_type,fragment",
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens is required"),
        ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": [{"role": "system", "content": "hi"}]}, 400, "invalid_request_error", "messages.0.role"),
        ({"messages": []}, 400, "invalid_request_error", "messages"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_stock"}},
            400,
            "invalid_request_error",
            "'get_stock' is not among the tools",
        ),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "needs tools"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "messages.0.content.0.type",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "tools.0"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking"),
        ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences"),
        ({"model": "claude-nonesuch"}, 404, "not_found_error", "claude-nonesuch"),
    ],
)
def test_error_shapes(server, change, status, error_type, fragment):
    body = {"model": server.model, "max_tokens": 5, "messages": MESSAGES, "metadata": {"user_id": "u1"}} | change
    body = {k: v for k, v in body.items() if v is not None}
    assert_error(post(server, "/v1/messages", body), status, error_type, fragment)


def test_errors_through_the_sdk_and_ignored_fields(server, client):
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(
            model=server.model, max_tokens=5, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "tool", "name": "x"}
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nonesuch", messages=MESSAGES)
    # metadata, service_tier, cache_control, thinking blocks of earlier turns: accepted, no effect
    m = client.messages.create(
        model=server.model,
        max_tokens=3,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "yo"}],
            },
            {"role": "user", "content": "again"},
        ],
        metadata={"user_id": "someone"},
        service_tier="auto",
        extra_body={"an_unknown_field": 1},
        extra_headers={"anthropic-beta": "whatever-2025-01-01"},
    )
    assert m.usage.output_tokens >= 1


def test_overloaded_is_529(server, client, monkeypatch):
    from kvflow.engine.async_llm import EngineOverloadedError

    async def overloaded(*args, **kwargs):
        raise EngineOverloadedError("too many requests are waiting (max_waiting_requests)", retry_after_s=2.5)

    monkeypatch.setattr(server.llm, "add_request", overloaded)
    r = post(server, "/v1/messages", {"model": server.model, "max_tokens": 5, "messages": MESSAGES})
    assert_error(r, 529, "overloaded_error", "max_waiting_requests")
    assert r.headers["Retry-After"] == "3"
    with pytest.raises(anthropic.OverloadedError):
        client.messages.create(model=server.model, max_tokens=5, messages=MESSAGES)
    monkeypatch.undo()
    assert client.messages.create(model=server.model, max_tokens=2, messages=MESSAGES).usage.output_tokens >= 1


# ---- failures stay their own; disconnects abort -----------------------------------------------------
def test_a_failing_request_fails_alone(server, monkeypatch):
    from kvflow.engine.detokenizer import IncrementalDetokenizer
    from kvflow.engine.output_processor import OutputProcessor

    real_add, real_request = IncrementalDetokenizer.add, OutputProcessor.add_request

    def add(self, token_id):
        if getattr(self, "poisoned", False):
            raise RuntimeError("injected detokenizer failure")
        return real_add(self, token_id)

    def add_request(self, request_id, prompt, prompt_token_ids, child_params, *args, **kwargs):
        real_request(self, request_id, prompt, prompt_token_ids, child_params, *args, **kwargs)
        if "POISON" in child_params[0].stop:  # marked by a stop sequence
            for c in self.parents[request_id].children:
                c.detokenizer.poisoned = True

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    monkeypatch.setattr(OutputProcessor, "add_request", add_request)
    body = {"model": server.model, "max_tokens": 8, "messages": MESSAGES, **GREEDY}
    poisoned = {**body, "stop_sequences": ["POISON"]}

    def stream(b: dict) -> list[tuple[str, dict]]:
        with httpx.stream(
            "POST", server.url + "/v1/messages", json={**b, "stream": True}, headers={"x-api-key": KEY}, timeout=60
        ) as r:
            return sse_events(r)

    async def run():
        return await asyncio.gather(
            asyncio.to_thread(stream, poisoned),
            asyncio.to_thread(post, server, "/v1/messages", poisoned),
            asyncio.to_thread(post, server, "/v1/messages", body),
        )

    events, plain, ok = asyncio.run(run())
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
    assert "injected detokenizer failure" in events[-1][1]["error"]["message"]
    assert_error(plain, 500, "api_error", "injected detokenizer failure")
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] >= 1
    monkeypatch.undo()
    server.wait_engine_idle()
    server.call(assert_no_leaks)


def _slowed(server):
    """Steps of >= 5 ms (the engine is not changed): a 400-token answer lasts >= 2 s."""
    runner = server.engine.runner
    real_execute = runner.execute

    def slow_execute(sched, *rest):
        time.sleep(0.005)
        return real_execute(sched, *rest)

    runner.execute = slow_execute
    return lambda: setattr(runner, "execute", real_execute)


def test_client_disconnect_aborts(server):
    before = server.metrics()['kvflow:request_success_total{finished_reason="abort"}']
    body = {**LONG, "model": server.model, "stream": True}

    async def stream_and_close(c: httpx.AsyncClient):
        async with c.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n >= 4:
                    break  # leaving the block closes the connection mid-stream

    async def non_stream_timeout(c: httpx.AsyncClient):
        with pytest.raises(httpx.ReadTimeout):
            await c.post(
                server.url + "/v1/messages",
                json={**body, "stream": False},
                headers={"x-api-key": KEY},
                timeout=httpx.Timeout(0.5, connect=10),  # (the read gives up, not a slow connect)
            )

    async def run():
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            await asyncio.gather(stream_and_close(c), stream_and_close(c), non_stream_timeout(c))

    restore = _slowed(server)
    try:
        asyncio.run(run())
    finally:
        restore()
    server.wait_engine_idle(timeout=10)
    server.call(assert_no_leaks)
    wait_for(
        lambda: server.metrics()['kvflow:request_success_total{finished_reason="abort"}'] - before >= 3,
        5,
        "aborts not counted",
    )


def test_server_side_abort_is_overloaded(server):
    # What the server's drain does once its grace period is over: abort what is still running.
    async def abort_all():
        server.llm.abort_all()

    body = {**LONG, "model": server.model}
    restore = _slowed(server)
    try:
        events = []
        with httpx.stream(
            "POST", server.url + "/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY}, timeout=60
        ) as r:
            for event in iter_sse(r):
                events.append(event)
                if event[0] == "content_block_delta" and len(events) == 4:
                    server.run(abort_all())
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error", events[-3:]
        assert "message_stop" not in [name for name, _ in events]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, server, "/v1/messages", body)
            wait_for(lambda: server.llm.num_in_flight > 0, 10, "the request did not start")
            server.run(abort_all())
            assert_error(pending.result(), 529, "overloaded_error", "aborted")
    finally:
        restore()
    server.wait_engine_idle()
