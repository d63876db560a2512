"""KV offload tiers: evicted prefix blocks come back from CPU memory or disk, not recomputed."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks, assert_same_completions

BS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)


def _doc(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


DOC = _doc(1)
QUESTIONS = [DOC + _doc(100 + i, 5) for i in range(2)]
FILLER = [_doc(200 + i) for i in range(3)]  # enough to push DOC's blocks out of a 24-block pool


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=64, block_size=BS, num_kv_blocks=64, enable_prefix_caching=False)
    return [llm.generate([q], PARAMS, use_tqdm=False)[0].outputs[0] for q in QUESTIONS]


def _engine(path, **opts):
    return LLM(path, max_model_len=64, block_size=BS, num_kv_blocks=24, **opts)


def _ask(llm, prompts):
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0] for p in prompts]


def test_cpu_tier_reloads_evicted_blocks(tiny_llama, reference):
    llm = _engine(tiny_llama[0], kv_offload_cpu_gb=0.01)
    _ask(llm, QUESTIONS[:1])
    _ask(llm, FILLER)  # evicts DOC from the pool into the CPU tier
    stats = llm.get_stats().kv_offload
    assert stats.cpu.stored > 0
    out = _ask(llm, QUESTIONS[1:])
    assert stats.cpu.hits >= len(DOC) // BS - 1 and stats.loaded > 0
    assert_same_completions(out, reference[1:])
    assert_no_leaks(llm.engine)


def test_disk_tier_and_restart(tiny_llama, reference, tmp_path):
    disk = tmp_path / "kv"
    llm = _engine(tiny_llama[0], kv_offload_disk_dir=str(disk))  # no CPU tier: evictions go to disk
    _ask(llm, QUESTIONS[:1])
    _ask(llm, FILLER)
    assert llm.get_stats().kv_offload.disk.stored > 0
    assert_same_completions(_ask(llm, QUESTIONS[1:]), reference[1:])
    assert llm.get_stats().kv_offload.disk.hits > 0
    llm.shutdown()
    del llm

    # A new engine (a restart) finds the document on disk and prefills only the question.
    again = _engine(tiny_llama[0], kv_offload_disk_dir=str(disk))
    outs = again.generate([QUESTIONS[0]], PARAMS, use_tqdm=False)
    assert outs[0].num_cached_tokens >= len(DOC) - BS
    assert_same_completions([outs[0].outputs[0]], reference[:1])
    assert again.get_stats().kv_offload.disk.hits > 0


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_files_are_rejected(tiny_llama, reference, tmp_path, damage, caplog):
    disk = tmp_path / "kv"
    llm = _engine(tiny_llama[0], kv_offload_disk_dir=str(disk))
    _ask(llm, QUESTIONS[:1])
    llm.shutdown()
    files = sorted(disk.glob("*.kvblock"))
    assert files
    for f in files:
        raw = bytearray(f.read_bytes())
        if damage == "truncate":
            raw = raw[: len(raw) // 2]
        else:
            raw[-3] ^= 0xFF
        f.write_bytes(bytes(raw))
    again = _engine(tiny_llama[0], kv_offload_disk_dir=str(disk))
    outs = again.generate([QUESTIONS[0]], PARAMS, use_tqdm=False)
    assert_same_completions([outs[0].outputs[0]], reference[:1])  # recomputed, still right
    stats = again.get_stats().kv_offload
    assert stats.disk.rejected > 0 and stats.loaded == 0
    assert "ignoring" in caplog.text


def test_foreign_files_are_not_loaded(tiny_llama, model_factory, tmp_path):
    disk = tmp_path / "kv"
    llm = _engine(tiny_llama[0], kv_offload_disk_dir=str(disk))
    _ask(llm, QUESTIONS[:1])
    llm.shutdown()
    other_path, _ = model_factory("qwen2")  # another model, same directory
    other = LLM(other_path, max_model_len=64, block_size=BS, num_kv_blocks=24, kv_offload_disk_dir=str(disk))
    outs = other.generate([QUESTIONS[0]], PARAMS, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0
    assert other.get_stats().kv_offload.loaded == 0


def test_offload_needs_prefix_caching(tiny_llama):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(tiny_llama[0], max_model_len=64, kv_offload_cpu_gb=1.0, enable_prefix_caching=False)


def test_read_write_blocks_round_trip(tiny_llama):
    llm = _engine(tiny_llama[0])
    runner = llm.engine.runner
    data = torch.randn(3, *runner.read_blocks([0]).shape[1:])
    runner.write_blocks([5, 2, 9], data)
    assert torch.equal(runner.read_blocks([5, 2, 9]), data)


@pytest.mark.server
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_tensor_parallel_tiers(tiny_llama, reference, tmp_path, kv_dtype):
    """TP = 2: each rank holds half of every block's KV heads. The tiers store whole blocks (rank 0
    gathers both shares) and write each rank its share back: the reloaded document gives one
    rank's tokens. With the default KV dtype a block is stored in one rank's layout, so a disk
    tier written under TP = 2 serves a TP = 1 engine."""
    path = tiny_llama[0]
    ref = (
        reference
        if kv_dtype == "auto"
        else [
            o.outputs[0]
            for o in LLM(
                path,
                max_model_len=64,
                block_size=BS,
                num_kv_blocks=64,
                kv_cache_dtype=kv_dtype,
                enable_prefix_caching=False,
            ).generate(QUESTIONS, PARAMS, use_tqdm=False)
        ]
    )
    disk = tmp_path / "kv"
    llm = _engine(
        path, kv_offload_cpu_gb=0.01, kv_offload_disk_dir=str(disk), tensor_parallel_size=2, kv_cache_dtype=kv_dtype
    )
    try:
        _ask(llm, QUESTIONS[:1])
        _ask(llm, FILLER)  # evicts DOC into the tiers
        assert llm.get_stats().kv_offload.cpu.stored > 0
        assert_same_completions(_ask(llm, QUESTIONS[1:]), ref[1:], abs_tol=1e-4)
        stats = llm.get_stats().kv_offload
        assert stats.cpu.hits >= len(DOC) // BS - 1 and stats.loaded > 0
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()  # persists the pool to the disk tier, with the workers still there
    if kv_dtype == "auto":
        one = _engine(path, kv_offload_disk_dir=str(disk))
        outs = one.generate([QUESTIONS[0]], PARAMS, use_tqdm=False)
        assert outs[0].num_cached_tokens >= len(DOC) - BS and one.get_stats().kv_offload.disk.hits > 0
        assert_same_completions([outs[0].outputs[0]], ref[:1], abs_tol=1e-4)
