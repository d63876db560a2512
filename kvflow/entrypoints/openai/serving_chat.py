"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.engine.async_llm import RequestFailedError, RequestHandle
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest
from kvflow.entrypoints.openai.serving import OpenAIServing, chat_logprobs, now_s, sampling_params
from kvflow.entrypoints.openai.utils import (SSE_DONE, OwnedStreamingResponse,
                                             finish_unstreamed, merge_handles, parse_body, sse,
                                             sse_error, usage, value_error)
from kvflow.outputs import RequestOutput


class ServingChat(OpenAIServing):
    def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        try:
            conversation = req.conversation()
        except ValueError as e:
            raise value_error(e, "messages") from None
        text = self.apply_chat_template(conversation, req.add_generation_prompt)
        # The template already holds the special tokens (BOS etc.): do not add them twice.
        return self.tokenize(text, add_special_tokens=False, param="messages")

    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, ChatCompletionRequest)
        model = self.model_name(req.model)
        params = sampling_params(req.to_sampling_params)
        prompt_ids = self.chat_prompt_ids(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        handles = await self.add_requests(request_id, [prompt_ids], params, "messages", arrival)
        created = now_s()
        if req.stream:
            return OwnedStreamingResponse(self._stream(request_id, model, created, req, handles), handles)
        finals = await finish_unstreamed(raw, handles, _last_output(handles[0]))
        if finals is None:
            return Response(status_code=499)  # the client closed the connection
        return JSONResponse(self._response(request_id, model, created, req, finals))

    def _logprobs(self, req: ChatCompletionRequest, token_ids: list[int], logprobs) -> dict[str, Any] | None:
        if not req.logprobs or logprobs is None:
            return None
        return chat_logprobs(token_ids, logprobs, req.top_logprobs or 0, self.token_bytes)

    def _response(self, request_id: str, model: str, created: int, req: ChatCompletionRequest,
                  out: RequestOutput) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(req, c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices,
                "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}

    async def _stream(self, request_id: str, model: str, created: int, req: ChatCompletionRequest,
                      handles: list[RequestHandle]) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        extra = {"usage": None} if req.include_usage else {}
        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        finished = [False] * req.n
        n_prompt = 0
        try:
            for i in range(req.n):  # the role first, before any token
                yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}], **extra})
            async for _, out in merge_handles(handles):
                n_prompt = len(out.prompt_token_ids)
                for c in out.outputs:
                    i = c.index
                    if finished[i]:
                        continue
                    delta = c.text[sent_text[i]:]
                    new_ids = c.token_ids[sent_tokens[i]:]
                    if not delta and not c.finished and not (req.logprobs and new_ids):
                        continue
                    new_lps = c.logprobs[sent_tokens[i]:] if c.logprobs is not None else None
                    choice: dict[str, Any] = {"index": i, "delta": {"content": delta} if delta else {},
                                              "logprobs": self._logprobs(req, new_ids, new_lps),
                                              "finish_reason": c.finish_reason}
                    if c.finished:
                        choice["stop_reason"] = c.stop_reason
                        finished[i] = True
                    sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                    yield sse({**base, "choices": [choice], **extra})
            if req.include_usage:
                yield sse({**base, "choices": [], "usage": usage(n_prompt, sum(sent_tokens))})
        except RequestFailedError as e:
            yield sse_error(str(e))
        yield SSE_DONE


async def _last_output(handle: RequestHandle) -> RequestOutput:
    last = None
    async for _, out in merge_handles([handle]):
        last = out
    assert last is not None
    return last
