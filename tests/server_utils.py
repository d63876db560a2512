"""An in-process kvflow server for tests: uvicorn in a thread on a free 127.0.0.1 port."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from kvflow.utils.prometheus import parse_prometheus


class LiveServer:
    def __init__(self, engine_config, server_config=None) -> None:
        import uvicorn

        from kvflow.config import ServerConfig
        from kvflow.engine.llm_engine import LLMEngine
        from kvflow.entrypoints.openai.api_server import build_app

        self.engine = LLMEngine(engine_config)
        self.exit_codes: list[int] = []
        self.app = build_app(self.engine, server_config or ServerConfig(), exit_action=self.exit_codes.append)
        self.state = self.app.state.kvflow
        self.llm = self.state.llm
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=2)
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 20, "the server did not start")
        self.model = self.state.served_model_name

    # ---- helpers ---------------------------------------------------------------------------------
    def run(self, coro, timeout: float = 30) -> Any:
        """Run a coroutine on the server's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.llm._loop).result(timeout)

    def call(self, fn: Callable, timeout: float = 30) -> Any:
        """fn(engine) in the engine thread (between steps)."""
        return self.run(self.llm.call(fn), timeout)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics").text)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kwargs)

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kwargs)

    def wait_engine_idle(self, timeout: float = 10) -> None:
        """No request left in the engine and every KV block free (polled, not slept)."""

        def idle() -> bool:
            return self.call(
                lambda e: (
                    not e.has_unfinished_requests() and e.kv_cache.pool.num_free_blocks == e.kv_cache.pool.num_blocks
                )
            )

        wait_for(idle, timeout, "the engine still holds requests or blocks")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "the server thread did not stop"


class ThreadServer:
    """An ASGI app on uvicorn in a daemon thread, on a free 127.0.0.1 port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=1)
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 10, "a test server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "a test server thread did not stop"


def post(server, path: str, body: dict) -> httpx.Response:
    """POST a JSON body to a running server (a LiveServer or anything with `url`)."""
    return httpx.post(server.url + path, json=body, timeout=60)


def post_ok(server, path: str, body: dict) -> dict:
    """`post`, asserting a 200, and its JSON."""
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(cond: Callable[[], bool], timeout: float, message: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} (after {timeout} s)")
        time.sleep(interval)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{label="value",...}': value}, the keys written as the exposition
    writes them (labels in their order, values escaped), so a test indexes by the line it expects.
    The parsing is kvflow.utils.prometheus's."""
    return {_sample_key(name, labels): value for name, labels, value in parse_prometheus(text)}


def _sample_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    escaped = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, escaped)) + "}"


def descendants(pid: int) -> set[int]:
    """Every live descendant of process `pid` (children, theirs, ...), read from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
