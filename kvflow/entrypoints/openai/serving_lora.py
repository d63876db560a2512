"""LoRA adapters over HTTP, as vLLM serves them: `/v1/models` lists each loaded adapter with its
base model as `parent`; `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
({"lora_name", "lora_path"}) change them at runtime, behind the API key like every route, and only
when KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=1 is set in the server's environment (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING). Loads and unloads run in the engine thread between steps."""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.engine.async_llm import AsyncLLM
from kvflow.entrypoints.openai.utils import APIError

RUNTIME_UPDATING_ENV = "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"


def adapter_cards(llm: AsyncLLM, served: str, created: int) -> list[dict[str, Any]]:
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "kvflow",
            "root": lora.lora_path,
            "parent": served,
            "max_model_len": llm.max_model_len,
        }
        for name, lora in list(getattr(llm.engine, "loras", {}).items())
    ]


async def _body(request: Request, fields: tuple[str, ...], enabled: bool) -> dict[str, str]:
    if os.environ.get(RUNTIME_UPDATING_ENV) != "1":
        raise APIError(
            403,
            f"loading and unloading LoRA adapters at runtime is off: start the server with {RUNTIME_UPDATING_ENV}=1",
            code="forbidden",
        )
    if not enabled:
        raise APIError(400, "this server runs without --enable-lora", code="invalid_value")
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    out = {}
    for f in fields:
        value = body.get(f)
        if not isinstance(value, str) or not value:
            raise APIError(400, f"`{f}` must be a non-empty string", param=f, code="invalid_value")
        out[f] = value
    return out


def add_lora_routes(app: FastAPI, llm: AsyncLLM, served: str) -> None:
    enabled = bool(getattr(llm.engine.config, "enable_lora", False))

    @app.post("/v1/load_lora_adapter", include_in_schema=False)
    async def load_lora_adapter(request: Request) -> Response:
        body = await _body(request, ("lora_name", "lora_path"), enabled)
        name, path = body["lora_name"], body["lora_path"]
        if name == served:
            raise APIError(400, f"`{name}` is the base model's name", param="lora_name", code="invalid_value")
        try:
            await llm.call(lambda e: e.load_lora(name, path))
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_value") from None
        return JSONResponse({"status": "ok", "message": f"LoRA adapter {name!r} loaded"})

    @app.post("/v1/unload_lora_adapter", include_in_schema=False)
    async def unload_lora_adapter(request: Request) -> Response:
        name = (await _body(request, ("lora_name",), enabled))["lora_name"]
        try:
            await llm.call(lambda e: e.unload_lora(name))
        except KeyError:
            raise APIError(
                404, f"no LoRA adapter named `{name}` is loaded", param="lora_name", code="not_found"
            ) from None
        return JSONResponse({"status": "ok", "message": f"LoRA adapter {name!r} unloaded"})
