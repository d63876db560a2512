"""POST /v1/embeddings: the served model's pooled final hidden states (SamplingParams.pooling),
each input one prefill-only engine request."""

from __future__ import annotations

import base64
import dataclasses
import struct
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.engine.async_llm import AsyncLLM, RequestHandle
from kvflow.entrypoints.openai.protocol import EmbeddingRequest
from kvflow.entrypoints.openai.serving import OpenAIServing, client_of, request_id_of, sampling_params
from kvflow.entrypoints.openai.utils import APIError, finish_unstreamed, merge_handles, parse_body
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams


class ServingEmbedding(OpenAIServing):
    def __init__(self, llm: AsyncLLM, served_model_name: str, pooling: str, hidden_size: int) -> None:
        super().__init__(llm, served_model_name)
        self.params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        self.hidden_size = hidden_size

    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, EmbeddingRequest)
        model = self.model_name(req.model)
        if req.dimensions is not None and req.dimensions != self.hidden_size:
            raise APIError(
                400,
                f"dimensions {req.dimensions} is not supported: this model's embeddings have "
                f"{self.hidden_size} dimensions (its hidden size); leave dimensions out or give {self.hidden_size}",
                param="dimensions",
                code="invalid_value",
            )
        prompt_ids = [self.tokenize(p, req.add_special_tokens, param="input") for p in req.input]
        request_id = request_id_of(raw, "embd")
        finals = await self.embed(raw, request_id, prompt_ids, "input", arrival, client_of(raw, req.user))
        if finals is None:
            return Response(status_code=499)  # the client closed the connection
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": i, "embedding": _encode(out.embedding, req.encoding_format)}
                    for i, out in enumerate(finals)
                ],
                "model": model,
                "usage": {
                    "prompt_tokens": sum(len(o.prompt_token_ids) for o in finals),
                    "total_tokens": sum(len(o.prompt_token_ids) for o in finals),
                },
            }
        )

    async def embed(
        self,
        raw: Request,
        request_id: str,
        prompt_ids: list[list[int]],
        param: str,
        arrival: float,
        client: str | None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[RequestOutput] | None:
        """The prompts' finished embedding requests, in order (None: the client went away, and
        they were aborted), under `request_id` (`request_id_of`); an engine failure is a 500."""
        params = self.params
        if truncate_prompt_tokens is not None:
            params = sampling_params(lambda: dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens))
        handles = await self.add_requests(request_id, prompt_ids, params, param, arrival, client)
        finals = await finish_unstreamed(raw, handles, _collect(handles))
        for out in finals or ():
            if out.error is not None or out.embedding is None:
                raise APIError(500, out.error or "the model returned no embedding", code="engine_error")
        return finals


def _encode(embedding: list[float], encoding_format: str) -> Any:
    """float: the list; base64: little-endian float32 bytes, base64 (what the openai SDK decodes)."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


async def _collect(handles: list[RequestHandle]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(handles)
    async for i, out in merge_handles(handles):
        finals[i] = out
    return finals  # type: ignore[return-value]
