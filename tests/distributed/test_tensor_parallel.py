"""Tensor parallelism (mp executor, gloo on CPU): TP = 2 gives TP = 1's greedy tokens and logprobs,
through chunked prefill, prefix caching and preemption; a rank that dies ends the engine with an
error naming it, and no worker process outlives the engine."""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import threading
import time

import pytest

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks, assert_same_completions

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def _prompts(n: int = 5) -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(2, 500) for _ in range(10)]
    return [shared + [rng.randrange(2, 500) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _run(path: str, tp: int, **opts):
    llm = LLM(path, max_model_len=64, block_size=4, tensor_parallel_size=tp, **opts)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        assert_no_leaks(llm.engine)
        workers = llm.engine.executor.workers
        return [o.outputs[0] for o in outs], llm.get_stats(), None if workers is None else workers.all_reduce
    finally:
        llm.shutdown()


def _faster_all_reduce(caplog) -> set[str]:
    """What rank 0 measured when it chose the all-reduce (its log line): the faster of the two, or
    both when they tie at the logged precision."""
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("tensor parallel all-reduce"))
    gloo, shm = (float(x) for x in re.search(r"gloo ([\d.]+) ms, shared memory ([\d.]+) ms", line).groups())
    return {"gloo", "shm"} if gloo == shm else {"shm" if shm < gloo else "gloo"}


@pytest.mark.parametrize(
    "arch,all_reduce,budget,blocks", [("llama", "shm", 8, 16), ("llama", "gloo", 16, 24), ("qwen2", "auto", 16, 24)]
)
def test_tp2_equals_tp1(model_factory, monkeypatch, caplog, arch, all_reduce, budget, blocks):
    monkeypatch.setenv("KVFLOW_TP_ALL_REDUCE", all_reduce)  # the workers inherit it
    caplog.set_level(logging.INFO, logger="kvflow")
    path = model_factory(arch)[0]
    # A small batch budget (chunked prefill; 8 tokens: shared-memory slots smaller than the
    # all-reduce's 32-row timing sample) and a small pool (preemption), prefix caching on.
    opts = dict(max_num_batched_tokens=budget, num_kv_blocks=blocks)
    ref, _, _ = _run(path, 1, **opts)
    got, stats, used = _run(path, 2, **opts)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert used == all_reduce if all_reduce != "auto" else used in _faster_all_reduce(caplog)
    assert_same_completions(got, ref, abs_tol=1e-4)


def test_tp2_with_a_draft_model_equals_tp1(model_factory):
    """Draft-model speculation under TP: the draft runs whole on rank 0, the target verifies the
    drafts split over both ranks; greedy output is TP = 1's without speculation."""
    path = model_factory("llama")[0]
    small = model_factory("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64)[0]
    spec = {"method": "draft_model", "model": small, "num_speculative_tokens": 3, "adaptive": False}
    ref, _, _ = _run(path, 1, num_kv_blocks=64)
    llm = LLM(path, max_model_len=64, block_size=4, tensor_parallel_size=2, num_kv_blocks=64, speculative_config=spec)
    try:
        got = [o.outputs[0] for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]
        assert llm.engine.speculator.stats.num_draft_tokens > 10
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
    assert_same_completions(got, ref, abs_tol=1e-4)


def _first_logprobs(outs) -> list[dict[int, float]]:
    """Each completion's top logprobs at its first position (conditioned on the prompt alone)."""
    return [{t: lp.logprob for t, lp in o.logprobs[0].items()} for o in outs]


def _max_diff(a, b) -> float:
    return max(abs(x[t] - y[t]) for x, y in zip(a, b) for t in y if t in x)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied lm_head; tied (the smoothed copy is sliced)
def test_tp2_int8_as_close_to_float_as_tp1_int8(model_factory, arch):
    """int8 under TP: every rank quantizes its shard after one collective calibration pass (the same
    token ids on every rank, o / down all-reduced in it); its logprobs are as far from the float
    model's as one rank's int8 are (not identical to them: each rank quantizes only its shard's
    activations and weight columns), through chunked prefill, prefix hits and preemption."""
    path = model_factory(arch)[0]
    opts = dict(max_num_batched_tokens=16, num_kv_blocks=24)
    ref = _first_logprobs(_run(path, 1, **opts)[0])
    one = _max_diff(_first_logprobs(_run(path, 1, quantization="int8", **opts)[0]), ref)
    got, stats, _ = _run(path, 2, quantization="int8", **opts)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    two = _max_diff(_first_logprobs(got), ref)
    assert one < 0.3 and two < max(2 * one, 0.1), (one, two)


@pytest.mark.parametrize("when", ["between steps", "mid-run"])
def test_dead_rank_fails_the_engine(tiny_llama, when):
    """A rank killed between steps, or while rank 0 waits for it in an all-reduce: the engine
    raises an error naming the rank within seconds (never a hang)."""
    llm = LLM(tiny_llama[0], max_model_len=512, block_size=4, num_kv_blocks=512, tensor_parallel_size=2)
    proc = llm.engine.executor.workers.procs[0]
    if when == "between steps":
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    else:  # killed on a thread while the tenth step runs (a fixed delay raced a fast machine's whole run)
        step, steps = llm.engine.step, []

        def step_then_kill():
            steps.append(1)
            if len(steps) == 10:
                threading.Timer(0.001, os.kill, (proc.pid, signal.SIGKILL)).start()
            return step()

        llm.engine.step = step_then_kill
    t0 = time.monotonic()
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
        llm.generate([[5, 6, 7]] * 4, long, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    llm.shutdown()
    assert proc.poll() is not None


def test_shutdown_leaves_no_worker(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=64, block_size=4, num_kv_blocks=64, tensor_parallel_size=2)
    procs = list(llm.engine.executor.workers.procs)
    llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
    llm.shutdown()
    assert all(p.poll() is not None for p in procs)


def test_config_errors(tiny_llama):
    with pytest.raises(ValueError, match="must divide the model's attention heads"):
        LLM(tiny_llama[0], max_model_len=128, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="does not work with quantization='int4'"):
        LLM(tiny_llama[0], max_model_len=128, tensor_parallel_size=2, quantization="int4")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(tiny_llama[0], max_model_len=128, tensor_parallel_size=2, distributed_executor_backend="threads")


@pytest.mark.slow
def test_default_model_tp3_greedy_is_tp1_greedy():
    """The embedded SmolLM2-135M (9 heads, 3 KV heads: TP must divide 3) split over 3 ranks."""
    chats = [
        [{"role": "user", "content": q}] for q in ("What is the capital of France?", "Write a haiku about autumn.")
    ]
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    outs = {}
    for tp in (1, 3):
        llm = LLM(
            max_model_len=512,
            num_kv_blocks=128,
            tensor_parallel_size=tp,
            cpu_threads_per_rank=1,
            gguf_weights="dequantize",
        )
        outs[tp] = [o.outputs[0] for o in llm.chat(chats, sp, use_tqdm=False)]
        llm.shutdown()
    assert_same_completions(outs[3], outs[1], abs_tol=1e-4)


def test_ray_tp2_equals_tp1_and_a_dead_actor_fails_the_engine(tiny_llama, caplog):
    """The same split, with rank 1 a Ray actor in a placement group on a local Ray (2 CPUs); then
    that actor killed mid-run: an error naming the rank, not a hang."""
    import ray

    path = tiny_llama[0]
    ref, _, _ = _run(path, 1)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        caplog.set_level(logging.INFO, logger="kvflow")
        got, _, used = _run(path, 2, distributed_executor_backend="ray")
        faster = _faster_all_reduce(caplog)  # ranks on one host: measured, as with mp
        llm = LLM(
            path,
            max_model_len=512,
            block_size=4,
            num_kv_blocks=512,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
        )
        threading.Timer(0.5, ray.kill, (llm.engine.executor.workers.actors[0],)).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 .*exited"):
            llm.generate(
                [[5, 6, 7]] * 4, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), use_tqdm=False
            )
        assert time.monotonic() - t0 < 30
        llm.shutdown()
    finally:
        ray.shutdown()
        for s, handler in handlers.items():  # ray.init installed its own; later tests expect the defaults
            signal.signal(s, handler)
    assert used in faster
    assert_same_completions(got, ref, abs_tol=1e-4)
