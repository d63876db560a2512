"""fp8 and int4 KV blocks through the offload tiers and P/D transfer: codes and scales travel
together byte for byte (the completions are those of one engine with the same KV dtype), the
manifest names the KV dtype, and a peer with another KV dtype is refused (then recomputed)."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kv_transfer import pd

from conftest import assert_no_leaks, assert_same_completions

BS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
NEW_DTYPES = ["fp8_e4m3", "fp8_e5m2", "int4"]


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


DOC = _ids(1, 40)
QUESTIONS = [DOC + _ids(100 + i, 5) for i in range(2)]
FILLER = [_ids(200 + i, 40) for i in range(3)]  # enough to push DOC's blocks out of a 24-block pool


def _ask(llm, prompts):
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0] for p in prompts]


def _reference(path, kv_dtype):
    llm = LLM(
        path,
        max_model_len=64,
        kernel_autotune="off",
        block_size=BS,
        num_kv_blocks=64,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_dtype,
    )
    return _ask(llm, QUESTIONS)


@pytest.mark.parametrize("kv_dtype", NEW_DTYPES)
def test_read_write_blocks_round_trip(tiny_llama, kv_dtype):
    """A block as connectors move it: per layer the codes' bytes then the float32 scales' bytes;
    written back elsewhere, the same codes and scales."""
    llm = LLM(
        tiny_llama[0], max_model_len=64, kernel_autotune="off", block_size=BS, num_kv_blocks=16, kv_cache_dtype=kv_dtype
    )
    runner = llm.engine.runner
    llm.generate([_ids(8, 20)], PARAMS, use_tqdm=False)  # fill some blocks
    data = runner.read_blocks([0, 1, 2])
    c = runner.kv_caches[0]
    per_layer = c.data[0].numel() + c.scale[0].numel() * 4
    assert data.dtype == torch.uint8 and tuple(data.shape) == (3, len(runner.kv_caches), per_layer)
    before = [(c.data.view(torch.uint8).clone(), c.scale.clone()) for c in runner.kv_caches]
    runner.write_blocks([9, 7, 5], data)
    for (d, s), c in zip(before, runner.kv_caches):
        assert torch.equal(c.data.view(torch.uint8)[[9, 7, 5]], d[[0, 1, 2]])
        assert torch.equal(c.scale[[9, 7, 5]], s[[0, 1, 2]])
    assert torch.equal(runner.read_blocks([9, 7, 5]), data)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int4"])
def test_offload_tiers_round_trip(tiny_llama, tmp_path, kv_dtype):
    """Evicted blocks come back from the CPU tier, and after a restart from disk, giving the
    completions of an engine that never offloaded (same KV dtype)."""
    reference = _reference(tiny_llama[0], kv_dtype)
    disk = tmp_path / "kv"

    def engine(**opts):
        return LLM(
            tiny_llama[0],
            max_model_len=64,
            kernel_autotune="off",
            block_size=BS,
            num_kv_blocks=24,
            kv_cache_dtype=kv_dtype,
            **opts,
        )

    llm = engine(kv_offload_cpu_gb=0.01, kv_offload_disk_dir=str(disk))
    _ask(llm, QUESTIONS[:1])
    _ask(llm, FILLER)  # evicts DOC from the pool into the tiers
    out = _ask(llm, QUESTIONS[1:])
    stats = llm.get_stats().kv_offload
    assert stats.cpu.hits > 0 and stats.loaded > 0
    assert_same_completions(out, reference[1:])
    assert_no_leaks(llm.engine)
    llm.shutdown()
    del llm
    again = engine(kv_offload_disk_dir=str(disk))  # a restart: the document from disk
    outs = again.generate([QUESTIONS[0]], PARAMS, use_tqdm=False)
    assert outs[0].num_cached_tokens >= len(DOC) - BS
    assert_same_completions([outs[0].outputs[0]], reference[:1])
    # another KV dtype never loads those files
    other = LLM(
        tiny_llama[0],
        max_model_len=64,
        kernel_autotune="off",
        block_size=BS,
        num_kv_blocks=24,
        kv_offload_disk_dir=str(disk),
    )
    assert other.generate([QUESTIONS[0]], PARAMS, use_tqdm=False)[0].num_cached_tokens == 0


def _pd_engine(path, role, kv_dtype, **kv):
    return LLM(
        path,
        max_model_len=64,
        kernel_autotune="off",
        block_size=BS,
        num_kv_blocks=48,
        kv_cache_dtype=kv_dtype,
        kv_transfer_config={"kv_connector": "tcp", "kv_role": role, **kv},
    )


def _prefill(producer, prompt):
    sp = SamplingParams(temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return producer.generate([prompt], sp, use_tqdm=False)[0].kv_transfer_params


def _decode(consumer, prompt, params):
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, kv_transfer_params=params)
    return consumer.generate([prompt], sp, use_tqdm=False)[0]


def _drain(llm):
    import time

    deadline = time.monotonic() + 10
    while llm.engine.has_pending_kv_transfers():
        assert time.monotonic() < deadline, "KV transfers never settled"
        llm.engine.step()
        time.sleep(0.005)


def _spy_manifests(monkeypatch, tamper: str | None = None) -> list[dict]:
    """Record the manifests the producer sends (optionally rewriting their kv_cache_dtype)."""
    seen: list[dict] = []
    real = pd.send_frame

    def send(sock, header, payload=b""):
        if "manifest" in header:
            seen.append(dict(header["manifest"]))
            if tamper is not None:
                header = {**header, "manifest": {**header["manifest"], "kv_cache_dtype": tamper}}
        return real(sock, header, payload)

    monkeypatch.setattr(pd, "send_frame", send)
    return seen


@pytest.mark.parametrize("kv_dtype", ["fp8_e5m2", "int4"])
def test_pd_transfer_carries_the_dtype(tiny_llama, monkeypatch, kv_dtype):
    prompt = QUESTIONS[0]
    reference = _decode(
        LLM(
            tiny_llama[0],
            max_model_len=64,
            kernel_autotune="off",
            block_size=BS,
            num_kv_blocks=48,
            kv_cache_dtype=kv_dtype,
        ),
        prompt,
        None,
    )
    manifests = _spy_manifests(monkeypatch)
    producer, consumer = (
        _pd_engine(tiny_llama[0], "kv_producer", kv_dtype),
        _pd_engine(tiny_llama[0], "kv_consumer", kv_dtype),
    )
    out = _decode(consumer, prompt, _prefill(producer, prompt))
    assert_same_completions(out.outputs, reference.outputs)
    assert out.num_cached_tokens == (len(prompt) - 1) // BS * BS
    assert [m["kv_cache_dtype"] for m in manifests] == [kv_dtype] and manifests[0]["dtype"] == "uint8"
    _drain(producer)
    assert not consumer.get_stats().kv_transfer.failures
    for llm in (producer, consumer):
        assert_no_leaks(llm.engine)
        llm.shutdown()


def test_pd_dtype_mismatch_is_refused(tiny_llama, monkeypatch):
    """A producer with another KV dtype: refused (its blocks are another engine's identity), the
    consumer recomputes; a manifest claiming another KV dtype is refused by the consumer's check."""
    prompt = QUESTIONS[0]
    reference = _decode(
        LLM(
            tiny_llama[0],
            max_model_len=64,
            kernel_autotune="off",
            block_size=BS,
            num_kv_blocks=48,
            kv_cache_dtype="int4",
        ),
        prompt,
        None,
    )
    producer = _pd_engine(tiny_llama[0], "kv_producer", "fp8_e4m3", kv_lease_s=0.5)
    consumer = _pd_engine(tiny_llama[0], "kv_consumer", "int4")
    out = _decode(consumer, prompt, _prefill(producer, prompt))
    assert_same_completions(out.outputs, reference.outputs)
    assert out.num_cached_tokens == 0  # recomputed
    assert consumer.get_stats().kv_transfer.failures == {"refused": 1}
    _drain(producer)  # (no release for a refused fetch: the lease frees the blocks)
    for llm in (producer, consumer):
        assert_no_leaks(llm.engine)
        llm.shutdown()

    _spy_manifests(monkeypatch, tamper="fp8_e4m3")
    producer, consumer = (
        _pd_engine(tiny_llama[0], "kv_producer", "int4"),
        _pd_engine(tiny_llama[0], "kv_consumer", "int4"),
    )
    out = _decode(consumer, prompt, _prefill(producer, prompt))
    assert_same_completions(out.outputs, reference.outputs)
    assert out.num_cached_tokens == 0
    assert consumer.get_stats().kv_transfer.failures == {"layout": 1}
    _drain(producer)
    for llm in (producer, consumer):
        assert_no_leaks(llm.engine)
        llm.shutdown()
