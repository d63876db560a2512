"""An Anthropic Messages request as the chat path's request, and as SamplingParams.

The chat path (`ServingChat`) already knows how to render a conversation with tools through the model's
chat template and how to constrain the output to the tool-call format; this module only translates:
`system` -> a system message, `tool_use` blocks -> assistant `tool_calls`, `tool_result` blocks -> tool
messages, `tools` -> function tools, `tool_choice` -> OpenAI's choice.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from kvflow.entrypoints.anthropic.protocol import (
    ConversationFields,
    MessageParam,
    MessagesRequest,
    TextBlockParam,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
from kvflow.entrypoints.openai.utils import APIError, validation_error
from kvflow.sampling_params import SamplingParams


def chat_request(req: ConversationFields) -> ChatCompletionRequest:
    req.refused_fields()
    messages: list[dict[str, Any]] = []
    system = req.system_text()
    if system is not None:
        messages.append({"role": "system", "content": system})
    for m in req.messages:
        for converted in _messages(m):
            _append_merged(messages, converted)
    choice, parallel = _tool_choice(req)
    body: dict[str, Any] = {"messages": messages, "tool_choice": choice, "parallel_tool_calls": parallel}
    if req.messages and req.messages[-1].role == "assistant":
        _check_prefill(req, len(req.messages) - 1, messages[-1], choice)
        # the template ends inside that message and the answer continues it, as Anthropic's prefill
        body.update(add_generation_prompt=False, continue_final_message=True)
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "parameters": t.input_schema,
                    **({"description": t.description} if t.description is not None else {}),
                },
            }
            for t in req.tools
        ]
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # a limit of the chat path, e.g. tool results made too many messages
        raise validation_error(e) from None


def _check_prefill(req: ConversationFields, i: int, last: dict[str, Any], choice: Any) -> None:
    """A final assistant message (prefill) is continued: it must be text, without the trailing
    whitespace Anthropic refuses, and not where the answer must be a tool call's format."""
    if last.get("tool_calls"):
        raise APIError(
            400,
            f"messages.{i}: a final assistant message with tool_use blocks cannot be continued",
            param=f"messages.{i}",
        )
    text = last.get("content") or ""
    if not text:
        raise APIError(
            400, f"messages.{i}: a final assistant message (prefill) needs text to continue", param=f"messages.{i}"
        )
    if text != text.rstrip():
        raise APIError(
            400, f"messages.{i}: final assistant content cannot end with trailing whitespace", param=f"messages.{i}"
        )
    if req.tools and choice != "none":
        raise APIError(
            400,
            f"messages.{i}: a final assistant message (prefill) cannot be combined with tools in use "
            "(the answer would have to be a call); drop it, or set tool_choice to none",
            param=f"messages.{i}",
        )


def _tool_choice(req: ConversationFields) -> tuple[str | dict[str, Any] | None, bool]:
    """(OpenAI's tool_choice, parallel_tool_calls). Anthropic's `any` is OpenAI's `required`; a named
    tool is one call of it (as vLLM does for a named choice)."""
    tc = req.tool_choice
    names = [t.name for t in req.tools or ()]
    if tc is None:
        return None, True
    if isinstance(tc, ToolChoiceNone):
        return "none", True
    if not names:
        raise APIError(400, f"tool_choice: {tc.type!r} needs tools", param="tool_choice")
    if isinstance(tc, ToolChoiceTool):
        if tc.name not in names:
            raise APIError(
                400,
                f"tool_choice.name: the tool {tc.name[:64]!r} is not among the tools ({', '.join(names)[:200]})",
                param="tool_choice.name",
            )
        return {"type": "function", "function": {"name": tc.name}}, False
    parallel = not tc.disable_parallel_tool_use
    return ("required" if isinstance(tc, ToolChoiceAny) else "auto"), parallel


def _messages(m: MessageParam) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become tool messages of their own."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        text = [b for b in m.content if isinstance(b, TextBlockParam)]
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
            }
            for b in m.content
            if isinstance(b, ToolUseBlockParam)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": _joined(text) if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return [message]
    out: list[dict[str, Any]] = []
    text: list[TextBlockParam] = []
    for b in m.content:  # in order: results and text interleave as the client wrote them
        if isinstance(b, ToolResultBlockParam):
            if text:
                out.append({"role": "user", "content": _joined(text)})
                text = []
            # The template shows a tool message's text only: an error has to say so in it.
            content = f"Error: {b.text()}" if b.is_error else b.text()
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif isinstance(b, TextBlockParam):
            text.append(b)
    if text or not out:
        out.append({"role": "user", "content": _joined(text)})
    return out


def _joined(blocks: list[TextBlockParam]) -> str:
    return "\n".join(b.text for b in blocks)


def _append_merged(messages: list[dict[str, Any]], m: dict[str, Any]) -> None:
    """Anthropic's API combines consecutive user (or assistant) turns into one; many chat templates
    refuse roles that do not alternate."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != m["role"] or m["role"] not in ("user", "assistant"):
        messages.append(m)
        return
    texts = [t for t in (last.get("content"), m.get("content")) if t]
    last["content"] = "\n".join(texts) if texts else (None if last.get("tool_calls") or m.get("tool_calls") else "")
    calls = (last.get("tool_calls") or []) + (m.get("tool_calls") or [])
    if calls:
        last["tool_calls"] = calls


def sampling_params(req: MessagesRequest) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=req.max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            stop=req.stop_sequences,
        )
    except ValueError as e:  # SamplingParams names its own fields; the client sent Anthropic's
        message = str(e)
        param = message.split(" ", 1)[0]
        if param == "stop":
            param, message = "stop_sequences", "stop_sequences" + message[len("stop") :]
        raise APIError(400, message, param=param, code="invalid_value") from None
