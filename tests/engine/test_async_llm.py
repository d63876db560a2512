"""AsyncLLM without HTTP: outputs, validation errors, aborts on cancellation, idle sleep, faults."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvflow.config import EngineConfig
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, RequestFailedError
from kvflow.engine.llm_engine import LLMEngine
from kvflow.metrics import EngineMetrics
from kvflow.sampling_params import SamplingParams

from conftest import assert_no_leaks


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama[0], num_kv_blocks=64))


def run(llm: AsyncLLM, coro_fn):
    async def main():
        llm.start()
        try:
            return await coro_fn()
        finally:
            await llm.shutdown()

    return asyncio.run(main())


def test_generate_matches_offline(engine):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("ref", "The quick brown fox", params)
    ref = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ref = out
    llm = AsyncLLM(engine)

    async def go():
        outs = [o async for o in llm.generate("The quick brown fox", params, "a")]
        both = await asyncio.gather(*(collect(llm.generate("The quick brown fox", params, f"b{i}")) for i in range(4)))
        return outs, both

    outs, both = run(llm, go)
    assert outs[-1].finished and outs[-1].outputs[0].text == ref.outputs[0].text
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    assert all(b[-1].outputs[0].token_ids == ref.outputs[0].token_ids for b in both)
    assert_no_leaks(engine)


async def collect(agen):
    return [o async for o in agen]


def test_validation_errors_are_value_errors(engine):
    llm = AsyncLLM(engine)

    async def go():
        with pytest.raises(ValueError, match="max_model_len"):
            await llm.add_request("x", [5] * 600, SamplingParams())
        with pytest.raises(ValueError, match="already in use"):
            h = await llm.add_request("dup", "hi", SamplingParams(max_tokens=50, ignore_eos=True))
            await llm.add_request("dup", "hi", SamplingParams())
        h.abort()
        async for _ in h:
            pass
        return await llm.call(lambda e: e.has_unfinished_requests())

    assert run(llm, go) is False
    assert_no_leaks(engine)


def test_cancel_aborts_within_a_step(engine):
    llm = AsyncLLM(engine)
    steps_after_cancel = []

    async def go():
        params = SamplingParams(max_tokens=400, ignore_eos=True)

        async def consume():
            async for _ in llm.generate("hi", params, "long"):
                pass

        start = (await llm.get_stats()).num_steps
        task = asyncio.create_task(consume())
        while (await llm.get_stats()).num_steps < start + 3:
            await asyncio.sleep(0.005)
        before = (await llm.get_stats()).num_steps
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await llm.wait_idle(5)
        steps_after_cancel.append((await llm.get_stats()).num_steps - before)
        # an abort racing the add still finds the request (one FIFO queue)
        fut = asyncio.ensure_future(llm.add_request("raced", "hi", params))
        await asyncio.sleep(0)
        fut.cancel()
        await asyncio.sleep(0.05)
        assert await llm.wait_idle(5)
        return await llm.call(lambda e: e.has_unfinished_requests())

    assert run(llm, go) is False
    assert steps_after_cancel[0] <= 2  # the step in progress, at most one more
    assert_no_leaks(engine)


def test_idle_engine_thread_sleeps(engine):
    llm = AsyncLLM(engine)

    async def go():
        await llm.get_stats()  # the thread is up
        t0 = time.process_time()
        await asyncio.sleep(0.5)
        return time.process_time() - t0

    assert run(llm, go) < 0.1  # no busy loop


def test_admission_and_fault(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama[0], num_kv_blocks=64, max_num_seqs=1))
    fatal = []
    metrics = EngineMetrics()
    llm = AsyncLLM(engine, max_waiting_requests=1, metrics=metrics, on_fatal=fatal.append)

    async def go():
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        results = await asyncio.gather(
            *(llm.add_request(f"r{i}", "hi", params) for i in range(4)), return_exceptions=True
        )
        handles = [r for r in results if not isinstance(r, BaseException)]
        assert len(handles) == 1 and all(isinstance(r, EngineOverloadedError) for r in results if r not in handles)
        first = await handles[0].__anext__()  # running now
        assert first.outputs[0].token_ids
        h2 = await llm.add_request("r9", "hi", params)  # one may wait

        def boom(*_):
            raise RuntimeError("kaput")

        engine.runner.execute = boom
        for h in (handles[0], h2):
            with pytest.raises(RequestFailedError, match="kaput"):
                async for _ in h:
                    pass
        assert llm.is_dead
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", "hi", params)

    run(llm, go)
    assert len(fatal) == 1 and "kaput" in str(fatal[0])
    assert metrics.rejected.labels(reason="queue_full")._value.get() == 3


def test_engine_thread_builds_and_steps_the_engine(tiny_llama):
    """kvflow serve builds the engine on an EngineThread and AsyncLLM steps it there: one thread for
    all of the engine's work (a second OpenMP pool slows every parallel region down)."""
    import threading

    from kvflow.engine.engine_thread import EngineThread

    thread = EngineThread()
    seen: list[str] = []

    def build():
        seen.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(model=tiny_llama[0], num_kv_blocks=64))

    engine = thread.call(build)
    step = engine.step

    def recording_step():
        seen.append(threading.current_thread().name)
        return step()

    engine.step = recording_step
    llm = AsyncLLM(engine, engine_thread=thread)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = run(llm, lambda: collect(llm.generate("The quick brown fox", params, "a")))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert len(seen) > 1 and set(seen) == {"kvflow-engine"}
    with pytest.raises(ZeroDivisionError):  # a failure reaches the caller; the thread goes on
        thread.call(lambda: 1 / 0)
    assert thread.call(lambda: threading.current_thread().name) == "kvflow-engine"
    assert_no_leaks(engine)
