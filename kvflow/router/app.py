"""The router: an async HTTP proxy in front of kvflow servers (FastAPI app, httpx client).

Request path for POST /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages and
/v1/embeddings: the policy picks a `Route` (a Responses request that continues a stored response,
`previous_response_id`, goes to the engine that stores it: `locate_response`); with a prefill engine
on it (completions and chat only; with --max-local-prefill-length, only prompts longer than that for
the decode engine: `PrefillDecodePolicy`), the router first sends that engine a prefill-only copy of the body (`pd.py`)
and reads `kv_transfer_params` from its answer; then it sends the client's body (plus those params)
to the target and relays its answer as it comes: status, headers that matter, JSON body, or the SSE
stream chunk by chunk.

A stream's status line goes to the client with the upstream's first chunk: until then nothing was
relayed, so a failure is still the client's HTTP error (or, data-parallel, a retry).

Failures:
- prefill engine answers 4xx: that answer goes to the client (a bad request stays one);
- prefill engine answers 5xx, garbage, or cannot be reached: the client's body goes to the decode
  engine unchanged (it computes the prompt itself) and `prefill_fallbacks_total` counts it;
- data-parallel (--backend): a replica that cannot be reached, or answers 5xx, before any byte was
  relayed: the request is sent once more, to another healthy replica (`retries_total`); a replica
  that refuses connections leaves the rotation at once, until its /health passes again;
- target unreachable (and no retry, or the retry failed too): 502 (timed out: 504), OpenAI's
  error body naming the backend URL;
- target fails mid-stream: an SSE error event, then [DONE] (the status line is already sent);
- client gone: the upstream request is closed, so the engine aborts it within a step.

Background tasks (data-parallel policies): every --health-interval-s each replica's /health is
probed (a failure takes it out of rotation, a pass puts it back); with least_loaded / cache_aware,
every --load-poll-s each healthy replica's /metrics is scraped for its load (`Backend.load`). With
--router-kv-events, one task per replica follows its KV event stream (`kvflow.kv_events.subscriber`)
into the policy's view of its cache (`kv_view.py`), and a request's prompts are tokenized by a
replica's /tokenize before the policy routes it (a failure: routed by its text).

Only the router's own modules and the web stack are imported: no torch, no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvflow.entrypoints.disconnect import ClientDisconnected, run_until_disconnect
from kvflow.router import metrics as m
from kvflow.router.config import RouterConfig
from kvflow.router.kv_view import tokenize_requests
from kvflow.router.metrics import RouterMetrics
from kvflow.router.pd import RESPONSES_PATH, ROUTED_PATHS, decode_body, encode_body, prefill_body
from kvflow.router.policies import Backend, Route, RouteRequest, RoutingPolicy, make_policy
from kvflow.tracing import Tracer, trace_carrier
from kvflow.utils.prometheus import parse_prometheus

logger = logging.getLogger("kvflow.router")

# A replica's /tokenize answer, for routing by KV events, is waited for this long at most (then the
# request is routed by its text).
TOKENIZE_TIMEOUT_S = 2.0

# Client headers the engines need; the rest (host, content-length, hop-by-hop) are the router's.
_FORWARDED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "x-request-id")
# Stored responses whose engine the router found (response id -> backend), the most recent kept.
RESPONSE_HOMES_KEPT = 4096
# Upstream headers a client may act on: the body's type, and when to retry an overloaded engine.
_RELAYED_HEADERS = ("content-type", "retry-after", "x-request-id")


def error_body(message: str, *, code: str, status: int) -> dict[str, Any]:
    """OpenAI's error shape, as the engines answer, so clients handle the router's errors alike."""
    return {
        "error": {
            "message": message,
            "type": "server_error" if status >= 500 else "invalid_request_error",
            "param": None,
            "code": code,
        }
    }


def error_response(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, code=code, status=status), status_code=status)


@dataclass
class _Attempt:
    """One upstream request's outcome, as the client would get it."""

    response: Response
    # The backend failed before any byte was relayed (unreachable, or a 5xx): another may serve it.
    retryable: bool = False
    detail: str = ""  # why it failed, for the log


class Router:
    """The proxy logic behind the routes. `transport` replaces httpx's network transport (tests)."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        policy: RoutingPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self.policy = policy if policy is not None else make_policy(config.policy, config.policy_options())
        self.metrics = RouterMetrics()
        for b in self.policy.backends():
            # each backend's series from the start, at 0: a Prometheus rate() counts its first requests
            self.metrics.requests.labels(b.url, b.role)
        if self.policy.name == "pd":
            for decision in ("local_prefill", "remote_prefill"):
                self.metrics.pd_decisions.labels(decision)
        self.client = httpx.AsyncClient(
            # read: the longest silence between bytes (a stream's next token, a prefill's answer)
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            # Every in-flight request holds an upstream connection for its whole generation: the
            # engines' admission control, not a pool limit, decides how many run.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            # Backends are named explicitly; an HTTP(S)_PROXY meant for the internet must not
            # capture 127.0.0.1 traffic.
            trust_env=False,
            transport=transport,
        )
        self._tasks: list[asyncio.Task] = []
        self._tokenize_turn = 0  # --router-kv-events: replicas take turns tokenizing prompts
        # Bumped whenever a backend's health is set: a probe that began before a request saw the
        # backend refuse connections must not put it back with its stale answer.
        self._health_epoch: dict[Backend, int] = dict.fromkeys(self.policy.backends(), 0)
        self._response_homes: OrderedDict[str, Backend] = OrderedDict()
        self.tracer: Tracer | None = None
        if config.otlp_traces_endpoint is not None:
            self.tracer = Tracer("kvflow-router", config.otlp_traces_endpoint)

    async def start(self) -> None:
        """Start the background health checks and load scrapes (the app's lifespan calls this)."""
        if self.policy.health_checked:
            for b in self.policy.backends():
                self.metrics.backend_healthy.labels(b.url).set(1 if b.healthy else 0)
            self._tasks.append(asyncio.create_task(self._health_loop(), name="kvflow-router-health"))
        if self.policy.uses_load:
            self._tasks.append(asyncio.create_task(self._load_loop(), name="kvflow-router-load"))
        self._start_kv_event_subscribers()

    def _start_kv_event_subscribers(self) -> None:
        endpoints = self.config.kv_event_endpoints()
        if not endpoints:
            return
        from kvflow.kv_events.subscriber import KVEventSubscriber

        for backend, (pub, replay) in zip(self.policy.backends(), endpoints):
            view = self.policy.kv_view(backend)
            if view is None:
                continue
            counters = {
                "batches": self.metrics.kv_event_batches.labels(backend.url),
                "replays": self.metrics.kv_event_replays.labels(backend.url),
                "lost": self.metrics.kv_event_lost.labels(backend.url),
            }

            def on_stat(kind: str, n: int, counters=counters) -> None:
                if kind in counters:
                    counters[kind].inc(n)

            sub = KVEventSubscriber(pub, view, replay, name=f"{backend.url} ({pub})", on_stat=on_stat)
            self._tasks.append(asyncio.create_task(self._follow(sub), name=f"kvflow-router-kv-events-{backend.url}"))
            logger.info("following the KV events of %s at %s (replay: %s)", backend.url, pub, replay or "none")

    async def _follow(self, sub) -> None:
        """Run one replica's event subscriber; should it fail, start it again (its view is reset)."""
        while True:
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("KV events of %s: the subscriber failed; starting it again", sub.name)
                sub.consumer.reset()
                await asyncio.sleep(1.0)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await self.client.aclose()
        if self.tracer is not None:
            self.tracer.shutdown()

    # ---- POST /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, /v1/embeddings ------
    async def generate(self, request: Request, path: str) -> Response:
        if self.tracer is None:
            return await self._generate(request, path, None)
        trace = _RequestTrace(self.tracer, request, path)
        response = await self._generate(request, path, trace)
        trace.finish(response)
        return response

    async def _generate(self, request: Request, path: str, trace: _RequestTrace | None) -> Response:
        started = time.monotonic()
        raw = await request.body()
        headers = _forwarded(request)
        body = _json_object(raw)
        if body is None:
            # Nothing a policy could read: the first backend answers with the engine's own 400,
            # the same a client of a plain server gets.
            return (await self._relay(request, self.policy.primary(), path, raw, headers, started)).response
        route_request = RouteRequest(path, body)
        previous = body.get("previous_response_id") if path == RESPONSES_PATH else None
        if isinstance(previous, str):
            # A conversation's state lives in one engine's response store: that engine answers (no
            # retry elsewhere: no other engine has the state). Not found anywhere: the policy's
            # choice answers with its own 404.
            home = await self.locate_response(previous, headers)
            if home is not None:
                return (
                    await self._relay(request, home, path, raw, _call(trace, "decode", home, headers), started)
                ).response
        if self.policy.wants_token_ids(route_request):
            ids = await self._prompt_token_ids(path, body, headers)
            if ids is not None:
                route_request = RouteRequest(path, body, ids)
        route = self.policy.route(route_request)
        self._record_route(route)
        content = raw
        if route.prefill is not None:
            try:
                outcome = await run_until_disconnect(
                    request, self._prefill(route.prefill, path, body, _call(trace, "prefill", route.prefill, headers))
                )
            except ClientDisconnected:
                return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
            if isinstance(outcome, Response):
                return outcome
            if outcome is not None:
                content = decode_body(body, outcome)
        attempt = await self._relay(
            request, route.target, path, content, _call(trace, "decode", route.target, headers), started, route.work
        )
        if attempt.retryable:
            retry = self.policy.reroute(route_request, route.target)
            if retry is not None:
                self.metrics.retries.inc()
                logger.warning(
                    "backend %s failed before answering (%s); retrying on %s",
                    route.target.url,
                    attempt.detail,
                    retry.target.url,
                )
                attempt = await self._relay(
                    request,
                    retry.target,
                    path,
                    content,
                    _call(trace, "decode", retry.target, headers),
                    started,
                    retry.work,
                )
        return attempt.response

    async def _prompt_token_ids(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> list[list[int]] | None:
        """The token ids of each prompt of the request as the engines will compute them (token-id
        prompts as given, the others from a healthy replica's /tokenize, replicas taken in turn);
        None when the router cannot get them all (the policy then routes by the prompt's text)."""
        plan = tokenize_requests(path, body)
        if plan is None:
            return None
        calls = [p for p in plan if isinstance(p, dict)]
        if not calls:
            return plan  # type: ignore[return-value]
        healthy = [b for b in self.policy.backends() if b.healthy] or self.policy.backends()
        self._tokenize_turn += 1
        url = healthy[self._tokenize_turn % len(healthy)].url + "/tokenize"

        async def tokenize(payload: dict[str, Any]) -> list[int] | None:
            try:
                resp = await self.client.post(
                    url,
                    json={k: v for k, v in payload.items() if v is not None},
                    headers=headers,
                    timeout=TOKENIZE_TIMEOUT_S,
                )
                tokens = resp.json().get("tokens") if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                tokens = None
            return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None

        answers = iter(await asyncio.gather(*(tokenize(p) for p in calls)))
        out = [next(answers) if isinstance(p, dict) else p for p in plan]
        if any(ids is None for ids in out):
            self.metrics.tokenize_failures.inc()
            return None
        return out  # type: ignore[return-value]

    def _record_route(self, route: Route) -> None:
        if route.pd_decision is not None:
            self.metrics.pd_decisions.labels(route.pd_decision).inc()
            if route.local_prefill_tokens is not None and logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "pd: %s (about %.0f prompt tokens for %s to compute)",
                    route.pd_decision,
                    route.local_prefill_tokens,
                    route.target.url,
                )
        if route.cache_hit is not None:
            (self.metrics.cache_hits if route.cache_hit else self.metrics.cache_misses).inc()
        if route.match_ratio is not None:
            self.metrics.prefix_match_ratio.observe(route.match_ratio)

    async def _prefill(
        self, backend: Backend, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | Response | None:
        """The prefill step. Its kv_transfer_params; None: the decode engine computes the prompt
        (the engine returned none, or failed: a fallback); a Response: the client's error."""
        self._sent(backend)
        try:
            resp = await self.client.post(
                backend.url + path,
                content=encode_body(prefill_body(path, body)),
                headers={**headers, "content-type": "application/json"},
            )
        except httpx.TransportError as e:
            return self._fallback(backend, _reason(e), f"{type(e).__name__}: {e}")
        finally:
            backend.end()
        if 400 <= resp.status_code < 500:
            return _copy(resp)  # the request itself is wrong; the decode engine would say the same
        if resp.status_code >= 500:
            return self._fallback(backend, m.HTTP_5XX, f"HTTP {resp.status_code}")
        data = _json_object(resp.content) if resp.status_code == 200 else None
        params = data.get("kv_transfer_params") if data is not None else None
        if data is None or not (params is None or isinstance(params, dict)):
            return self._fallback(
                backend, m.BAD_RESPONSE, f"HTTP {resp.status_code}, not a completion with kv_transfer_params"
            )
        if params is None:
            # A server that is not a kv_producer: nothing to fetch, the decode engine recomputes.
            logger.debug("prefill engine %s returned no kv_transfer_params", backend.url)
        return params

    def _fallback(self, backend: Backend, reason: str, detail: str) -> None:
        logger.warning("prefill engine %s failed (%s); the decode engine computes the prompt", backend.url, detail)
        self.metrics.errors.labels(backend.url, reason).inc()
        self.metrics.prefill_fallbacks.inc()
        return None

    async def _relay(
        self,
        request: Request,
        backend: Backend,
        path: str,
        content: bytes,
        headers: dict[str, str],
        started: float,
        work: float = 0.0,
    ) -> _Attempt:
        """Send `content` to `backend`; its answer, as the client's response. A stream is answered
        once its first chunk arrived: a failure before it is still an HTTP error (retryable).
        `work`: the request's tokens of work there (`Route.work`), in flight until the answer ends."""
        upstream = self.client.build_request(
            "POST", backend.url + path, content=content, headers={**headers, "content-type": "application/json"}
        )
        self._sent(backend, work)
        try:
            resp = await run_until_disconnect(request, self.client.send(upstream, stream=True))
        except ClientDisconnected:
            backend.end(work)
            return _Attempt(Response(status_code=499))
        except httpx.TransportError as e:
            backend.end(work)
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) and self.policy.health_checked:
                self._set_health(backend, False, f"{type(e).__name__}: {e}")  # no need to wait for a probe
            return self._failed(backend, e)
        if resp.status_code >= 500:
            self.metrics.errors.labels(backend.url, m.HTTP_5XX).inc()
        if resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
            chunks = resp.aiter_bytes()
            try:
                first = await run_until_disconnect(request, _first_chunk(chunks))
            except ClientDisconnected:
                await resp.aclose()
                backend.end(work)
                return _Attempt(Response(status_code=499))
            except httpx.TransportError as e:
                await resp.aclose()
                backend.end(work)
                return self._failed(backend, e)
            self.metrics.ttfb.observe(time.monotonic() - started)
            return _Attempt(_RelayedStream(_Upstream(resp, backend, self.metrics, chunks, first, work)))
        try:
            data = await run_until_disconnect(request, resp.aread())
        except ClientDisconnected:
            return _Attempt(Response(status_code=499))
        except httpx.TransportError as e:
            return self._failed(backend, e)
        finally:
            await resp.aclose()
            backend.end(work)
        if resp.status_code == 200:
            self.metrics.ttfb.observe(time.monotonic() - started)
        return _Attempt(
            Response(data, status_code=resp.status_code, headers=_relayed(resp)),
            retryable=resp.status_code >= 500,
            detail=f"HTTP {resp.status_code}",
        )

    def _failed(self, backend: Backend, e: httpx.TransportError) -> _Attempt:
        """No answer from `backend`: a 502 / 504; retryable unless it timed out (a retry would
        wait as long again)."""
        return _Attempt(
            self._unreachable(backend, e), retryable=_reason(e) == m.UNREACHABLE, detail=f"{type(e).__name__}: {e}"
        )

    def _unreachable(self, backend: Backend, e: httpx.TransportError) -> JSONResponse:
        reason = _reason(e)
        self.metrics.errors.labels(backend.url, reason).inc()
        if reason == m.TIMEOUT:
            return error_response(
                504,
                f"{_who(backend)} did not answer within {self.config.timeout_s:g} s ({type(e).__name__})",
                "backend_timeout",
            )
        return error_response(502, f"{_who(backend)} is unreachable: {type(e).__name__}: {e}", "backend_unreachable")

    def _sent(self, backend: Backend, work: float = 0.0) -> None:
        self.metrics.requests.labels(backend.url, backend.role).inc()
        backend.begin(work)

    # ---- health and load (data-parallel policies) ---------------------------------------------------
    def _set_health(self, backend: Backend, healthy: bool, detail: str) -> None:
        self._health_epoch[backend] = self._health_epoch.get(backend, 0) + 1
        if backend.healthy == healthy:
            return
        self.policy.set_healthy(backend, healthy)
        self.metrics.backend_healthy.labels(backend.url).set(1 if healthy else 0)
        if healthy:
            logger.info("backend %s is healthy again: back in rotation", backend.url)
        else:
            self.metrics.backend_unhealthy.labels(backend.url).inc()
            backend.forget_scrape()
            logger.warning("backend %s is unhealthy (%s): out of rotation", backend.url, detail)

    async def check_health(self) -> None:
        """Probe every backend's /health once, concurrently, and set their states."""
        await asyncio.gather(*(self._check(b) for b in self.policy.backends()))

    async def _check(self, backend: Backend) -> None:
        epoch = self._health_epoch.get(backend, 0)
        state = await self._probe(backend.url)
        if self._health_epoch.get(backend, 0) == epoch:
            self._set_health(backend, state == "ok", state)

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # never let the checker die: a replica could then never come back
                logger.exception("health check failed")
            await asyncio.sleep(self.config.health_interval_s)

    async def scrape_loads(self) -> None:
        """Read every healthy backend's load from its /metrics once, concurrently."""
        await asyncio.gather(*(self._scrape(b) for b in self.policy.backends() if b.healthy))

    async def _scrape(self, backend: Backend) -> None:
        try:
            resp = await self.client.get(backend.url + "/metrics", timeout=self.config.health_timeout_s)
        except httpx.TransportError:
            backend.forget_scrape()
            return
        values = parse_engine_load(resp.text) if resp.status_code == 200 else None
        if values is None:
            backend.forget_scrape()  # not a kvflow server, or not now: the router's own count
        else:
            backend.record_scrape(*values)

    async def _load_loop(self) -> None:
        while True:
            try:
                await self.scrape_loads()
            except Exception:
                logger.exception("load scrape failed")
            await asyncio.sleep(self.config.load_poll_s)

    def update_view_gauges(self) -> None:
        """kvflow_router:kv_view_blocks from the policy's views of the replicas' caches."""
        from kvflow.kv_events.events import MEDIA

        for b in self.policy.backends():
            view = self.policy.kv_view(b)
            if view is not None:
                for medium in MEDIA:
                    self.metrics.kv_view_blocks.labels(b.url, medium).set(view.num_blocks(medium))

    # ---- stored responses (GET / DELETE /v1/responses/{id}, previous_response_id) -------------------
    async def locate_response(self, response_id: str, headers: dict[str, str]) -> Backend | None:
        """The backend whose response store holds `response_id`: remembered from an earlier lookup,
        else found by asking every backend at once (GET /v1/responses/{id}; the first 200). Asking
        keeps the router stateless across restarts; a lookup costs one local round trip per
        backend, once per conversation turn."""
        home = self._response_homes.get(response_id)
        if home is not None:
            self._response_homes.move_to_end(response_id)
            return home

        async def holds(backend: Backend) -> bool:
            try:
                resp = await self.client.get(f"{backend.url}{RESPONSES_PATH}/{response_id}", headers=headers)
            except httpx.TransportError:
                return False
            return resp.status_code == 200

        backends = list(dict.fromkeys(self.policy.backends()))
        found = await asyncio.gather(*(holds(b) for b in backends))
        home = next((b for b, ok in zip(backends, found) if ok), None)
        if home is not None:
            self._response_homes[response_id] = home
            while len(self._response_homes) > RESPONSE_HOMES_KEPT:
                self._response_homes.popitem(last=False)
        return home

    async def stored_response(self, request: Request, response_id: str) -> Response:
        """GET or DELETE /v1/responses/{id}, answered by the engine that stores it (none: the
        primary's own 404)."""
        headers = _forwarded(request)
        backend = await self.locate_response(response_id, headers) or self.policy.primary()
        if request.method == "DELETE":
            self._response_homes.pop(response_id, None)
        try:
            resp = await self.client.request(request.method, backend.url + request.url.path, headers=headers)
        except httpx.TransportError as e:
            return self._unreachable(backend, e)
        return _copy(resp)

    # ---- routes that every engine answers alike ------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return await self.passthrough(request, "/v1/models")

    async def passthrough(self, request: Request, path: str) -> Response:
        """The request as sent (method, body, Authorization), to the primary backend (GET
        /v1/models, POST /tokenize: what is the same on every engine); its answer, relayed."""
        backend = self.policy.primary()
        headers = _forwarded(request)
        content = await request.body() if request.method == "POST" else None
        if content is not None:
            headers["content-type"] = request.headers.get("content-type", "application/json")
        try:
            resp = await self.client.request(request.method, backend.url + path, content=content, headers=headers)
        except httpx.TransportError as e:
            return self._unreachable(backend, e)
        return _copy(resp)

    async def health(self) -> Response:
        """200 when every backend's /health is; else 503 naming those that are not."""
        urls = list(dict.fromkeys(b.url for b in self.policy.backends()))  # a URL in two roles: once
        states = await asyncio.gather(*(self._probe(url) for url in urls))
        backends = dict(zip(urls, states))
        failed = {url: s for url, s in backends.items() if s != "ok"}
        if failed:
            return JSONResponse({"status": "unhealthy", "failed": failed, "backends": backends}, status_code=503)
        return JSONResponse({"status": "ok", "backends": backends})

    async def _probe(self, url: str) -> str:
        try:
            resp = await self.client.get(url + "/health", timeout=self.config.health_timeout_s)
        except httpx.TransportError as e:
            return f"unreachable: {type(e).__name__}"
        return "ok" if resp.status_code == 200 else f"HTTP {resp.status_code}"


class _Upstream:
    """An upstream streaming response, closed exactly once however the relay ends. `chunks` is its
    byte iterator, `first` what was already read from it (the first chunk)."""

    def __init__(
        self,
        resp: httpx.Response,
        backend: Backend,
        metrics: RouterMetrics,
        chunks: AsyncIterator[bytes] | None = None,
        first: bytes = b"",
        work: float = 0.0,
    ) -> None:
        self.resp = resp
        self.backend = backend
        self.work = work  # its `Backend.inflight_work`, released with it
        self.metrics = metrics
        self._chunks = chunks if chunks is not None else resp.aiter_bytes()
        self._first = first
        self._closed = False
        self.on_close: list[Callable[[], None]] = []  # (tracing: the spans of the relayed stream)

    async def chunks(self) -> AsyncIterator[bytes]:
        tail = b"\n\n"
        try:
            if self._first:
                tail = self._first[-2:]
                yield self._first
            async for chunk in self._chunks:
                if chunk:
                    tail = chunk[-2:]
                    yield chunk
        except httpx.TransportError as e:
            reason = m.TIMEOUT if isinstance(e, httpx.TimeoutException) else m.STREAM_BROKEN
            self.metrics.errors.labels(self.backend.url, reason).inc()
            logger.warning("stream from %s broke: %s: %s", self.backend.url, type(e).__name__, e)
            # The status line is sent: say it in the stream, as an engine does when a request fails.
            sep = b"" if tail == b"\n\n" else b"\n\n"  # our event must not join a cut one
            err = error_body(
                f"{_who(self.backend)} failed mid-stream: {type(e).__name__}", code="backend_stream_broken", status=502
            )
            yield sep + b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            await self.close()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.backend.end(self.work)
            await self.resp.aclose()  # closes the connection mid-stream: the engine aborts the request
            for done in self.on_close:
                done()


class _RelayedStream(StreamingResponse):
    """The upstream's SSE stream, relayed as it arrives. Closing the upstream is tied to the
    response, not to the iterator: the client may leave before the iterator ever runs."""

    def __init__(self, upstream: _Upstream) -> None:
        super().__init__(
            upstream.chunks(),
            status_code=upstream.resp.status_code,
            media_type=upstream.resp.headers.get("content-type", "text/event-stream"),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await asyncio.shield(self.upstream.close())


# ---- helpers -------------------------------------------------------------------------------------------
class _RequestTrace:
    """The router's spans of one request (--otlp-traces-endpoint): a server span under the client's
    traceparent, and a client span per engine call, whose traceparent the engine continues. A
    relayed stream's spans end when the stream does."""

    def __init__(self, tracer: Tracer, request: Request, path: str) -> None:
        self.tracer = tracer
        carrier = trace_carrier({k.lower(): v for k, v in request.headers.items()})
        self.span = tracer.start(
            "kvflow.router.request", tracer.context_of(carrier), tracer.SERVER, **{"http.route": path}
        )
        self.calls: list[Any] = []

    def call(self, kind: str, backend: Backend, headers: dict[str, str]) -> dict[str, str]:
        """Headers for a call to `backend` (`kind`: prefill | decode) under a new client span."""
        for earlier in self.calls:  # a prefill answered (or a failed try) before the next call
            if earlier.is_recording():
                earlier.end()
        span = self.tracer.start(
            f"kvflow.router.{kind}",
            self.span,
            self.tracer.CLIENT,
            **{"server.address": backend.url, "kvflow.role": backend.role},
        )
        self.calls.append(span)
        return {**headers, **self.tracer.headers_for(span)}

    def finish(self, response: Response) -> None:
        self.span.set_attribute("http.response.status_code", response.status_code)

        def end() -> None:
            for span in (*self.calls, self.span):
                if span.is_recording():
                    span.end()

        if isinstance(response, _RelayedStream):
            response.upstream.on_close.append(end)
        else:
            end()


def _call(trace: _RequestTrace | None, kind: str, backend: Backend, headers: dict[str, str]) -> dict[str, str]:
    return headers if trace is None else trace.call(kind, backend, headers)


def _who(backend: Backend) -> str:
    """How messages name a backend: "decode backend URL", or "backend URL" for a replica."""
    return f"backend {backend.url}" if backend.role == "backend" else f"{backend.role} backend {backend.url}"


async def _first_chunk(chunks: AsyncIterator[bytes]) -> bytes:
    """The first non-empty chunk (b"": the stream ended without one). The iterator stays open."""
    async for chunk in chunks:
        if chunk:
            return chunk
    return b""


_LOAD_GAUGES = ("kvflow:num_requests_running", "kvflow:num_requests_waiting", "kvflow:kv_cache_usage_perc")


def parse_engine_load(text: str) -> tuple[float, float, float] | None:
    """(running, waiting, KV usage) from a kvflow server's Prometheus text (samples of one gauge
    with labels are summed, NaN ones left out); None when running or waiting is missing (not a
    kvflow server)."""
    found: dict[str, float] = {}
    for name, _, value in parse_prometheus(text, names=_LOAD_GAUGES):
        if value == value:  # not NaN
            found[name] = found.get(name, 0.0) + value
    running, waiting, usage = (found.get(name) for name in _LOAD_GAUGES)
    if running is None or waiting is None:
        return None
    return running, waiting, usage or 0.0


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """A JSON object, or None. Strict as the engines are: NaN / Infinity are not JSON (and could
    not be sent on), so such a body goes to an engine as is, to get the engine's own 400."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _forwarded(request: Request) -> dict[str, str]:
    return {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}


def _relayed(resp: httpx.Response) -> dict[str, str]:
    return {h: resp.headers[h] for h in _RELAYED_HEADERS if h in resp.headers}


def _copy(resp: httpx.Response) -> Response:
    """A read upstream response, as the client's."""
    return Response(resp.content, status_code=resp.status_code, headers=_relayed(resp))


def _reason(e: httpx.TransportError) -> str:
    """timeout: connected, then silent for --timeout-s; unreachable: no connection, or it broke
    before an answer (as good as none)."""
    if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
        return m.TIMEOUT
    return m.UNREACHABLE


# ---- the app ---------------------------------------------------------------------------------------------
def build_router_app(config: RouterConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    router = Router(config, transport=transport)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await router.start()
            yield
        finally:
            await router.aclose()

    # No OpenAPI document: the bodies are the engines' (their /openapi.json describes them).
    app = FastAPI(title="kvflow router", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"router error: {type(exc).__name__}: {exc}", "internal_error")

    for path in ROUTED_PATHS:

        async def generate(request: Request, path: str = path) -> Response:
            return await router.generate(request, path)

        app.add_api_route(path, generate, methods=["POST"], include_in_schema=False)

    @app.api_route(RESPONSES_PATH + "/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, response_id: str) -> Response:
        return await router.stored_response(request, response_id)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await router.passthrough(request, "/v1/messages/count_tokens")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await router.passthrough(request, request.url.path)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.passthrough(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.passthrough(request, "/detokenize")

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        router.update_view_gauges()
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve_router(
    config: RouterConfig,
    *,
    on_ready: Callable[[], None] | None = None,
    app: FastAPI | None = None,
    graceful_shutdown_s: float = 5.0,
) -> int:
    """Run the router until Ctrl-C / SIGTERM (uvicorn's handling: in-flight requests get
    `graceful_shutdown_s` to finish). `app`: one `build_router_app(config)` made (with more routes)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit and on_ready is not None:
                on_ready()

    if app is None:
        app = build_router_app(config)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=graceful_shutdown_s,
            lifespan="on",
        )
    )
    server.run()
    return 0 if server.started else 1
