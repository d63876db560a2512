"""Anthropic's error shape on the Messages routes.

The rest of the server (the API-key gate, body limits, validation, admission control, the route
handlers) raises one kind of error and writes OpenAI's body. Rather than teach each of those places a
second dialect, `AnthropicErrors` rewrites the error responses of the Messages paths at the edge:
`{"type": "error", "error": {"type": <Anthropic's type for the status>, "message": ...}}`, and a 503
that means "try again later" (queue full, the server draining) becomes Anthropic's 529
`overloaded_error`, which its SDKs retry. Streams write their error events with `sse_error` here.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.entrypoints.openai.utils import sse_json

PATH = "/v1/messages"
OVERLOADED = 529  # Anthropic's status for "temporarily overloaded"
_RETRY_LATER = frozenset({"overloaded", "shutting_down"})  # codes of a 503 that is an overload
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    OVERLOADED: "overloaded_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def sse_error(status: int, message: str) -> str:
    return f"event: error\ndata: {sse_json(error_body(status, message))}\n\n"


def anthropic_error(status: int, openai_body: Any) -> tuple[int, dict[str, Any]] | None:
    """(status, Anthropic's body) for an OpenAI error body; None when the body is not one."""
    err = openai_body.get("error") if isinstance(openai_body, dict) else None
    if not isinstance(err, dict) or openai_body.get("type") == "error":
        return None
    if status == 503 and err.get("code") in _RETRY_LATER:
        status = OVERLOADED
    return status, error_body(status, str(err.get("message") or "error"))


def on_messages_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


class AnthropicErrors:
    """Pure ASGI: only error responses (status >= 400, JSON) of the Messages paths are held back and
    rewritten; everything else, streams included, passes straight through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not on_messages_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400 and _is_json(message):
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await _send_rewritten(send, start, b"".join(chunks))

        await self.app(scope, receive, rewrite)


def _is_json(start: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json") for k, v in start["headers"])


async def _send_rewritten(send: Send, start: Message, body: bytes) -> None:
    status = start["status"]
    try:
        converted = anthropic_error(status, json.loads(body))
    except ValueError:
        converted = None
    if converted is not None:
        status, shaped = converted
        body = json.dumps(shaped, ensure_ascii=False).encode()
    headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---- the OpenAPI document ---------------------------------------------------------------------------
class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body."""

    type: str
    error: AnthropicErrorDetail


def responses(stream: bool) -> dict[int | str, dict[str, Any]]:
    ok: dict[str, Any] = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    if stream:
        ok["content"]["text/event-stream"] = {}  # event: / data: pairs, Anthropic's stream events
    err = {"model": AnthropicErrorResponse}
    return {
        200: ok,
        400: {**err, "description": "Invalid request (invalid_request_error)"},
        401: {**err, "description": "Missing or wrong API key (authentication_error)"},
        404: {**err, "description": "Unknown model (not_found_error)"},
        413: {**err, "description": "Request body too large (request_too_large)"},
        500: {**err, "description": "This request failed; the others go on (api_error)"},
        503: {**err, "description": "The engine failed (api_error)"},
        OVERLOADED: {**err, "description": "Overloaded or draining: retry later (overloaded_error)"},
    }
