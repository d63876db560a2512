"""Structured outputs and tools through the HTTP server, driven by the real `openai` client, on a
tiny random model (its template knows nothing of tools, so the generic protocol is used): parse()
returns a typed object, required and named tool choices give calls whose arguments validate,
streamed calls concatenate to exactly the non-streamed ones, bad constraints are 400s naming the
problem and the server keeps serving."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from kvflow.config import EngineConfig

from server_utils import LiveServer

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "enum": ["UTC", "CET", "JST"]},
                "hours": {"type": "integer", "minimum": 0, "maximum": 23},
            },
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]
    tags: list[Literal["a", "b"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def server(model_factory):
    path, _ = model_factory("llama", max_position_embeddings=2048)  # room for the tools' system prompt
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=1024))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai(timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_parse_returns_a_typed_object(server, client):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=server.model, messages=MESSAGES, response_format=Person, seed=seed, max_tokens=300
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        person = choice.message.parsed
        assert isinstance(person, Person), choice.message.content
        assert Person.model_validate_json(choice.message.content) == person


def test_json_object_schema_regex_choice_over_http(server, client):
    r = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        seed=1,
        max_tokens=300,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": SCHEMAS["get_time"], "strict": True},
        },
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["get_time"])
    r = client.completions.create(
        model=server.model,
        prompt="Hello",
        max_tokens=50,
        seed=2,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
    )
    import re

    assert re.fullmatch("[a-z]{3}-[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=20,
        seed=3,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    )
    assert r.choices[0].message.content in ("sunny", "rainy")


def test_vllm_guided_fields_constrain_as_structured_outputs(server, client):
    # vLLM's fields before structured_outputs: a server that ignored them would answer unconstrained
    import re

    for seed in range(3):
        legacy = client.completions.create(
            model=server.model,
            prompt="Hello",
            max_tokens=50,
            seed=seed,
            extra_body={"guided_regex": "[a-z]{3}-[0-9]{2}"},
        )
        assert re.fullmatch("[a-z]{3}-[0-9]{2}", legacy.choices[0].text), legacy.choices[0].text
        current = client.completions.create(
            model=server.model,
            prompt="Hello",
            max_tokens=50,
            seed=seed,
            extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
        )
        assert legacy.choices[0].text == current.choices[0].text
    r = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=20, seed=3, extra_body={"guided_choice": ["sunny", "rainy"]}
    )
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=300,
        seed=1,
        extra_body={"guided_json": SCHEMAS["get_time"], "guided_decoding_backend": "xgrammar"},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["get_time"])
    r = client.completions.create(
        model=server.model,
        prompt="Answer: ",
        max_tokens=8,
        seed=4,
        extra_body={"guided_grammar": 'root ::= "yes" | "no"'},
    )
    assert r.choices[0].text in ("yes", "no")


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str, str | None]:
    calls: dict[int, list[str]] = {}
    content, reason, ids = "", None, {}
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or ():
                if tc.id is not None:
                    assert tc.index not in ids, "a call's id and name come once, first"
                    ids[tc.index] = tc.id
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.index in calls, "argument fragments after the call's name"
                    calls[tc.index][1] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return [tuple(calls[i]) for i in sorted(calls)], content, reason


@pytest.mark.parametrize(
    "tool_choice,parallel",
    [
        ("required", True),
        ("required", False),
        ({"type": "function", "function": {"name": "get_time"}}, True),
    ],
)
def test_tool_calls_required_and_named_streamed_and_not(server, client, tool_choice, parallel):
    for seed in (0, 1):
        kw = dict(
            model=server.model,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=tool_choice,
            seed=seed,
            max_tokens=300,
            parallel_tool_calls=parallel,
        )
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        calls = _calls(choice.message)
        assert choice.finish_reason == "tool_calls" and calls, choice
        if not parallel:
            assert len(calls) == 1
        for tc in choice.message.tool_calls:
            assert tc.type == "function" and tc.id.startswith("call_")
        for name, arguments in calls:
            if isinstance(tool_choice, dict):
                assert name == tool_choice["function"]["name"]
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        streamed, content, reason = _streamed_calls(client.chat.completions.create(**kw, stream=True))
        assert streamed == calls
        assert reason == "tool_calls"
        assert content == (choice.message.content or "")


def test_tool_choice_auto_and_none(server, client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=server.model, messages=MESSAGES, tools=TOOLS, seed=seed, max_tokens=300
        )
        m, reason = r.choices[0].message, r.choices[0].finish_reason
        # the generic protocol: a finished answer is either calls or a response, never anything else
        if reason == "tool_calls":
            for name, arguments in _calls(m):
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        else:
            assert reason == "length" or (reason == "stop" and not m.tool_calls and m.content is not None), r
    r = client.chat.completions.create(
        model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert not r.choices[0].message.tool_calls


def test_a_conversation_with_earlier_calls(server, client):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    r = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, max_tokens=20, seed=0)
    # The earlier call and its result are accepted as context; what the model answers is checked
    # for consistency: calls that validate, or text, or the token limit.
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls
        for name, arguments in _calls(choice.message):
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    elif choice.finish_reason == "length":
        assert r.usage.completion_tokens == 20
    else:
        assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content is not None


@pytest.mark.parametrize(
    "extra,fragment",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "the JSON schema is invalid",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "regex cannot be compiled"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "grammar cannot be compiled"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                "tool_choice": "required",
            },
            "the JSON schema is invalid",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"choice": ["a"]}},
            "cannot be combined with tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_choice": ["a"]},
            "guided_choice cannot be combined with tools",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice cannot be combined"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "response_format and guided_regex cannot be combined",
        ),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs and guided_regex cannot"),
        ({"guided_regex": "a(b"}, "regex cannot be compiled"),
        ({"guided_choice": []}, "guided_choice (structured_outputs.choice)"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
    ],
)
def test_bad_constraints_are_400_and_the_server_keeps_serving(server, extra, fragment):
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.text
    ok = post(
        server,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 20, "structured_outputs": {"choice": ["fine"]}},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine", ok.text
    server.wait_engine_idle()


def test_logit_bias_on_both_endpoints(server):
    forced = server.llm.tokenizer.decode([77] * 6)
    r = post(
        server,
        "/v1/completions",
        {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logit_bias": {"77": 100}},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == forced, r.text
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logit_bias": {"77": 100}},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == forced, r.text


def test_structured_output_metrics(server, client):
    client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=20, extra_body={"structured_outputs": {"choice": ["metric"]}}
    )
    m = server.metrics()
    assert m["kvflow:structured_output_compile_seconds_count"] >= 1
    assert m["kvflow:structured_output_requests_total"] >= 1
    assert m["kvflow:structured_output_cache_hits_total"] >= 1
    assert m["kvflow:structured_output_mask_seconds_count"] >= 1


# A Qwen2.5-style template that renders `tools` and writes calls as <tool_call>...</tool_call>:
# `--tool-call-parser auto` picks hermes from it, and the tools go into the template, not a system
# message of kvflow's.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_server(model_factory, tmp_path_factory):
    import shutil

    from transformers import AutoTokenizer

    path, _ = model_factory("llama", max_position_embeddings=2048)
    hermes = str(tmp_path_factory.mktemp("hermes-model"))
    shutil.copytree(path, hermes, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(hermes)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(hermes)
    s = LiveServer(EngineConfig(model=hermes, num_kv_blocks=1024))
    yield s
    s.stop()


def test_hermes_template_gets_the_tools_and_its_calls_parse(hermes_server):
    s = hermes_server
    client = s.openai(timeout=60)
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    for seed in (0, 1):
        kw = dict(
            model=s.model,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
            max_tokens=300,
            parallel_tool_calls=False,
        )  # one call: a random model may chain calls for long
        r = client.chat.completions.create(**kw)
        calls = _calls(r.choices[0].message)
        assert r.choices[0].finish_reason == "tool_calls" and calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        streamed, _, reason = _streamed_calls(client.chat.completions.create(**kw, stream=True))
        assert streamed == calls and reason == "tool_calls"
    # the template rendered the tools (hermes: tools=), and the output text was in hermes' format
    r = httpx.post(
        s.url + "/v1/chat/completions",
        timeout=60,
        json={
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "max_tokens": 300,
            "seed": 3,
            "logprobs": True,
        },
    )
    body = r.json()
    text = "".join(t["token"] for t in body["choices"][0]["logprobs"]["content"])
    assert text.startswith('<tool_call>\n{"name": "get_time", "arguments": '), text
    assert body["usage"]["prompt_tokens"] == len(
        s.llm.tokenizer(
            s.llm.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
    )
