"""The OpenAI-compatible HTTP server: a FastAPI app over an `AsyncLLM`, and `serve()` (uvicorn).

Request path: the gate middleware (API key 401, draining 503, body size 413, in-flight count)
-> the route -> `AsyncLLM` (engine thread). Errors always have OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, except on Anthropic's Messages routes (mounted
from kvflow/entrypoints/anthropic/), which answer in Anthropic's.

Process life cycle (`serve`):
- SIGTERM / SIGINT: stop accepting (new requests get 503 + Retry-After, /health 503), let in-flight
  requests finish for `shutdown_grace_s`, abort the rest (clients get finish_reason "abort"),
  then stop uvicorn and exit 0. A second signal forces the exit.
- A failed engine step: every in-flight request gets a 500 / an error event, /health turns 503,
  and the process exits with status 1 so a supervisor restarts it.
Both go through one injectable `exit_action(code)`, so a test can run the app in-process and see
the exit instead of dying.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Path
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.config import ServerConfig
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.engine_thread import EngineThread
from kvflow.engine.llm_engine import LLMEngine
from kvflow.entrypoints.anthropic.errors import AnthropicErrors
from kvflow.entrypoints.anthropic.router import REQUEST_MODELS as ANTHROPIC_MODELS
from kvflow.entrypoints.anthropic.router import anthropic_router
from kvflow.entrypoints.openai.openapi import install_openapi, json_body, responses
from kvflow.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from kvflow.entrypoints.openai.protocol_responses import ResponsesRequest
from kvflow.entrypoints.openai.response_store import ResponseStore
from kvflow.entrypoints.openai.serving import RETRY_AFTER_S
from kvflow.entrypoints.openai.serving_chat import ServingChat
from kvflow.entrypoints.openai.serving_completion import ServingCompletion
from kvflow.entrypoints.openai.serving_embedding import ServingEmbedding
from kvflow.entrypoints.openai.serving_lora import adapter_cards, add_lora_routes
from kvflow.entrypoints.openai.serving_responses import ServingResponses
from kvflow.entrypoints.openai.serving_score import ServingScore
from kvflow.entrypoints.openai.utils import REQUEST_ID_HEADER, APIError, parse_body, pydantic_error
from kvflow.metrics import EngineMetrics
from kvflow.tracing import INCOMING_TRACE, Tracer, trace_carrier
from kvflow.utils.http import url_host

logger = logging.getLogger("kvflow")

# Paths that stay open without an API key and while draining (probes and scrapers).
_OPEN_PATHS = frozenset({"/health", "/metrics"})
_ABORT_WAIT_S = 5.0  # after the grace period: how long aborted requests get to send their last bytes


class ServerState:
    """What the routes and the middleware share (one per app)."""

    def __init__(
        self,
        llm: AsyncLLM,
        config: ServerConfig,
        metrics: EngineMetrics,
        served_model_name: str,
        exit_action: Callable[[int], None],
    ) -> None:
        self.llm = llm
        self.config = config
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.exit_action = exit_action
        self.exit_code: int | None = None
        self.draining = False
        self.tracer: Tracer | None = None  # --otlp-traces-endpoint
        self.inflight = 0  # HTTP requests being served (the open paths excluded)
        self._no_inflight: asyncio.Event | None = None
        self.created = int(time.time())

    def request_started(self) -> None:
        self.inflight += 1
        if self._no_inflight is not None:
            self._no_inflight.clear()

    def request_ended(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self._no_inflight is not None:
            self._no_inflight.set()

    async def wait_no_inflight(self, timeout: float) -> bool:
        if self.inflight == 0:
            return True
        if self._no_inflight is None:
            self._no_inflight = asyncio.Event()
        try:
            await asyncio.wait_for(self._no_inflight.wait(), max(0.0, timeout))
            return True
        except TimeoutError:
            return self.inflight == 0

    # ---- exits ------------------------------------------------------------------------------------
    def request_exit(self, code: int) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        self.exit_action(code)

    def on_engine_dead(self, exc: BaseException) -> None:
        logger.error("the engine failed (%s: %s); exiting with status 1", type(exc).__name__, exc)
        self.request_exit(1)

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop accepting, give in-flight requests `grace_s` to finish, then abort the rest."""
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.draining = True
        logger.info("shutting down: %d requests in flight get up to %.1f s to finish", self.inflight, grace_s)
        if await self.wait_no_inflight(grace_s):
            return
        logger.warning("grace period over: aborting %d requests", self.llm.num_in_flight)
        deadline = time.monotonic() + _ABORT_WAIT_S
        while self.inflight and time.monotonic() < deadline:
            self.llm.abort_all()
            await self.wait_no_inflight(min(0.2, deadline - time.monotonic()))

    async def shutdown(self, grace_s: float | None = None) -> None:
        """The SIGTERM path: drain, then exit 0."""
        await self.drain(grace_s)
        self.request_exit(0)


class GateMiddleware:
    """API key, draining, request body size, in-flight count. Pure ASGI (no buffering of
    responses, so streaming and disconnects pass straight through)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state, cfg = self.state, self.state.config
        if scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if cfg.api_key is not None:
            auth = headers.get("authorization", "")
            # Anthropic's clients send the key as x-api-key
            token = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), cfg.api_key.encode()):
                message = (
                    "invalid API key" if token else "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key'"
                )
                await APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}).response()(
                    scope, receive, send
                )
                return
        if state.draining:
            await APIError(
                503, "the server is shutting down", code="shutting_down", headers={"Retry-After": RETRY_AFTER_S}
            ).response()(scope, receive, send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(scope, receive, send, headers)
            if body is None:
                return
            receive = _replay(body, receive)
        rid = headers.get("x-request-id")
        if rid is not None and REQUEST_ID_HEADER.fullmatch(rid):
            send = _with_header(send, b"x-request-id", rid.encode("latin-1"))  # (vLLM's echo)
        state.request_started()
        # the caller's trace context, for the spans of the engine requests this HTTP request adds
        trace = None if state.tracer is None else INCOMING_TRACE.set(trace_carrier(headers))
        try:
            await self.app(scope, receive, send)
        finally:
            state.request_ended()
            if trace is not None:
                INCOMING_TRACE.reset(trace)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> bytes | None:
        limit = self.state.config.max_request_body_bytes
        length = headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await APIError(400, f"invalid Content-Length {length!r}").response()(scope, receive, send)
                return None
            if declared > limit:
                await _too_large(declared, limit)(scope, receive, send)
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _too_large(None, limit)(scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _with_header(send: Send, name: bytes, value: bytes) -> Send:
    """`send` adding one header to the response's start."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return sending


def _too_large(size: int | None, limit: int) -> Response:
    got = f" ({size} bytes)" if size is not None else ""
    return APIError(
        413,
        f"the request body is too large{got}; the limit is {limit} bytes (max_request_body_bytes)",
        code="request_too_large",
    ).response()


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect

    return replay


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """The methods of every route whose path matches the request's."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in app.routes:
        if getattr(route, "methods", None) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    return sorted(methods)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvflow")
    except PackageNotFoundError:
        return "0"


def _default_exit(code: int) -> None:
    """Without a server loop to stop: leave the process after a moment (responses flush)."""
    logger.error("exiting with status %d", code)
    threading.Timer(0.5, os._exit, (code,)).start()


def build_app(
    engine: LLMEngine,
    config: ServerConfig | None = None,
    *,
    exit_action: Callable[[int], None] | None = None,
    engine_thread: EngineThread | None = None,
) -> FastAPI:
    """The ASGI app. The engine loop starts with the app's lifespan (on `engine_thread`, best the
    one that built the engine) and stops with it. `exit_action(code)` is called once when the
    process should end (1: the engine failed, 0: a graceful shutdown finished)."""
    config = config or ServerConfig()
    metrics = EngineMetrics()
    llm = AsyncLLM(
        engine,
        max_waiting_requests=config.max_waiting_requests,
        metrics=metrics,
        log_interval_s=config.log_interval_s,
        engine_thread=engine_thread,
    )
    names = config.served_model_name or [engine.model_name]
    served = names[0]
    state = ServerState(llm, config, metrics, served, exit_action or _default_exit)
    llm.on_fatal = state.on_engine_dead
    completions = ServingCompletion(llm, served)
    embeddings = ServingEmbedding(llm, served, engine.config.pooling, engine.model_config.hidden_size)
    scoring = ServingScore(embeddings)
    chat = ServingChat(
        llm, served, config.tool_call_parser, config.reasoning_parser, config.trust_request_chat_template
    )
    responses_api = ServingResponses(chat, ResponseStore(config.responses_store_size))
    if config.otlp_traces_endpoint is not None:
        state.tracer = Tracer("kvflow-engine", config.otlp_traces_endpoint)
        kv = engine.config.kv_transfer()
        role = kv.kv_role if kv is not None else "engine"
        for serving in (completions, embeddings, chat):  # (responses and messages go through chat)
            serving.tracer, serving.trace_role = state.tracer, role
    for serving in (completions, embeddings, chat):  # (scores, responses and messages go through these)
        serving.aliases = tuple(names[1:])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()
        try:
            yield
        finally:
            await llm.shutdown()
            if state.tracer is not None:
                state.tracer.shutdown()  # the spans still batched go out

    app = FastAPI(title="kvflow", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvflow = state
    app.add_middleware(GateMiddleware, state=state)
    app.add_middleware(AnthropicErrors)  # outside the gate: its 401 / 413 / 503 get Anthropic's shape too
    if config.allowed_origins:  # no CORS headers at all unless asked for
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
        )
    install_openapi(
        app,
        (
            CompletionRequest,
            ChatCompletionRequest,
            EmbeddingRequest,
            ScoreRequest,
            RerankRequest,
            ResponsesRequest,
            TokenizeRequest,
            DetokenizeRequest,
            *ANTHROPIC_MODELS,
        ),
    )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        return pydantic_error(errors[0] if errors else {}).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette names the methods of one route; a path may have several
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(app, request))}
        return APIError(exc.status_code, message, code=code, headers=headers).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error").response()

    @app.get("/health", responses=responses())
    async def health() -> Response:
        if llm.is_dead:
            return APIError(503, f"the engine is dead: {llm.dead_error}", code="engine_dead").response()
        if state.draining:
            return APIError(503, "the server is shutting down", code="shutting_down").response()
        return JSONResponse({"status": "ok"})

    @app.get(
        "/metrics",
        responses={
            200: {
                "description": "Prometheus text format",
                "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
            }
        },
    )
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_cards() -> list[dict[str, Any]]:
        """The served model under each of its names, then the loaded LoRA adapters."""
        base = [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "kvflow",
                "root": getattr(engine, "model_path", served),
                "parent": None,
                "max_model_len": llm.max_model_len,
            }
            for name in names
        ]
        return [*base, *adapter_cards(llm, served, state.created)]

    @app.get("/v1/models", responses=responses())
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": model_cards()})

    @app.get("/v1/models/{model_id:path}", responses=responses())
    async def get_model(model_id: str = Path(examples=[served])) -> Response:
        completions.model_name(model_id, allow_lora=True)
        return JSONResponse(next(c for c in model_cards() if c["id"] == model_id))

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest), responses=responses(stream=True))
    async def create_completion(request: Request) -> Response:
        return await completions.create(request)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=responses(stream=True))
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(request)

    @app.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest), responses=responses(stream=False))
    async def create_embedding(request: Request) -> Response:
        return await embeddings.create(request)

    # vLLM's score and rerank APIs (Jina's and Cohere's rerank shapes), from the model's embeddings;
    # the first path of each is the one in the OpenAPI spec
    for paths, handler, body in (
        (("/score", "/v1/score"), scoring.score, ScoreRequest),
        (("/rerank", "/v1/rerank", "/v2/rerank"), scoring.rerank, RerankRequest),
    ):
        for path in paths:
            app.add_api_route(
                path,
                handler,
                methods=["POST"],
                openapi_extra=json_body(body),
                responses=responses(stream=False),
                include_in_schema=path == paths[0],
            )

    app.include_router(anthropic_router(chat))  # /v1/messages, /v1/messages/count_tokens

    @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest), responses=responses(stream=True))
    async def create_response(request: Request) -> Response:
        return await responses_api.create(request)

    @app.get("/v1/responses/{response_id}", responses=responses())
    async def get_response(response_id: str = Path(examples=["resp_0"])) -> Response:
        return responses_api.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", responses=responses())
    async def delete_response(response_id: str = Path(examples=["resp_0"])) -> Response:
        return responses_api.delete(response_id)

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest), responses=responses(stream=False))
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, TokenizeRequest)
        completions.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            if req.chat_template_kwargs is not None:
                raise APIError(400, "chat_template_kwargs goes with messages, not prompt", param="chat_template_kwargs")
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = completions.tokenize(req.prompt, special)
        else:
            try:
                conversation = [m.template_dict() for m in req.messages]
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            text = chat.apply_chat_template(conversation, req.add_generation_prompt, variables=req.chat_template_kwargs)
            ids = chat.tokenize(text, bool(req.add_special_tokens), param="messages")
        body: dict[str, Any] = {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}
        if req.return_token_strs and llm.tokenizer is not None:
            body["token_strs"] = llm.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), responses=responses(stream=False))
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest)
        completions.model_name(req.model)
        vocab = engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {vocab})", param="tokens", code="invalid_value")
        return JSONResponse({"prompt": completions.decode(req.tokens)})

    add_lora_routes(app, llm, served)  # LoRA adapters at runtime (kvflow.entrypoints.openai.serving_lora)

    # A debug route (kept out of the OpenAPI spec): what a request waited through, from the
    # engine's step records (docs/operations/diagnosis.md). Read on the engine thread, between steps.
    @app.get("/debug/requests/{request_id}", include_in_schema=False)
    async def debug_request(request_id: str) -> Response:
        answer = await llm.call(lambda e: _explain(e, request_id))
        if answer is None:
            raise APIError(
                404,
                f"no step records for request {request_id!r}: unknown, or expired from the ring of the last "
                f"{engine.config.step_record_capacity} steps (--step-record-capacity)",
                param="request_id",
                code="not_found",
            )
        return JSONResponse(answer)

    return app


def _explain(engine: LLMEngine, request_id: str) -> dict[str, Any] | None:
    """The step records' answer for a request id as the client saw it: a completion of several
    prompts is one engine request per prompt ({id}-0, {id}-1, ...), answered under "prompts"."""
    answer = engine.explain_request(request_id)
    if answer is not None:
        return answer
    prompts = []
    while (part := engine.explain_request(f"{request_id}-{len(prompts)}")) is not None:
        prompts.append(part)
    return {"request_id": request_id, "prompts": prompts} if prompts else None


# ---- running it --------------------------------------------------------------------------------------
class _UvicornServer:
    """A uvicorn.Server with kvflow's signal handling (drain, then exit 0: uvicorn's own handler
    re-raises the signal after shutting down, which would end the process with -SIGTERM) and a
    ready callback once the socket accepts connections."""

    def __new__(cls, *args: Any, **kwargs: Any):  # defer importing uvicorn until it is needed
        import uvicorn

        class Server(uvicorn.Server):
            def __init__(self, config: uvicorn.Config, state: ServerState, on_ready: Callable[[], None] | None) -> None:
                super().__init__(config)
                self.kvflow_state = state
                self.on_ready = on_ready
                self.loop: asyncio.AbstractEventLoop | None = None
                self._signalled = False

            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                self.loop = asyncio.get_running_loop()
                await super().startup(sockets=sockets)
                if self.started and not self.should_exit and self.on_ready is not None:
                    self.on_ready()

            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                sigs = (signal.SIGINT, signal.SIGTERM)
                original = {s: signal.signal(s, self._on_signal) for s in sigs}
                try:
                    yield
                finally:
                    for s, handler in original.items():
                        signal.signal(s, handler)

            def _on_signal(self, sig: int, frame: Any) -> None:
                if self._signalled or self.loop is None:
                    logger.warning("exiting now (signal %d)", sig)
                    self.should_exit = True
                    self.force_exit = self._signalled
                    self._signalled = True
                    return
                self._signalled = True
                state = self.kvflow_state
                self.loop.call_soon_threadsafe(lambda: self.loop.create_task(state.shutdown()))

        return Server(*args, **kwargs)


def serve(
    engine: LLMEngine,
    config: ServerConfig,
    *,
    on_ready: Callable[[str], None] | None = None,
    engine_thread: EngineThread | None = None,
) -> int:
    """Run the server until SIGTERM (returns 0) or an engine failure (returns 1). `engine_thread`:
    the thread that built `engine`, which then steps it."""
    import uvicorn

    server = None

    def exit_action(code: int) -> None:
        # Called on the event loop. Let the last responses / error events flush, then stop uvicorn.
        assert server is not None
        asyncio.get_running_loop().call_later(0.1 if code == 0 else 0.5, setattr, server, "should_exit", True)
        if code != 0:  # a backstop in case the graceful stop hangs
            t = threading.Timer(config.shutdown_grace_s + 10.0, os._exit, (code,))
            t.daemon = True
            t.start()

    app = build_app(engine, config, exit_action=exit_action, engine_thread=engine_thread)
    state: ServerState = app.state.kvflow
    url = f"http://{url_host(config.host)}:{config.port}"

    def ready() -> None:
        # The grammar compiler (it imports xgrammar and transformers: seconds on a small CPU) builds
        # in the background from here: started earlier it held the GIL against the start-up itself.
        if engine.structured is not None:
            engine.structured.warm_up()
        if on_ready is not None:
            on_ready(url)

    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = _UvicornServer(uv_config, state, ready)
    server.run()
    if state.exit_code is None:  # uvicorn stopped on its own (e.g. the port was taken)
        return 1 if not server.started else 0
    return state.exit_code
