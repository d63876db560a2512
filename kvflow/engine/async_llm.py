"""`AsyncLLM`: an asyncio front over one `LLMEngine` that steps in its own thread (an `EngineThread`,
best the one that built the engine).

Threads and queues:
- The event loop (HTTP handlers) never touches the engine. It puts commands (add, abort, call,
  stop) on one thread-safe FIFO inbox (`queue.SimpleQueue`).
- The engine thread blocks on the inbox while there is no work (no busy loop). While there is
  work it drains the inbox between steps, then runs one `engine.step()`. So an abort lands within
  one engine step, and commands are handled in the order they were sent (an abort sent right
  after an add always finds the request).
- Results go back with `loop.call_soon_threadsafe`: the outcome of an add (a `RequestHandle`, or
  the `ValueError` / overload error `add_request` raised), and once per step the list of outputs,
  which the loop hands to each request's `RequestHandle`. Outputs are cumulative, so a handle keeps
  only the latest one: a slow consumer skips intermediate outputs, never loses text.
- Metrics and the periodic log line are recorded in the engine thread after each step.

If `step()` raises, the engine thread calls `engine.fail_all(...)`, every in-flight request gets
`RequestFailedError`, the front is marked dead (`is_dead`; later adds raise `EngineDeadError`) and
`on_fatal(exc)` is called on the event loop (the server uses it to exit non-zero).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvflow.core.sched import AdmissionRejected
from kvflow.engine.engine_thread import EngineThread
from kvflow.engine.llm_engine import EngineStats, LLMEngine
from kvflow.lora.request import LoRARequest
from kvflow.metrics import EngineMetrics, StatLogger
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger("kvflow")
# How often the idle engine thread looks at KV transfers in flight (fetches landing, releases, leases).
_KV_POLL_S = 0.005


class EngineDeadError(RuntimeError):
    """The engine failed earlier (a step raised) or was shut down: no new requests."""


class EngineOverloadedError(RuntimeError):
    """Admission control: too many requests are waiting, or the scheduling policy predicts the
    request would miss its SLO. `retry_after_s`: when to try again."""

    def __init__(self, message: str, reason: str = "queue_full", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """The engine ended this request with an error (a model step raised)."""


# ---- commands crossing into the engine thread ------------------------------------------------------
@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    add_special_tokens: bool
    arrival_time: float
    future: asyncio.Future
    client: str | None = None
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


@dataclass
class _Stop:
    pass


class RequestHandle:
    """The outputs of one request, consumed with `async for` on the event loop.

    Yields cumulative `RequestOutput`s until the finished one; raises `RequestFailedError` if the
    engine failed the request. `abort()` may be called at any time (idempotent)."""

    def __init__(self, llm: AsyncLLM, request_id: str) -> None:
        self._llm = llm
        self.request_id = request_id
        self._latest: RequestOutput | None = None
        self._event = asyncio.Event()
        self._done = False  # the finished output was delivered to the handle
        self._consumed = False  # ... and to the consumer
        self._abort_sent = False
        self._error: str | None = None
        # Called once with the finished output (the server's tracing; None: nothing to do)
        self.on_finished: Callable[[RequestOutput], None] | None = None

    @property
    def finished(self) -> bool:
        return self._done

    # loop thread, from the engine's outputs
    def _put(self, out: RequestOutput) -> None:
        self._latest = out
        if out.finished:
            self._done = True
            if out.error is not None:
                self._error = out.error
            if self.on_finished is not None:
                self.on_finished(out)
        self._event.set()

    def _fail(self, error: str) -> None:
        self._done = True
        self._error = error
        self._event.set()

    def abort(self) -> None:
        if not self._done and not self._abort_sent:
            self._abort_sent = True
            self._llm._send(_Abort([self.request_id]))

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._consumed:
            raise StopAsyncIteration
        await self._event.wait()
        self._event.clear()
        out, self._latest = self._latest, None
        if self._done:
            self._consumed = True
            if self._error is not None:
                raise RequestFailedError(self._error)
        assert out is not None
        return out


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting_requests: int | None = None,
        metrics: EngineMetrics | None = None,
        log_interval_s: float | None = 5.0,
        on_fatal: Callable[[BaseException], None] | None = None,
        engine_thread: EngineThread | None = None,
    ) -> None:
        """`engine_thread`: the thread that built `engine` (see kvflow.engine.engine_thread: steps
        on another thread than the one that loaded the model run slower); default: a new one."""
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.model_name = engine.model_name
        # The front tokenizes on the event loop; the engine thread detokenizes. A HF fast tokenizer
        # must not be used from two threads at once ("Already borrowed"), so the front has a copy.
        self.tokenizer = _copy_tokenizer(engine.tokenizer)
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.on_fatal = on_fatal
        self._stat_logger = StatLogger(log_interval_s) if log_interval_s else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_thread = engine_thread
        self._loop_done: concurrent.futures.Future | None = None  # the engine loop's run on the thread
        self._dead_error: str | None = None  # loop thread's view
        self._engine_dead = False  # engine thread's view
        self._live: set[str] = set()  # engine thread: ids added and not finished yet
        self._idle: asyncio.Event | None = None
        self._stopped = False

    @classmethod
    def from_config(cls, config, **kwargs: Any) -> AsyncLLM:
        return cls(LLMEngine(config), **kwargs)

    # ---- life cycle (event loop) ------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread, bound to the running event loop."""
        if self._loop_done is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        if self._engine_thread is None:
            self._engine_thread = EngineThread()
        self._loop_done = self._engine_thread.submit(self._engine_loop)

    async def shutdown(self) -> None:
        """Abort whatever is left, stop the engine thread and wait for it."""
        if self._loop_done is None or self._stopped:
            return
        self._stopped = True
        self._send(_Stop())
        await asyncio.wrap_future(self._loop_done)
        for handle in list(self._handles.values()):  # outputs of the final aborts already arrived
            handle._fail("the server shut down")
        self._handles.clear()

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False on timeout."""
        assert self._idle is not None
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ---- requests (event loop) --------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
        client: str | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> RequestHandle:
        """Queue a request in the engine thread and return its handle once the engine took it.

        Raises ValueError (bad input, as `LLMEngine.add_request`), EngineOverloadedError (too many
        waiting) or EngineDeadError. If the caller is cancelled meanwhile, the request is aborted."""
        self._check_alive()
        assert self._loop is not None, "AsyncLLM.start() was not called"
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.structured_outputs is not None:
            await self._compile(params)
        fut = self._loop.create_future()
        self._send(_Add(request_id, prompt, params, add_special_tokens, arrival, fut, client, lora_request, cache_salt))
        return await fut

    async def _compile(self, params: SamplingParams) -> None:
        """Wait for the request's grammar on the event loop (it compiles in the grammar pool),
        so the engine thread finds it compiled; GrammarError (a ValueError) if it cannot be."""
        manager = getattr(self.engine, "structured", None)
        if manager is None:
            raise ValueError("structured outputs need the model's tokenizer; this model has none")
        spec = params.structured_outputs
        fut = manager.submit(spec, ahead=True)
        try:  # shield: a timeout here must not cancel the shared compile
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), manager.compile_timeout_s)
        except TimeoutError:
            manager.compiled(spec, timeout=0)  # raises the timeout's GrammarError

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, add_special_tokens: bool = True
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; leaving the loop early (break, cancellation,
        GeneratorExit) aborts the request."""
        handle = await self.add_request(request_id, prompt, params, add_special_tokens=add_special_tokens)
        try:
            async for out in handle:
                yield out
        finally:
            handle.abort()

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort requests (thread-safe; unknown or finished ids are ignored)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._send(_Abort(ids))

    def abort_all(self) -> None:
        for handle in list(self._handles.values()):
            handle._abort_sent = False
            handle.abort()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` in the engine thread between two steps and return its result."""
        assert self._loop is not None
        fut = self._loop.create_future()
        self._send(_Call(fn, fut))
        return await fut

    async def get_stats(self) -> EngineStats:
        return await self.call(lambda e: e.get_stats())

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead_error}")
        if self._stopped:
            raise EngineDeadError("the engine is shut down")

    def _send(self, cmd: Any) -> None:
        self._inbox.put(cmd)

    # ---- callbacks on the event loop (posted by the engine thread) ---------------------------------
    def _post(self, fn: Callable, *args: Any) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _on_added(self, cmd: _Add, error: BaseException | None) -> None:
        fut = cmd.future
        if error is not None:
            if not fut.done():
                fut.set_exception(error)
            return
        handle = RequestHandle(self, cmd.request_id)
        self._handles[cmd.request_id] = handle
        assert self._idle is not None
        self._idle.clear()
        if fut.done():  # the caller went away while the engine was adding the request
            handle.abort()
        else:
            fut.set_result(handle)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            handle._put(out)
            if out.finished:
                del self._handles[out.request_id]
        if not self._handles and self._idle is not None:
            self._idle.set()

    def _on_call_done(self, fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def _on_dead(self, message: str, exc: BaseException, outputs: list[RequestOutput]) -> None:
        # One callback: the front is dead before any consumer sees its error (so /health agrees).
        self._dead_error = message
        self._on_outputs(outputs)
        for handle in list(self._handles.values()):
            handle._fail(message)
        self._handles.clear()
        if self._idle is not None:
            self._idle.set()
        if self.on_fatal is not None:
            try:
                self.on_fatal(exc)
            except Exception:
                logger.exception("the on_fatal action raised")

    # ---- the engine thread ---------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        engine = self.engine
        while True:
            try:
                busy = not self._engine_dead and engine.scheduler.has_work()
                # KV transfers in flight (a fetch, held blocks): poll for them; idle: sleep until there is work.
                poll = not self._engine_dead and engine.has_pending_kv_transfers()
                cmds = [] if busy else self._wait_inbox(_KV_POLL_S if poll else None)
                while True:
                    try:
                        cmds.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if not self._handle_commands(cmds):
                    self._shutdown_engine()
                    return
                stepped = False
                if not self._engine_dead and (engine.has_unfinished_requests() or poll):
                    if not busy and self._stat_logger is not None:
                        self._stat_logger.reset(engine.get_stats())
                    stepped = self._step()
                self._record_stats(stepped)
            except Exception as e:  # a bug outside step(): treat it like a failed step
                self._fatal(e)

    def _wait_inbox(self, timeout: float | None) -> list[Any]:
        try:
            return [self._inbox.get(timeout=timeout)]
        except queue.Empty:
            return []

    def _handle_commands(self, cmds: list[Any]) -> bool:
        """Returns False on stop."""
        engine = self.engine
        aborts: list[str] = []
        for cmd in cmds:
            if isinstance(cmd, _Add):
                if aborts:  # keep order: aborts sent before this add go first
                    self._abort_now(aborts)
                    aborts = []
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                aborts.extend(cmd.request_ids)
            elif isinstance(cmd, _Call):
                if aborts:
                    self._abort_now(aborts)
                    aborts = []
                try:
                    result, error = cmd.fn(engine), None
                except Exception as e:
                    result, error = None, e
                self._post(self._on_call_done, cmd.future, result, error)
            elif isinstance(cmd, _Stop):
                self._abort_now(aborts + sorted(self._live))
                return False
        if aborts:
            self._abort_now(aborts)
        return True

    def _add(self, cmd: _Add) -> None:
        error: BaseException | None = None
        try:
            if self._engine_dead:
                raise EngineDeadError("the engine is dead")
            limit = self.max_waiting_requests
            if limit is not None:
                if cmd.params.n > limit:
                    raise ValueError(f"n ({cmd.params.n}) exceeds the server's max_waiting_requests ({limit})")
                waiting = self.engine.scheduler.num_waiting
                if waiting + cmd.params.n > limit:
                    if self.metrics is not None:
                        self.metrics.record_rejected()
                    raise EngineOverloadedError(
                        f"the server is overloaded: {waiting} requests are waiting (max_waiting_requests="
                        f"{limit}); retry later"
                    )
            try:
                self.engine.add_request(
                    cmd.request_id,
                    cmd.prompt,
                    cmd.params,
                    arrival_time=cmd.arrival_time,
                    add_special_tokens=cmd.add_special_tokens,
                    client=cmd.client,
                    lora_request=cmd.lora_request,
                    cache_salt=cmd.cache_salt,
                )
            except AdmissionRejected as e:
                if self.metrics is not None:
                    self.metrics.record_rejected(e.reason)
                raise EngineOverloadedError(str(e), e.reason, e.retry_after_s) from None
            self._live.add(cmd.request_id)
        except Exception as e:
            error = e
        self._post(self._on_added, cmd, error)

    def _abort_now(self, request_ids: list[str]) -> None:
        ids = [r for r in dict.fromkeys(request_ids) if r in self._live]
        if not ids or self._engine_dead:
            return
        outputs = self.engine.abort(ids)
        self._deliver(outputs)

    def _step(self) -> bool:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._fatal(e)
            return False
        self._deliver(outputs)
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        if self.metrics is not None:
            self.metrics.record_outputs(outputs)
        self._post(self._on_outputs, outputs)

    def _record_stats(self, stepped: bool) -> None:
        if self.metrics is None and (self._stat_logger is None or not stepped):
            return
        stats = self.engine.get_stats()
        if self.metrics is not None:
            self.metrics.record_stats(stats)
            structured = getattr(self.engine, "structured", None)
            if structured is not None and getattr(stats, "structured_output", None) is not None:
                self.metrics.record_structured(stats.structured_output, structured.take_timings())
            if getattr(stats, "kv_transfer", None) is not None:
                self.metrics.record_kv_transfer(stats.kv_transfer, self.engine.take_kv_transfer_times())
        if stepped and self._stat_logger is not None:
            self._stat_logger.maybe_log(stats)

    def _shutdown_engine(self) -> None:
        self._record_stats(False)
        shutdown = getattr(self.engine, "shutdown", None)  # e.g. persist the prefix cache
        if shutdown is not None and not self._engine_dead:
            try:
                shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _fatal(self, exc: BaseException) -> None:
        if self._engine_dead:
            logger.exception("engine thread error after the engine failed", exc_info=exc)
            return
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        logger.error("%s; failing every in-flight request", message, exc_info=exc)
        self._engine_dead = True
        try:
            outputs = self.engine.fail_all(message)
        except Exception:
            logger.exception("fail_all raised")
            outputs = []
        self._live.clear()
        if self.metrics is not None:
            try:
                self.metrics.record_outputs(outputs)
            except Exception:
                logger.exception("recording metrics raised")
        self._post(self._on_dead, message, exc, outputs)


def _copy_tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # pragma: no cover - every tokenizer we load can be copied
        logger.warning("could not copy the tokenizer; the server and the engine thread share one")
        return tokenizer
