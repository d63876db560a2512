"""`EngineThread`: the one thread that does a server's engine work, from loading the model to
the last step.

Why one thread: libgomp (the OpenMP runtime under torch and the native kernels) keeps a pool of
worker threads for each thread that has started a parallel region. Once two threads of a process
have (the model loaded and warmed up on the main thread, then stepped on another), it manages more
threads than there are CPUs and its workers stop spinning between regions, so every parallel region
waits for its workers to wake up. Built and stepped on this thread, an engine never has a second
pool (the server's main thread only runs the event loop). What this is worth is measured by
benchmarks/serve_peers.py (served) against benchmarks/serve_replay.py (the same requests offline);
figures: docs/benchmarks/results/.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread running the callables given to it, one after another, in order."""

    def __init__(self, name: str = "kvflow-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future:
        """Run fn() on the thread after what was submitted before; its Future."""
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn() on the thread and wait for its result (its exception is raised here)."""
        return self.submit(fn).result()

    def _run(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result: Any = fn()
            except BaseException as e:  # handed to the caller, whatever it is
                future.set_exception(e)
            else:
                future.set_result(result)
