"""The Messages routes, mounted by the server (api_server.build_app) with `include_router`.

Like the OpenAI routes they read their bodies themselves (strict JSON, Unicode checks): `json_body`
declares each body model to the OpenAPI document, and REQUEST_MODELS go into its components."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from kvflow.entrypoints.anthropic.errors import PATH, responses
from kvflow.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvflow.entrypoints.anthropic.serving import ServingMessages
from kvflow.entrypoints.openai.openapi import json_body
from kvflow.entrypoints.openai.serving_chat import ServingChat

REQUEST_MODELS = (MessagesRequest, CountTokensRequest)


def anthropic_router(chat: ServingChat) -> APIRouter:
    messages = ServingMessages(chat)
    router = APIRouter(tags=["Anthropic"])

    @router.post(PATH, openapi_extra=json_body(MessagesRequest), responses=responses(stream=True))
    async def create_message(request: Request) -> Response:
        return await messages.create(request)

    @router.post(PATH + "/count_tokens", openapi_extra=json_body(CountTokensRequest), responses=responses(False))
    async def count_message_tokens(request: Request) -> Response:
        return await messages.count_tokens(request)

    return router
