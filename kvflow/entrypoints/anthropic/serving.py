"""POST /v1/messages and /v1/messages/count_tokens, through the chat path's prompt, tools and engine.

A request is translated (convert.py) into the chat path's request: the prompt is exactly the one
/v1/chat/completions would build for the same conversation, tool choices that demand a call are
enforced by the same grammar, and admission control, disconnects and per-request failures behave as
there. The output becomes content blocks (blocks.py); errors take Anthropic's shape (errors.py).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.engine.async_llm import RequestFailedError, RequestHandle
from kvflow.entrypoints.anthropic.blocks import ContentBlocks, event_source, events_of
from kvflow.entrypoints.anthropic.convert import chat_request, sampling_params
from kvflow.entrypoints.anthropic.errors import OVERLOADED, sse_error
from kvflow.entrypoints.anthropic.protocol import ConversationFields, CountTokensRequest, MessagesRequest
from kvflow.entrypoints.openai.serving import client_of
from kvflow.entrypoints.openai.serving_chat import ServingChat
from kvflow.entrypoints.openai.tool_parsers import ToolCallFormat
from kvflow.entrypoints.openai.utils import (
    APIError,
    OwnedStreamingResponse,
    finish_unstreamed,
    last_output,
    merge_handles,
    parse_body,
    sse_json,
)
from kvflow.outputs import CompletionOutput
from kvflow.sampling_params import SamplingParams

_ABORTED = "the request was aborted: the server is shutting down"


class ServingMessages:
    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat  # the chat path: model name, chat template, tool-call format, engine

    # ---- the prompt -------------------------------------------------------------------------------
    def _prompt(self, req: ConversationFields, params: SamplingParams) -> tuple[ToolCallFormat | None, list[int]]:
        """The tool-call format when tools are in use (`params` then carry its grammar: a call when
        the choice demands one, as on /v1/chat/completions), and the prompt's token ids."""
        chat_req = chat_request(req)
        fmt = self.chat.tool_format_for(chat_req, params)
        return fmt, self.chat.chat_prompt_ids(chat_req, fmt)

    async def count_tokens(self, raw: Request) -> Response:
        req = await parse_body(raw, CountTokensRequest)
        self.chat.model_name(req.model)
        _, prompt_ids = self._prompt(req, SamplingParams(max_tokens=1))  # the grammar is not used here
        return JSONResponse({"input_tokens": len(prompt_ids)})

    # ---- generation -------------------------------------------------------------------------------
    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, MessagesRequest)
        model = self.chat.model_name(req.model)
        params = self.chat.with_model_defaults(sampling_params(req), req)
        fmt, prompt_ids = self._prompt(req, params)
        message_id = f"msg_{uuid.uuid4().hex}"
        user = req.metadata.user_id if req.metadata is not None else None
        handles = await self.chat.add_requests(
            message_id, [prompt_ids], params, "messages", arrival, _client(raw, user)
        )
        if req.stream:
            return OwnedStreamingResponse(self._stream(message_id, model, len(prompt_ids), handles, fmt), handles)
        out = await finish_unstreamed(raw, handles, last_output(handles[0]))
        if out is None:
            return Response(status_code=499)  # the client closed the connection
        c = out.outputs[0]
        if c.finish_reason == "abort":
            raise APIError(503, _ABORTED, code="shutting_down")  # Anthropic's 529 (errors.py)
        blocks = ContentBlocks()
        for event in events_of(fmt, c.text):
            blocks.add(event)
        reason, sequence = _stop_reason(c, blocks.has_tool_use)
        message = _message(message_id, model, blocks.content(), reason, sequence)
        return JSONResponse({**message, "usage": _usage(len(out.prompt_token_ids), len(c.token_ids))})

    async def _stream(
        self, message_id: str, model: str, n_prompt: int, handles: list[RequestHandle], fmt: ToolCallFormat | None
    ) -> AsyncIterator[str]:
        start = {**_message(message_id, model, [], None, None), "usage": _usage(n_prompt, 0)}
        yield _sse({"type": "message_start", "message": start})
        source, blocks = event_source(fmt), ContentBlocks()
        pinged = False
        last: CompletionOutput | None = None
        try:
            async for _, out in merge_handles(handles):
                last = out.outputs[0]
                for event in source.feed(last.text, last.finished):
                    for data in blocks.add(event):
                        yield _sse(data)
                        if not pinged and data["type"] == "content_block_start":
                            yield _sse({"type": "ping"})  # where Anthropic sends it: after the first block opens
                            pinged = True
        except RequestFailedError as e:
            yield sse_error(500, str(e))
            return
        assert last is not None and last.finished
        if last.finish_reason == "abort":
            yield sse_error(OVERLOADED, _ABORTED)
            return
        for data in blocks.close():
            yield _sse(data)
        if not pinged:
            yield _sse({"type": "ping"})
        reason, sequence = _stop_reason(last, blocks.has_tool_use)
        yield _sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": len(last.token_ids)},
            }
        )
        yield _sse({"type": "message_stop"})


def _sse(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {sse_json(data)}\n\n"


def _message(
    message_id: str, model: str, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
    }


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    # input_tokens is the whole prompt: kvflow's prefix cache is automatic and is not billed apart, so
    # the cache fields stay 0 (present, since clients add them up).
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _stop_reason(c: CompletionOutput, tool_use: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason (and stop_sequence) for a finished completion."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):  # one of stop_sequences matched (it is not in the text)
        return "stop_sequence", c.stop_reason
    return ("tool_use" if tool_use else "end_turn"), None


def _client(raw: Request, user_id: str | None) -> str | None:
    """Who sent the request, for fair sharing: metadata.user_id, else the API key (either header)."""
    client = client_of(raw, user_id)
    key = raw.headers.get("x-api-key")
    if client is None and key:
        return "key:" + hashlib.sha256(f"Bearer {key}".encode()).hexdigest()[:16]  # = the same key as Bearer
    return client
