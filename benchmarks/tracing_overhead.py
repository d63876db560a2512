"""What OpenTelemetry tracing (--otlp-traces-endpoint) costs a server: output tok/s with `--batch`
concurrent completions on the default model, tracing off vs on (spans posted to a local OTLP/HTTP
receiver that decodes and counts them), and a second tracing-off server as the noise floor (what two
identical servers differ by here), three servers side by side in this process, rounds interleaved
(the order rotating), medians printed.

    python benchmarks/tracing_overhead.py [--batch 32] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import threading
import time

from starlette.requests import Request
from starlette.responses import Response

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# "off2": a second server with tracing off, to show the spread between two identical servers.
MODES = ("off", "on", "off2")


class _Server:
    """An ASGI app on uvicorn in a daemon thread, on a free 127.0.0.1 port."""

    def __init__(self, app) -> None:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
        threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True


def _receiver() -> tuple[_Server, list[int]]:
    from fastapi import FastAPI
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = [0]
    app = FastAPI()

    @app.post("/v1/traces")
    async def traces(request: Request) -> Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.body())
        spans[0] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        return Response(b"", media_type="application/x-protobuf")

    return _Server(app), spans


async def _load(url: str, batch: int, max_tokens: int, prompt: str) -> float:
    """Output tok/s of `batch` completions sent at once."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(batch)))
        dt = time.perf_counter() - t0
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200][:1]
    return sum(a.json()["usage"]["completion_tokens"] for a in answers) / dt


def main() -> int:
    from kvflow.bench.report import cpu_line
    from kvflow.config import EngineConfig, ServerConfig
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints.openai.api_server import build_app

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(cpu_line())
    receiver, spans = _receiver()
    servers = {
        mode: _Server(
            build_app(
                LLMEngine(EngineConfig()),
                ServerConfig(log_interval_s=600, otlp_traces_endpoint=receiver.url if mode == "on" else None),
            )
        )
        for mode in MODES
    }
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3
    for server in servers.values():  # warm-up: kernels chosen, pools touched
        asyncio.run(_load(server.url, args.batch, 8, prompt))
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            results[mode].append(asyncio.run(_load(servers[mode].url, args.batch, args.max_tokens, prompt)))
            print(f"round {r + 1} tracing {mode}: {results[mode][-1]:.1f} output tok/s", flush=True)
    time.sleep(1.5)  # the last batch of spans goes out
    off, on, off2 = (statistics.median(results[m]) for m in MODES)
    print(
        f"batch {args.batch}, {args.max_tokens} tokens each, median of {args.rounds}: tracing off {off:.1f}, "
        f"off (second server) {off2:.1f}, on {on:.1f} output tok/s (on/off {on / off:.3f}, noise floor "
        f"off2/off {off2 / off:.3f}); spans received: {spans[0]}"
    )
    for s in (*servers.values(), receiver):
        s.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
