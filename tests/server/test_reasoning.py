"""Reasoning output (`--reasoning-parser qwen3`) through the HTTP server on a tiny random model whose
tokenizer knows <think> and </think> (one token each) and whose template writes think blocks. The
outputs are forced, so the checks are of the protocol, not of the model's choices:

- a structured_outputs regex that spells out the think block (kvflow then adds no reasoning prefix
  of its own) makes the model write `<think>abc</think>{json}`: reasoning_content and content split
  right, and the streamed deltas assemble to the same;
- response_format and a named tool choice compose with the reasoning: the grammar allows the think
  block first (logit_bias makes the tiny model open and close it at once), then the schema's JSON or
  the tool call, parsed from the content part only.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from kvflow.config import EngineConfig, ServerConfig

from server_utils import LiveServer

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "What time is it in Tokyo?"}]
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ (m['content'] or '').split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    # Qwen3's switch (chat_template_kwargs {"enable_thinking": false}): an empty think block
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}, "ok": {"type": "boolean"}},
    "required": ["zone", "ok"],
    "additionalProperties": False,
}
ZONE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    import shutil

    from transformers import AutoTokenizer

    path, _ = model_factory("llama", max_position_embeddings=2048)
    thinking = str(tmp_path_factory.mktemp("thinking-model"))
    shutil.copytree(path, thinking, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(thinking)
    tok.add_tokens(["<think>", "</think>"])  # plain text tokens (not special), as in Qwen3's vocabulary
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(thinking)
    s = LiveServer(EngineConfig(model=thinking, num_kv_blocks=1024), ServerConfig(reasoning_parser="qwen3"))
    s.think_ids = tok.convert_tokens_to_ids(["<think>", "</think>"])
    s.hf_tokenizer = tok
    yield s
    s.stop()


def post(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, body: dict) -> tuple[str, str, dict, str | None]:
    """(reasoning, content, {index: (name, arguments)}, finish_reason) assembled from the raw SSE chunks."""
    reasoning, content, calls, reason = [], [], {}, None
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"messages": MESSAGES, **body, "stream": True},
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
            assert "<think>" not in (delta.get("content") or "") and "</think>" not in (delta.get("content") or "")
            for entry in delta.get("tool_calls") or []:
                name, args = calls.get(entry["index"], ("", ""))
                fn = entry.get("function") or {}
                calls[entry["index"]] = (name + (fn.get("name") or ""), args + (fn.get("arguments") or ""))
            reason = choice["finish_reason"] or reason
    return "".join(reasoning), "".join(content), calls, reason


# The think tags as logit_bias: <think> first, then </think> at once (an empty think block).
def _close_at_once(server) -> dict:
    open_id, close_id = server.think_ids
    return {str(open_id): 50, str(close_id): 100}


def test_forced_think_block_splits_the_same_streamed_or_not(server):
    body = {
        "max_tokens": 60,
        "structured_outputs": {"regex": r'<think>abc</think>\{"zone": "JST"\}'},
    }
    message = post(server, body)["choices"][0]["message"]
    assert message["reasoning_content"] == "abc"
    assert message["content"] == '{"zone": "JST"}'
    reasoning, content, _, reason = stream(server, body)
    assert (reasoning, content, reason) == ("abc", '{"zone": "JST"}', "stop")


def test_no_think_block_is_all_content(server):
    body = {"max_tokens": 20, "structured_outputs": {"choice": ["plain answer"]}}
    message = post(server, body)["choices"][0]["message"]
    assert message["content"] == "plain answer" and message["reasoning_content"] is None
    assert stream(server, body)[:2] == ("", "plain answer")


def test_response_format_applies_after_the_reasoning(server):
    body = {
        "max_tokens": 400,
        "logit_bias": _close_at_once(server),
        "temperature": 0,
        "logprobs": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
    }
    choice = post(server, body)["choices"][0]
    text = "".join(t["token"] for t in choice["logprobs"]["content"])
    assert text.startswith("<think></think>"), text  # the grammar let the think block through first
    message = choice["message"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert message["reasoning_content"] is None  # an empty block
    reasoning, content, _, _ = stream(server, {k: v for k, v in body.items() if k != "logprobs"})
    assert (reasoning, content) == ("", message["content"])


def test_a_forced_tool_call_after_the_reasoning(server):
    body = {
        "max_tokens": 400,
        "logit_bias": _close_at_once(server),
        "temperature": 0,
        "tools": [ZONE_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    }
    choice = post(server, body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ZONE_TOOL["function"]["parameters"])
    assert message["content"] is None and message["reasoning_content"] is None
    reasoning, content, calls, reason = stream(server, body)
    assert calls == {0: ("get_time", call["function"]["arguments"])} and reason == "tool_calls"
    assert (reasoning, content) == ("", "")


def test_a_conversation_with_earlier_reasoning(server):
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "<think>hmm</think>It is noon."},
        {"role": "user", "content": "And in Paris?"},
    ]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 5, "structured_outputs": {"choice": ["11"]}},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "11"


def test_chat_template_kwargs_switch_thinking_off(server):
    # vLLM's chat_template_kwargs reach the template: the prompt is transformers' rendering of it
    hf = server.hf_tokenizer

    def hf_ids(**kwargs) -> list[int]:
        text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
        return hf(text, add_special_tokens=False).input_ids

    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert hf_ids(enable_thinking=False) != hf_ids()
    for body, expected in (({}, hf_ids()), (off, hf_ids(enable_thinking=False))):
        r = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, **body}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] == expected, r.text
        assert post(server, {"max_tokens": 2, **body})["usage"]["prompt_tokens"] == len(expected)
    for bad in ({"add_generation_prompt": False}, {"messages": []}):
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": bad},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template_kwargs" and f"cannot set {next(iter(bad))!r}" in err["message"], err
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hi", "chat_template_kwargs": {}}, timeout=60)
    assert r.status_code == 400 and "goes with messages" in r.text, r.text
