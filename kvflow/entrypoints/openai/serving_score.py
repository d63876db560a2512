"""POST /score and /rerank (vLLM's, Jina's and Cohere's shapes): text pairs scored by the served
model's embeddings (kvflow.entrypoints.scoring), each distinct text one embedding request."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.entrypoints.openai.protocol import RerankRequest, ScoreRequest
from kvflow.entrypoints.openai.serving import client_of, now_s, request_id_of
from kvflow.entrypoints.openai.serving_embedding import ServingEmbedding
from kvflow.entrypoints.openai.utils import APIError, parse_body
from kvflow.entrypoints.scoring import cosine, pair_indices


class ServingScore:
    def __init__(self, embeddings: ServingEmbedding) -> None:
        self.embeddings = embeddings

    async def _embed(
        self, raw: Request, request_id: str, fields: list[tuple[str, list[str]]], req: Any, arrival: float
    ):
        """The embeddings of every text of the (field name, texts) groups, in order, and their
        token counts (None: the client went away). A text too long for the context is a 400 naming
        its field (unless truncate_prompt_tokens cuts it)."""
        e = self.embeddings
        limit = e.llm.max_model_len
        ids = []
        for name, texts in fields:
            for i, text in enumerate(texts):
                tokens = e.tokenize(text, req.add_special_tokens, param=name)
                if req.truncate_prompt_tokens is None and len(tokens) >= limit:
                    where = name if name == "query" else f"{name}[{i}]"  # (a query is one text)
                    raise APIError(
                        400,
                        f"{where} has {len(tokens)} tokens but max_model_len is {limit}; at most "
                        f"{limit - 1} fit (or give truncate_prompt_tokens)",
                        param=name,
                        code="context_length_exceeded",
                    )
                ids.append(tokens)
        finals = await e.embed(
            raw, request_id, ids, fields[0][0], arrival, client_of(raw, req.user), req.truncate_prompt_tokens
        )
        if finals is None:
            return None
        return [o.embedding for o in finals], [len(o.prompt_token_ids) for o in finals]

    async def score(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, ScoreRequest)
        model = self.embeddings.model_name(req.model)
        try:
            pairs = pair_indices(len(req.text_1), len(req.text_2))
        except ValueError as e:
            raise APIError(400, str(e), param="text_1", code="invalid_value") from None
        request_id = request_id_of(raw, "score")
        embedded = await self._embed(raw, request_id, [("text_1", req.text_1), ("text_2", req.text_2)], req, arrival)
        if embedded is None:
            return Response(status_code=499)  # the client closed the connection
        vectors, counts = embedded
        first, second = vectors[: len(req.text_1)], vectors[len(req.text_1) :]
        tokens = sum(counts)
        return JSONResponse(
            {
                "id": request_id,
                "object": "list",
                "created": now_s(),
                "model": model,
                "data": [
                    {"index": k, "object": "score", "score": cosine(first[i], second[j])}
                    for k, (i, j) in enumerate(pairs)
                ],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
            }
        )

    async def rerank(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, RerankRequest)
        model = self.embeddings.model_name(req.model)
        documents = req.texts()
        request_id = request_id_of(raw, "rerank")
        embedded = await self._embed(raw, request_id, [("query", [req.query]), ("documents", documents)], req, arrival)
        if embedded is None:
            return Response(status_code=499)  # the client closed the connection
        vectors, counts = embedded
        scores = [cosine(vectors[0], v) for v in vectors[1:]]
        order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))  # best first; ties in order
        if req.top_n:
            order = order[: req.top_n]
        results = [
            {
                "index": i,
                **({"document": {"text": documents[i]}} if req.return_documents else {}),
                "relevance_score": scores[i],
            }
            for i in order
        ]
        return JSONResponse(
            {
                "id": request_id,
                "model": model,
                "usage": {"total_tokens": sum(counts)},
                "results": results,
            }
        )
