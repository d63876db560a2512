"""Async benchmark client for any OpenAI-compatible server (`/v1/completions` or `/v1/chat/completions`).

Each request streams (`stream: true`, `stream_options.include_usage`), with `max_tokens` = the
request's output_len and, by default, vLLM's `ignore_eos: true` so outputs have the asked length.
Times are taken on the client with `time.perf_counter`: TTFT at the first non-empty content chunk,
every later content chunk appended to `chunk_times` (ITL = their gaps, TTFT excluded).

Arrivals: Poisson at `request_rate` (exponential gaps), gamma gaps with shape `burstiness` and mean
1/rate (burstiness 1 = Poisson, < 1 burstier, > 1 smoother), or rate = inf (all at once).
`max_concurrency` caps requests in flight. Everything is seeded.

Output tokens come from the server's `usage.completion_tokens` when present, else from the
tokenizer on the streamed text, else the number of content chunks. A failed request (HTTP error,
error event, broken stream, timeout) is recorded with its error text; the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvflow.bench.datasets import BenchRequest, decode, encode
from kvflow.bench.metrics import SLO, BenchmarkMetrics, RequestRecord, compute_metrics


@dataclass
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # or "chat"
    model: str | None = None  # None: first id from /v1/models
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout: float = 3600.0
    disable_tqdm: bool = False
    api_key: str | None = None
    slo: SLO = field(default_factory=SLO)
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout > 0:
            raise ValueError("request timeout must be > 0 s")

    @property
    def url(self) -> str:
        path = "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"
        return _api_root(self.base_url) + path


@dataclass
class RunResult:
    """One benchmark run (one request rate)."""

    request_rate: float
    burstiness: float
    max_concurrency: int | None
    model: str
    duration_s: float
    records: list[RequestRecord]
    metrics: BenchmarkMetrics

    def to_dict(self, with_records: bool = True) -> dict:
        d = {
            "request_rate": _json_float(self.request_rate),
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "model": self.model,
            "duration_s": self.duration_s,
            "metrics": self.metrics.to_dict(),
        }
        if with_records:
            d["requests"] = [r.to_dict() for r in self.records]
        return d


def _json_float(x: float) -> float | str:
    return "inf" if x == math.inf else x


def _api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


# ----------------------------------------------------------------------------------------------
# Arrivals
# ----------------------------------------------------------------------------------------------


def arrival_gaps(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0):
    """n gaps in seconds before each request (the first one included).

    rate = inf → all zeros. burstiness = 1 → exponential (Poisson process). Otherwise gamma with
    shape = burstiness and scale = 1 / (rate × burstiness), so the mean gap is always 1 / rate.
    """
    import numpy as np

    if n < 0:
        raise ValueError("n must be >= 0")
    if request_rate == math.inf:
        return np.zeros(n)
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    if burstiness == 1.0:
        return rng.exponential(1.0 / request_rate, size=n)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0):
    """Cumulative arrival offsets in seconds from the start of the run."""
    import numpy as np

    return np.cumsum(arrival_gaps(n, request_rate, burstiness, seed))


def parse_rates(spec: str) -> list[float]:
    """'1,2,4,inf' → [1.0, 2.0, 4.0, inf]."""
    rates = []
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"bad request rate {part!r}: expected a number or inf") from None
        if not r > 0:
            raise ValueError(f"request rates must be > 0, got {part}")
        rates.append(r)
    if not rates:
        raise ValueError("no request rates given")
    return rates


# ----------------------------------------------------------------------------------------------
# One request
# ----------------------------------------------------------------------------------------------


def build_payload(req: BenchRequest, cfg: ServeConfig, model: str, tokenizer: Any = None) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": int(req.output_len),
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "completions":
        body["prompt"] = req.prompt
    else:
        text = req.prompt
        if not isinstance(text, str):
            if tokenizer is None:
                raise ValueError("the chat endpoint needs text prompts (token-id prompts need a tokenizer)")
            text = decode(tokenizer, text)
        body["messages"] = [{"role": "user", "content": text}]
    body.update(cfg.extra_body)
    body.update(req.extra_body)  # the request's own extras (priority, SLOs, user) beat the run-wide ones
    return body


def request_slo(req: BenchRequest) -> SLO | None:
    """The SLO a request asks the server for in its body (ttft_slo_ms / tpot_slo_ms), None if it asks none.

    Read from the body extras, so a request is judged on exactly what it sent.
    """
    ttft_ms, tpot_ms = req.extra_body.get("ttft_slo_ms"), req.extra_body.get("tpot_slo_ms")
    if ttft_ms is None and tpot_ms is None:
        return None
    return SLO(ttft_ms=ttft_ms, tpot_ms=tpot_ms)


def new_record(i: int, req: BenchRequest, rate: float) -> RequestRecord:
    """The empty record of request `i`, with what the workload says about it."""
    user = req.extra_body.get("user")
    return RequestRecord(
        request_id=i,
        prompt_len=req.prompt_len,
        expected_output_len=req.output_len,
        rate=rate,
        request_class=req.request_class,
        user=str(user) if user is not None else None,
        slo=request_slo(req),
    )


def _content_of(event: dict, endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    ch = choices[0] or {}
    if endpoint == "completions":
        return ch.get("text") or ""
    delta = ch.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


async def send_request(
    client: Any,
    cfg: ServeConfig,
    req: BenchRequest,
    rec: RequestRecord,
    model: str,
    tokenizer: Any = None,
    headers: dict | None = None,
) -> RequestRecord:
    """Stream one request and fill `rec` in place. Never raises (except cancellation)."""
    text_parts: list[str] = []
    usage_out: int | None = None
    try:
        payload = build_payload(req, cfg, model, tokenizer)
        rec.send_time = time.perf_counter()
        async with client.stream("POST", cfg.url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.end_time = time.perf_counter()
                rec.error = f"HTTP {resp.status_code}: {body.strip()[:1000]}"
                return rec
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":"):
                    continue
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    rec.error = f"bad stream event: {data[:200]}"
                    rec.end_time = now
                    return rec
                if isinstance(event, dict) and event.get("error"):
                    err = event["error"]
                    rec.error = "stream error: " + (json.dumps(err) if not isinstance(err, str) else err)[:1000]
                    rec.end_time = now
                    return rec
                usage = event.get("usage") if isinstance(event, dict) else None
                if usage:
                    if usage.get("completion_tokens") is not None:
                        usage_out = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_len = int(usage["prompt_tokens"])
                content = _content_of(event, cfg.endpoint) if isinstance(event, dict) else ""
                if content:
                    if rec.first_token_time is None:
                        rec.first_token_time = now
                    rec.chunk_times.append(now)
                    text_parts.append(content)
        rec.end_time = time.perf_counter()
        rec.generated_text = "".join(text_parts)
        if usage_out is not None:
            rec.output_tokens = usage_out
        elif tokenizer is not None:
            rec.output_tokens = len(encode(tokenizer, rec.generated_text))
        else:
            rec.output_tokens = len(rec.chunk_times)
        # Tokens that detokenize to nothing (special tokens) stream no content: the request still
        # succeeded, but it has no TTFT, ITL or TPOT (metrics skip it there).
        rec.success = True
    except asyncio.CancelledError:
        raise
    except Exception as e:
        rec.end_time = time.perf_counter()
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        rec.generated_text = "".join(text_parts)
    return rec


# ----------------------------------------------------------------------------------------------
# A run
# ----------------------------------------------------------------------------------------------


def _make_client(cfg: ServeConfig, n_requests: int):
    import httpx

    conns = max(1, min(n_requests, cfg.max_concurrency or n_requests, 1024))
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(cfg.request_timeout, connect=min(60.0, cfg.request_timeout))
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def _headers(cfg: ServeConfig) -> dict:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def fetch_model_id(client: Any, base_url: str, headers: dict | None = None) -> str:
    """The first model id listed by GET /v1/models."""
    url = _api_root(base_url) + "/v1/models"
    try:
        resp = await client.get(url, headers=headers)
    except Exception as e:
        raise ValueError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise ValueError(f"GET {url} returned HTTP {resp.status_code}; pass --model")
    try:
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"GET {url} listed no model; pass --model") from None


async def run_benchmark_async(
    requests: Sequence[BenchRequest], cfg: ServeConfig, tokenizer: Any = None, client: Any = None
) -> RunResult:
    """Send `requests` on the arrival schedule of `cfg`; return records and metrics."""
    own_client = client is None
    if own_client:
        client = _make_client(cfg, len(requests))
    headers = _headers(cfg)
    try:
        model = cfg.model or await fetch_model_id(client, cfg.base_url, headers)
        offsets = arrival_times(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        pbar = None
        if not cfg.disable_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(requests), desc=f"rate {cfg.request_rate:g} req/s", unit="req")

        records = [new_record(i, r, cfg.request_rate) for i, r in enumerate(requests)]

        async def one(i: int) -> None:
            rec = records[i]
            rec.arrival_time = time.perf_counter()
            if sem is None:
                await send_request(client, cfg, requests[i], rec, model, tokenizer, headers)
            else:
                async with sem:
                    await send_request(client, cfg, requests[i], rec, model, tokenizer, headers)
            if pbar is not None:
                pbar.update(1)

        start = time.perf_counter()
        tasks = []
        for i, off in enumerate(offsets):
            delay = start + float(off) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        ends = [r.end_time for r in records if r.end_time is not None]
        duration = (max(ends) if ends else time.perf_counter()) - start
        if pbar is not None:
            pbar.close()
    finally:
        if own_client:
            await client.aclose()
    metrics = compute_metrics(records, duration, cfg.slo, cfg.percentiles)
    return RunResult(cfg.request_rate, cfg.burstiness, cfg.max_concurrency, model, duration, records, metrics)


def run_benchmark(requests: Sequence[BenchRequest], cfg: ServeConfig, tokenizer: Any = None) -> RunResult:
    return asyncio.run(run_benchmark_async(requests, cfg, tokenizer))


async def run_sweep_async(
    requests: Sequence[BenchRequest], cfg: ServeConfig, rates: Sequence[float], tokenizer: Any = None
) -> list[RunResult]:
    """One run per rate, in order, same requests and seed each time (one shared HTTP client)."""
    from dataclasses import replace

    results = []
    client = _make_client(cfg, len(requests))
    try:
        model = cfg.model or await fetch_model_id(client, cfg.base_url, _headers(cfg))
        for rate in rates:
            run_cfg = replace(cfg, request_rate=rate, model=model)
            results.append(await run_benchmark_async(requests, run_cfg, tokenizer, client))
    finally:
        await client.aclose()
    return results


def run_sweep(
    requests: Sequence[BenchRequest], cfg: ServeConfig, rates: Sequence[float], tokenizer: Any = None
) -> list[RunResult]:
    return asyncio.run(run_sweep_async(requests, cfg, rates, tokenizer))


def config_dict(cfg: ServeConfig) -> dict:
    d = asdict(cfg)
    d["request_rate"] = _json_float(cfg.request_rate)
    d.pop("api_key", None)
    return d
