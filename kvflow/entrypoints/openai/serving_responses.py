"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A response is a chat completion underneath: the request becomes a chat request (protocol_responses),
rendered, constrained and sent to the engine by ServingChat's own code, and its output text is read by
the same tool parser. What differs is the shape: the output is a list of items (`message` with
`output_text`, `function_call`), built by `OutputBuilder` from the parser's events in the order the
model wrote them. The streamed and the non-streamed response run the same builder, over growing text
or over the whole of it, so both give the same items.

Streaming sends OpenAI's typed events, each with its `sequence_number`: response.created,
response.in_progress, then per item output_item.added, (content_part.added, output_text.delta...,
output_text.done, content_part.done) or (function_call_arguments.delta..., .done), output_item.done,
and last response.completed, or response.incomplete when the output was cut (max_output_tokens, the
context), or response.failed when this request failed.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.engine.async_llm import RequestFailedError, RequestHandle
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
from kvflow.entrypoints.openai.protocol_responses import ResponsesRequest
from kvflow.entrypoints.openai.response_store import ResponseStore
from kvflow.entrypoints.openai.serving import client_of, sampling_params
from kvflow.entrypoints.openai.serving_chat import ServingChat
from kvflow.entrypoints.openai.tool_parsers import StreamingToolParser, ToolCallFormat
from kvflow.entrypoints.openai.utils import (
    APIError,
    OwnedStreamingResponse,
    finish_unstreamed,
    last_output,
    merge_handles,
    parse_body,
    sse_json,
    validation_error,
)
from kvflow.outputs import RequestOutput


class OutputBuilder:
    """Output items from the growing output text, and the stream events each new piece implies."""

    def __init__(self, tools: ToolCallFormat | None) -> None:
        self.parser = StreamingToolParser(tools) if tools is not None else None
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._sent = 0  # without tools: the characters of text already taken
        self._done = False

    def feed(self, text: str, finished: bool, incomplete: bool = False) -> list[dict[str, Any]]:
        """`text`: the whole output so far. Returns the events (without sequence numbers) for what
        is new; when `finished`, the last item is closed: "incomplete" if the output was cut."""
        if self._done:
            return []
        if self.parser is not None:
            pieces = self.parser.events(text, finished)
        else:
            pieces = [("content", text[self._sent :])]
            self._sent = len(text)
        events: list[dict[str, Any]] = []
        for piece in pieces:
            if piece[0] == "content":
                if piece[1]:
                    self._text(piece[1], events)
            elif piece[0] == "call":
                self._close("completed", events)
                self._add(
                    {
                        "id": "fc_" + uuid.uuid4().hex,
                        "type": "function_call",
                        "status": "in_progress",
                        "arguments": "",
                        "call_id": piece[3],
                        "name": piece[2],
                    },
                    events,
                )
            else:
                assert self._open is not None and self._open["type"] == "function_call"
                self._open["arguments"] += piece[2]
                events.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": piece[2]})
        if finished:
            self._done = True
            if not self.items:  # a response always has its message, if an empty one
                self._open_message(events)
            self._close("incomplete" if incomplete else "completed", events)
        return events

    # ---- items -------------------------------------------------------------------------------------
    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict[str, Any], events: list[dict[str, Any]]) -> None:
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)})

    def _open_message(self, events: list[dict[str, Any]]) -> None:
        message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress", "role": "assistant"}
        self._add({**message, "content": []}, events)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open["content"].append(part)  # type: ignore[index]
        events.append({"type": "response.content_part.added", **self._where(), "content_index": 0, "part": _copy(part)})

    def _text(self, text: str, events: list[dict[str, Any]]) -> None:
        if self._open is None or self._open["type"] != "message":
            self._close("completed", events)
            self._open_message(events)
        assert self._open is not None
        self._open["content"][0]["text"] += text
        events.append(
            {
                "type": "response.output_text.delta",
                **self._where(),
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        )

    def _close(self, status: str, events: list[dict[str, Any]]) -> None:
        item = self._open
        if item is None:
            return
        where = self._where()
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                }
            )
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": _copy(part)})
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        events.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)})
        self._open = None


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))  # events carry the item as it is now, not as it will become


# Chat fields -> the Responses fields they came from, for the `param` of an error.
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "structured_outputs": "text.format",
}


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head in _PARAMS:
        return _PARAMS[head] if head != "messages" or not rest else "input"
    if head == "tools" and ".function." in param:  # the chat tool nests what a Responses tool holds
        return param.replace(".function.", ".", 1)
    return param


@contextlib.contextmanager
def _as_responses_params() -> Iterator[None]:
    """Errors raised by the chat code name chat fields: name the request's own instead."""
    try:
        yield
    except APIError as e:
        e.param = responses_param(e.param)
        raise


class ServingResponses:
    def __init__(self, chat: ServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, ResponsesRequest)
        model = self.chat.model_name(req.model)
        req.refused()
        history: tuple[dict[str, Any], ...] = ()
        if req.previous_response_id is not None:
            history = self.store.previous(req.previous_response_id).items
        elif req.input is None or req.input == []:
            raise APIError(400, "input is required (or previous_response_id)", param="input")
        with _as_responses_params():
            chat_req = _chat_request(req.chat_body(list(history)))
            params = self.chat.with_model_defaults(sampling_params(chat_req.to_sampling_params), chat_req)
            tools = self.chat.tool_format_for(chat_req, params)
            prompt_ids = self.chat.chat_prompt_ids(chat_req, tools)
            response_id = "resp_" + uuid.uuid4().hex
            handles = await self.chat.add_requests(
                response_id, [prompt_ids], params, "input", arrival, client_of(raw, req.user)
            )
        items = (*history, *req.input_items())
        base = self._body(response_id, model, req, time.time())
        if req.stream:
            return OwnedStreamingResponse(self._stream(req, base, handles, tools, items), handles)
        out = await finish_unstreamed(raw, handles, last_output(handles[0]))
        if out is None:
            return Response(status_code=499)  # the client closed the connection
        builder = OutputBuilder(tools)
        completion = out.outputs[0]
        builder.feed(completion.text, True, completion.finish_reason != "stop")
        body = self._finish(base, builder, out)
        self._keep(req, body, items)
        return JSONResponse(body)

    def retrieve(self, response_id: str) -> Response:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"no response {response_id[:80]!r} is kept", param="response_id", code="not_found")
        return JSONResponse(entry.body)

    def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            raise APIError(404, f"no response {response_id[:80]!r} is kept", param="response_id", code="not_found")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    # ---- the response object -------------------------------------------------------------------------
    def _body(self, response_id: str, model: str, req: ResponsesRequest, created: float) -> dict[str, Any]:
        """The response as it stands before any output ("in_progress")."""
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(created),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "metadata": req.metadata or {},
            "model": model,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "service_tier": "default",
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text_echo(),
            "tool_choice": req.effective_tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_logprobs": 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
        }

    def _finish(self, base: dict[str, Any], builder: OutputBuilder, out: RequestOutput) -> dict[str, Any]:
        completion = out.outputs[0]
        reason = completion.finish_reason
        body = {**base, "output": builder.items, "completed_at": int(time.time())}
        if reason == "stop":
            body["status"] = "completed"
        else:  # cut by max_output_tokens or the context ("length"), or aborted
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"} if reason == "length" else None
        n_in, n_out = len(out.prompt_token_ids), len(completion.token_ids)
        body["usage"] = {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_in + n_out,
        }
        return body

    def _keep(self, req: ResponsesRequest, body: dict[str, Any], items: tuple[dict[str, Any], ...]) -> None:
        if req.store:
            self.store.put(body["id"], body, (*items, *body["output"]))
        else:
            self.store.not_stored(body["id"])

    async def _stream(
        self,
        req: ResponsesRequest,
        base: dict[str, Any],
        handles: list[RequestHandle],
        tools: ToolCallFormat | None,
        items: tuple[dict[str, Any], ...],
    ) -> AsyncIterator[str]:
        sequence = 0

        def event(data: dict[str, Any]) -> str:
            nonlocal sequence
            data["sequence_number"] = sequence
            sequence += 1
            return f"event: {data['type']}\ndata: {sse_json(data)}\n\n"

        builder = OutputBuilder(tools)
        yield event({"type": "response.created", "response": base})
        yield event({"type": "response.in_progress", "response": base})
        try:
            last = None
            async for _, out in merge_handles(handles):
                last = out
                completion = out.outputs[0]
                for e in builder.feed(completion.text, completion.finished, completion.finish_reason != "stop"):
                    yield event(e)
            assert last is not None
            body = self._finish(base, builder, last)
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield event({"type": kind, "response": body})
            self._keep(req, body, items)
        except RequestFailedError as e:
            failed = {
                **base,
                "status": "failed",
                "output": builder.items,
                "error": {"code": "server_error", "message": str(e)[:500]},
            }
            yield event({"type": "response.failed", "response": failed})


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    from pydantic import ValidationError

    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
