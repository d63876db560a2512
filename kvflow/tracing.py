"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag): one span per request in each process
it crosses -- the router (a server span, with a client span per engine it calls), the prefill engine,
the decode engine (with a `kv_transfer` child span: its fetch of the prompt's KV) -- under one trace
id: the client's W3C `traceparent` is honoured, and the router passes its own on to the engines.

An engine's span is made when its request finishes, from what the engine already keeps: the
request's timestamps (arrival, first scheduled, first token, finished) and its step records
(kvflow.engine.step_records: each prefill chunk and preemption it lived through),
as span events with token counts. Nothing is done per token or per step for tracing, and with the
flag off the `opentelemetry` packages are not even imported.

Spans go out over OTLP/HTTP (protobuf) in batches from a background thread
(`BatchSpanProcessor`); `Tracer.shutdown()` flushes them.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.outputs import RequestOutput

# W3C trace context headers: what a caller's span passes to its callee.
TRACE_HEADERS = ("traceparent", "tracestate")
# The trace context of the HTTP request being served (set by the server's middleware), read where the
# request reaches the engine: no parameter threads it through the endpoints.
INCOMING_TRACE: ContextVar[dict[str, str] | None] = ContextVar("kvflow_incoming_trace", default=None)
MAX_STEP_EVENTS = 64  # prefill chunks / preemptions listed as events per span (the latest ones)


def trace_carrier(headers: dict[str, str]) -> dict[str, str]:
    """The W3C trace context among (lower-cased) HTTP headers."""
    return {h: headers[h] for h in TRACE_HEADERS if h in headers}


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint as users write it (`http://collector:4318`, or with its path) -> the
    traces URL the exporter posts to."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def _epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() timestamp on the wall clock, in ns (what OTLP carries)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Tracer:
    """Spans of one service (`service_name`: kvflow-router, kvflow-engine, ...) to an OTLP endpoint,
    or to `exporter` (tests: an in-memory exporter)."""

    def __init__(self, service_name: str, endpoint: str | None = None, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            if not endpoint:
                raise ValueError("--otlp-traces-endpoint needs a URL, e.g. http://127.0.0.1:4318")
            exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("kvflow")
        self.propagator = TraceContextTextMapPropagator()
        self.SERVER, self.CLIENT, self.INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL

    # ---- context ---------------------------------------------------------------------------------
    def context_of(self, carrier: dict[str, str] | None):
        """The parent context a carrier (W3C headers) names; an empty one starts a new trace."""
        return self.propagator.extract(carrier or {})

    def headers_for(self, span) -> dict[str, str]:
        """The headers that make `span` the parent of the callee's span."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def start(self, name: str, parent: Any = None, kind: Any = None, start_ns: int | None = None, **attrs: Any):
        """A span (end it with `.end()`); `parent`: a context (context_of) or a span."""
        from opentelemetry import trace

        if parent is not None and not isinstance(parent, dict) and hasattr(parent, "get_span_context"):
            parent = trace.set_span_in_context(parent)
        return self.tracer.start_span(
            name,
            context=parent,
            kind=kind if kind is not None else self.INTERNAL,
            start_time=start_ns,
            attributes={k: v for k, v in attrs.items() if v is not None},
        )

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what is batched

    # ---- an engine request ---------------------------------------------------------------------------
    def record_request(
        self, out: RequestOutput, carrier: dict[str, str] | None, steps: dict | None, service_role: str
    ) -> None:
        """The span of a finished engine request, from its output's timestamps and (when still in
        the ring) its step records `steps` (StepRecords.explain's answer)."""
        m = out.metrics
        end_ns = _epoch_ns(m.finished_time) if m.finished_time is not None else time.time_ns()
        n_out = sum(len(c.token_ids) for c in out.outputs)
        span = self.start(
            "kvflow.request",
            self.context_of(carrier),
            self.SERVER,
            _epoch_ns(m.arrival_time),
            **{
                "gen_ai.request.id": out.request_id,
                "gen_ai.usage.prompt_tokens": len(out.prompt_token_ids),
                "gen_ai.usage.completion_tokens": n_out,
                "gen_ai.request.n": len(out.outputs),
                "kvflow.role": service_role,
                "kvflow.num_cached_tokens": out.num_cached_tokens,
                "kvflow.finish_reasons": ",".join(str(c.finish_reason) for c in out.outputs),
                "kvflow.error": out.error,
                "gen_ai.latency.time_in_queue": _delta(m.arrival_time, m.first_scheduled_time),
                "gen_ai.latency.time_to_first_token": _delta(m.arrival_time, m.first_token_time),
                "gen_ai.latency.e2e": _delta(m.arrival_time, m.finished_time),
            },
        )
        if m.first_scheduled_time is not None:
            span.add_event("scheduled", timestamp=_epoch_ns(m.first_scheduled_time))
        if m.first_token_time is not None:
            span.add_event("first_token", timestamp=_epoch_ns(m.first_token_time))
        if m.kv_load_times is not None:  # a P/D consumer's fetch of the prompt's KV
            start, end = m.kv_load_times
            child = self.start("kv_transfer", span, self.CLIENT, _epoch_ns(start), **{"kvflow.ok": end is not None})
            child.end(end_time=_epoch_ns(end if end is not None else start))
        if steps is not None:
            self._step_events(span, steps)
        if out.error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, out.error[:200]))
        span.end(end_time=end_ns)

    def _step_events(self, span, steps: dict) -> None:
        """Prefill chunks and preemptions of each of the request's sequences."""
        for seq in steps.get("sequences", ()):
            pre = seq["before_first_token"]
            span.set_attribute("kvflow.steps_before_first_token", pre["steps"])
            span.set_attribute("kvflow.excess_before_first_token_s", pre["excess_s"])
            for v in pre["step_list"][-MAX_STEP_EVENTS:]:
                own = v["own"]
                if own is not None and own["kind"] in ("prefill", "recompute"):
                    span.add_event(
                        f"{own['kind']}_chunk",
                        timestamp=int(v["time"] * 1e9),
                        attributes={
                            "kvflow.seq": seq["id"],
                            "kvflow.tokens": own["tokens"],
                            "kvflow.start_pos": own["start_pos"],
                            "kvflow.step_tokens": sum(v["tokens"].values()),
                            "kvflow.step_duration_s": v["duration_s"],
                        },
                    )
            post = seq["between_tokens"]
            for step in (*pre["preemptions"], *post["preemptions"]):
                span.add_event("preempted", attributes={"kvflow.seq": seq["id"], "kvflow.step": step})
            span.set_attribute("kvflow.decode_steps", post["steps_scheduled"])


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a
