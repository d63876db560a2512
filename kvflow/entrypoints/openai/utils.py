"""Shared pieces of the HTTP layer: OpenAI-shaped errors, body parsing, SSE, merging request
streams, and watching for a client that went away."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvflow.engine.async_llm import RequestFailedError, RequestHandle
from kvflow.entrypoints.disconnect import ClientDisconnected, run_until_disconnect
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams, check_text

M = TypeVar("M", bound=BaseModel)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


# A client's X-Request-Id header (vLLM's): its engine requests' ids carry it, and responses echo it.
REQUEST_ID_HEADER = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class APIError(Exception):
    """Becomes `{"error": {"message", "type", "param", "code"}}` with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": _cut(self.message), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_MAX_MESSAGE_CHARS = 500  # an error message never echoes a whole prompt (or a stack of them) back


def _cut(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE_CHARS else message[:_MAX_MESSAGE_CHARS] + "... (cut)"


# ---- request bodies ----------------------------------------------------------------------------------
async def parse_body(request: Request, model: type[M]) -> M:
    return validate_body(await request.body(), model)


def validate_body(raw: bytes, model: type[M]) -> M:
    """JSON bytes -> the request model, or an APIError (400) naming the problem."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits, NaN
        raise APIError(400, f"the request body is not valid JSON: {_cut(str(e))}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    _check_strings(data, [])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_strings(value: Any, path: list[str]) -> None:
    """Every string (and key) must be valid Unicode: JSON's "\\ud800" escape decodes to a lone
    surrogate that no tokenizer or UTF-8 encoder takes. Iterative: the body may nest deeply."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            _check_text(v, p)
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_text(k, p)
                stack.append((x, p + [k]))
        elif isinstance(v, list):
            stack.extend((x, p + [str(i)]) for i, x in enumerate(v))


def _check_text(text: str, path: list[str]) -> None:
    try:
        check_text(text, ".".join(path) or "a key")
    except ValueError as e:
        param = ".".join(p for p in path if _safe(p)) or None
        raise APIError(400, str(e), param=param, code="invalid_unicode") from None


def _safe(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def validation_error(e: ValidationError) -> APIError:
    # For a union-typed field pydantic reports each member's failure; the one that got deepest
    # (a content part's type, not "is not a string") says most.
    err = max(e.errors(include_url=False), key=lambda x: len(x.get("loc", ())))
    return pydantic_error(err)


# Chat messages are a union tagged by role: pydantic puts the tag (and, for a union-typed field,
# the member type it tried) into an error's location. Neither is a parameter the client sent.
_UNION_PARTS = re.compile(r"^(system|developer|user|assistant|tool|str|int|float|bool|.*\[.*)$")
# The member of an untagged union of models (the Responses API's input items): its class name.
_MODEL_NAME = re.compile(r"^[A-Z][A-Za-z0-9]*$")


def pydantic_error(err: dict[str, Any]) -> APIError:
    raw_loc = [x for x in err.get("loc", ()) if x != "body"]
    loc: list[str] = []
    skipped = False
    for i, x in enumerate(raw_loc):
        after_index = i > 0 and (isinstance(raw_loc[i - 1], int) or skipped)
        skipped = (
            i > 0
            and isinstance(x, str)
            and (
                "[" in x  # a member type of a union-typed field, e.g. list[...] of `str | list[...]`
                or (_UNION_PARTS.match(x) is not None and (after_index or i == len(raw_loc) - 1))
                or (_MODEL_NAME.match(x) is not None and after_index)
            )
        )
        if not skipped:
            loc.append(str(x))
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if err.get("type") == "missing":
        return APIError(400, f"{param} is required", param=param, code="missing_required_parameter")
    if param and not msg.startswith(loc[0]):
        msg = f"{param}: {msg}"
    if "input" in err and err.get("type") != "value_error" and _short(err["input"]):
        msg += f" (got {json.dumps(err['input'])})"
    return APIError(400, msg, param=param, code="invalid_value")


def _short(value: Any) -> bool:
    try:
        return len(json.dumps(value)) <= 80
    except (TypeError, ValueError):
        return False


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {
    "best_of",
    "suffix",
    "echo",
    "top_logprobs",
    "logit_bias",
    "n",
    "stream_options",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "messages",
    "parallel_tool_calls",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "allowed_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "cache_salt",
    "chat_template_kwargs",
    "continue_final_message",
}


def value_error(e: ValueError, prompt_param: str = "prompt") -> APIError:
    """A ValueError from request validation (SamplingParams, LLMEngine.add_request, the chat
    template) -> 400, naming the parameter where the message says which one."""
    msg = str(e)
    if msg.startswith("the prompt has") and "max_model_len" in msg:
        return APIError(400, msg, param=prompt_param, code="context_length_exceeded")
    if msg.startswith("prompt (") and "max_model_len" in msg:
        return APIError(400, msg, param="max_tokens", code="context_length_exceeded")
    if msg.startswith(("the prompt", "prompt token id", "prompt must", "prompt is")):
        return APIError(400, msg, param=prompt_param, code="invalid_value")
    m = re.match(r"\s*([a-z_]+)", msg)
    param = m.group(1) if m and m.group(1) in _SAMPLING_FIELDS else None
    if prompt_param == "messages" and param == "logprobs":  # (a chat request names the count top_logprobs)
        param = "top_logprobs"
    return APIError(400, msg, param=param, code="invalid_value")


# ---- server-sent events ---------------------------------------------------------------------------
# Characters that JSON leaves raw but that str.splitlines() (and SSE readers built on it) takes
# for line breaks: escaped, so that one event's data stays on one line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(data: dict[str, Any]) -> str:
    """`data` as one line of compact JSON (non-ASCII kept, line-breaking characters escaped)."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


def sse(data: dict[str, Any]) -> str:
    return f"data: {sse_json(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(message: str, status: int = 500, code: str | None = "engine_error") -> str:
    return sse(APIError(status, message, code=code).body())


class OwnedStreamingResponse(StreamingResponse):
    """A streaming response that aborts its requests however it ends (finished, client gone,
    cancelled before the body iterator ever ran)."""

    def __init__(self, content: AsyncIterator[str], handles: Sequence[RequestHandle], **kwargs: Any) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            **kwargs,
        )
        self.handles = handles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_all(self.handles)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except (Exception, asyncio.CancelledError):
                    pass


def abort_all(handles: Sequence[RequestHandle]) -> None:
    for h in handles:
        h.abort()


# ---- several requests as one stream ------------------------------------------------------------------
_END = object()


async def merge_handles(handles: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several request handles as they come. Any failure propagates; leaving
    early aborts every request."""
    if len(handles) == 1:
        try:
            async for out in handles[0]:
                yield 0, out
        finally:
            abort_all(handles)
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        try:
            async for out in h:
                q.put_nowait((i, out))
        except Exception as e:  # RequestFailedError
            q.put_nowait((i, e))
            return
        q.put_nowait((i, _END))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        abort_all(handles)


T = TypeVar("T")


async def last_output(handle: RequestHandle) -> RequestOutput:
    """A request's finished output (RequestFailedError if the engine failed it)."""
    last = None
    async for _, out in merge_handles([handle]):
        last = out
    assert last is not None
    return last


async def finish_unstreamed(request: Request, handles: Sequence[RequestHandle], work: Awaitable[T]) -> T | None:
    """Run a non-streamed request to its end. None if the client went away (it is aborted); an
    engine failure becomes a 500. The requests are aborted however this ends (a no-op if done)."""
    try:
        return await run_until_disconnect(request, work)
    except ClientDisconnected:
        return None
    except RequestFailedError as e:
        raise APIError(500, str(e), code="engine_error") from None
    finally:
        abort_all(handles)


def kv_transfer_fields(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """P/D disaggregation: what a producer engine set on a finished output, as vLLM's top-level
    `kv_transfer_params` of a response (or of a stream's final chunk); nothing when it set none, so
    ordinary responses keep OpenAI's shape. A request with kv_transfer_params holds one prompt, so
    the first output that has them is the one."""
    for out in outputs:
        if out.kv_transfer_params is not None:
            return {"kv_transfer_params": out.kv_transfer_params}
    return {}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt tokens found in the prefix cache, as OpenAI's
    prompt_tokens_details reports its prompt caching."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def safe_logprob(x: float) -> float:
    """JSON has no -inf/NaN: clamp as vLLM does."""
    if x != x:
        return -9999.0
    return max(float(x), -9999.0)
