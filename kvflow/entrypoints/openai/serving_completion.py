"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.engine.async_llm import RequestFailedError, RequestHandle
from kvflow.engine.llm_engine import truncate_prompt
from kvflow.entrypoints.openai.beam_search import start_requests
from kvflow.entrypoints.openai.protocol import CompletionRequest
from kvflow.entrypoints.openai.serving import (
    OpenAIServing,
    client_of,
    completion_logprobs,
    echoed_logprobs,
    expert_trace_fields,
    now_s,
    prompt_logprobs_field,
    request_id_of,
    sampling_params,
)
from kvflow.entrypoints.openai.utils import (
    SSE_DONE,
    OwnedStreamingResponse,
    finish_unstreamed,
    kv_transfer_fields,
    merge_handles,
    parse_body,
    sse,
    sse_error,
    usage,
)
from kvflow.outputs import RequestOutput


class ServingCompletion(OpenAIServing):
    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, CompletionRequest)
        model = self.model_name(req.model, allow_lora=True)
        params = sampling_params(req.to_sampling_params)
        prompt_ids = [self.tokenize(p, req.add_special_tokens) for p in req.prompt]
        beams = sampling_params(lambda: req.beam_search_params(params))
        if beams is None:
            params = self.with_model_defaults(params, req)
        request_id = request_id_of(raw, "cmpl")
        handles = await start_requests(
            self,
            request_id,
            prompt_ids,
            params,
            beams,
            "prompt",
            arrival,
            client_of(raw, req.user),
            self.lora_of(model),
            req.cache_salt,
        )
        if req.echo and req.truncate_prompt_tokens is not None:  # what the engine kept (it took the value)
            keep, limit = req.truncate_prompt_tokens, self.llm.max_model_len
            echo = [self.decode(truncate_prompt(ids, keep, limit)) for ids in prompt_ids]
        else:
            echo = [(p if isinstance(p, str) else self.decode(p)) if req.echo else "" for p in req.prompt]
        ctx = _Ctx(request_id, model, now_s(), req, echo)
        if req.stream:
            return OwnedStreamingResponse(self._stream(ctx, handles), handles)
        finals = await finish_unstreamed(raw, handles, _collect(handles))
        if finals is None:
            return Response(status_code=499)  # the client closed the connection
        return JSONResponse(self._response(ctx, finals))

    def _choice(
        self, ctx: _Ctx, prompt_index: int, out: RequestOutput, c, text: str, first_token: int, first: bool
    ) -> dict[str, Any]:
        """The choice for text `text` and the logprobs of c's tokens from `first_token` on; `first`:
        the choice's first chunk (or the whole of it), which carries what belongs to the prompt."""
        lp = None
        if ctx.req.logprobs is not None and c.logprobs is not None:
            lp = completion_logprobs(
                c.token_ids,
                c.logprobs,
                ctx.req.logprobs,
                len(ctx.echo[prompt_index]),
                self.token_bytes,
                start=first_token,
                as_ids=ctx.req.return_tokens_as_token_ids,
            )
            if first and ctx.req.echo and out.prompt_logprobs is not None:  # the prompt's tokens first
                head = echoed_logprobs(
                    out.prompt_token_ids,
                    out.prompt_logprobs,
                    ctx.req.logprobs,
                    self.token_bytes,
                    ctx.req.return_tokens_as_token_ids,
                )
                lp = {k: head[k] + lp[k] for k in lp}
        choice = {
            "index": prompt_index * ctx.req.n + c.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
        }
        if ctx.req.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = prompt_logprobs_field(out.prompt_logprobs)
        if ctx.req.return_token_ids:
            choice["token_ids"] = list(c.token_ids[first_token:])
            if first:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
            choice.update(expert_trace_fields(c))
        return choice

    def _response(self, ctx: _Ctx, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for pi, out in enumerate(finals):
            for c in out.outputs:
                prefix = ctx.echo[pi]
                choices.append(self._choice(ctx, pi, out, c, prefix + c.text, 0, True))
        n_prompt = sum(len(o.prompt_token_ids) for o in finals)
        n_out = sum(len(c.token_ids) for o in finals for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in finals)
        return {
            "id": ctx.request_id,
            "object": "text_completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
            "usage": usage(n_prompt, n_out, cached),
            **kv_transfer_fields(finals),
        }

    async def _stream(self, ctx: _Ctx, handles: list[RequestHandle]) -> AsyncIterator[str]:
        req = ctx.req
        base = {"id": ctx.request_id, "object": "text_completion", "created": ctx.created, "model": ctx.model}
        extra = {"usage": None} if req.include_usage else {}
        sent_text: dict[int, int] = {}  # choice index -> characters sent
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        prompt_tokens: dict[int, int] = {}
        cached: dict[int, int] = {}

        def used() -> dict[str, Any]:
            return usage(sum(prompt_tokens.values()), sum(sent_tokens.values()), sum(cached.values()))

        try:
            async for pi, out in merge_handles(handles):
                prompt_tokens[pi] = len(out.prompt_token_ids)
                cached[pi] = out.num_cached_tokens
                for c in out.outputs:
                    idx = pi * req.n + c.index
                    if idx in finished:
                        continue
                    first = idx not in sent_text
                    n_chars, n_tok = sent_text.get(idx, 0), sent_tokens.get(idx, 0)
                    delta = c.text[n_chars:]
                    new_ids = c.token_ids[n_tok:]
                    if (
                        not delta
                        and not c.finished
                        and not ((req.logprobs is not None or req.return_token_ids) and new_ids)
                        and not (first and ctx.echo[pi])
                    ):
                        continue
                    prefix = ctx.echo[pi] if first else ""
                    choice = self._choice(ctx, pi, out, c, prefix + delta, n_tok, first)
                    sent_text[idx], sent_tokens[idx] = len(c.text), len(c.token_ids)
                    final = kv_transfer_fields([out]) if c.finished else {}  # on the chunk with finish_reason
                    if c.finished:
                        finished.add(idx)
                    if req.continuous_usage:
                        extra = {"usage": used()}
                    yield sse({**base, "choices": [choice], **extra, **final})
            if req.include_usage:
                yield sse({**base, "choices": [], "usage": used()})
        except RequestFailedError as e:
            yield sse_error(str(e))
        yield SSE_DONE


class _Ctx:
    def __init__(self, request_id: str, model: str, created: int, req: CompletionRequest, echo: list[str]) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.req = req
        self.echo = echo


async def _collect(handles: list[RequestHandle]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(handles)
    async for i, out in merge_handles(handles):
        finals[i] = out
    return finals  # type: ignore[return-value]
