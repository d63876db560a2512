"""The server's OpenAPI document (`/openapi.json`): the real request bodies and error shapes.

The routes read their bodies themselves (`utils.validate_body`: strict JSON, Unicode checks, OpenAI's
error shape), so FastAPI cannot see the body models; `json_body` declares each one, `install_openapi`
adds their JSON Schemas to the document's components, and `responses` documents OpenAI's error
body for every 4xx/5xx a route can answer. Fuzzers (Schemathesis, in the tests) work from this.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorInfo


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        }
    }


def responses(stream: bool = False) -> dict[int | str, dict[str, Any]]:
    ok: dict[str, Any] = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    if stream:
        ok["content"]["text/event-stream"] = {}  # data: lines, each an OpenAI chunk object
    err = {"model": ErrorResponse}
    return {
        200: ok,
        400: {**err, "description": "Invalid request"},
        401: {**err, "description": "Missing or wrong API key"},
        404: {**err, "description": "Unknown model or route"},
        413: {**err, "description": "Request body too large"},
        500: {**err, "description": "This request failed (the others go on)"},
        503: {**err, "description": "Overloaded, draining, or the engine failed"},
    }


def install_openapi(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
