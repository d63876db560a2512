"""The fp8, int4 and bfloat16 KV cache dtypes in the engine: greedy generation runs end to end and is exact
within the dtype (each prompt alone == batched with chunked prefill, prefix caching and preemption),
on the native CPU attention (with the fused decode pass) and the torch reference; the pool holds as
many blocks as the dtype's bytes per token allow."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
NEW_DTYPES = ["fp8_e4m3", "fp8_e5m2", "int4"]


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    system = [rng.randrange(2, 500) for _ in range(16)]
    return [system[:cut] + [rng.randrange(2, 500) for _ in range(rng.randint(1, 12))] for cut in (16, 15, 8, 16, 3, 12)]


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("kv_dtype", [*NEW_DTYPES, "bfloat16"])  # (bfloat16 K/V under the float32 model)
def test_generation_exact_within_the_dtype(tiny_llama, kv_dtype, backend):
    prompts = _prompts()
    common = dict(
        max_model_len=64, kernel_autotune="off", block_size=4, kv_cache_dtype=kv_dtype, attention_backend=backend
    )
    alone_llm = LLM(tiny_llama[0], num_kv_blocks=128, enable_prefix_caching=False, **common)
    alone = [alone_llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert all(len(t) == GREEDY.max_tokens for t in alone)
    # chunked prefill (7 tokens a step), prefix caching, and a pool small enough to preempt
    llm = LLM(tiny_llama[0], num_kv_blocks=22, max_num_batched_tokens=7, **common)
    runner = llm.engine.runner
    assert runner.kv_caches[0].quantized == (kv_dtype != "bfloat16") and runner.kv_cache_dtype == kv_dtype
    if kv_dtype == "bfloat16":  # stored in bf16 under float32 activations: half float32's bytes per token
        assert runner.dtype == torch.float32 and runner.kv_caches[0].data.dtype == torch.bfloat16
        mc = llm.engine.model_config
        assert llm.engine.kv_bytes_per_token == 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
    if backend == "auto":  # the native attention, and decode-only steps through the fused pass
        assert type(runner.attention).__name__ == "CpuPagedAttention"
        assert runner.model.native_decode is not None
    for _ in range(2):  # the second pass hits the prefix cache the first left
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == alone
    stats = llm.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_fp8_alias_is_e4m3(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=64, kernel_autotune="off", num_kv_blocks=16, kv_cache_dtype="fp8")
    assert llm.engine.config.kv_cache_dtype == "fp8_e4m3"
    assert llm.engine.runner.kv_caches[0].data.dtype == torch.float8_e4m3fn


def test_blocks_in_the_same_memory(model_factory):
    """head_dim 64, bf16 model: a token's K or V of one head is 128 bytes in bf16, 64 + 4 in fp8,
    32 + 4 in int4, so ~1.88x and ~3.56x the blocks fit; the allocation holds exactly that."""
    path, _ = model_factory("llama", head_dim=64)
    blocks, per_token = {}, {}
    for name in ("auto", "fp8_e4m3", "fp8_e5m2", "int4"):
        llm = LLM(
            path,
            dtype="bfloat16",
            max_model_len=64,
            kernel_autotune="off",
            block_size=16,
            kv_cache_memory_gb=0.002,
            kv_cache_dtype=name,
        )
        e = llm.engine
        blocks[name], per_token[name] = e.num_kv_blocks, e.kv_bytes_per_token
        assert blocks[name] == int(0.002 * 2**30 // (16 * per_token[name]))
        held = sum(
            c.data.numel() * c.data.element_size() + (0 if c.scale is None else c.scale.numel() * 4)
            for c in e.runner.kv_caches
        )
        assert held == blocks[name] * 16 * per_token[name]
        llm.shutdown()
    assert per_token == {
        "auto": 2 * 2 * 2 * 64 * 2,
        "fp8_e4m3": 2 * 2 * 2 * (64 + 4),
        "fp8_e5m2": 2 * 2 * 2 * (64 + 4),
        "int4": 2 * 2 * 2 * (32 + 4),
    }
    assert 1.85 < blocks["fp8_e4m3"] / blocks["auto"] < 1.9
    assert 3.5 < blocks["int4"] / blocks["auto"] < 3.6


def test_gguf_blocks_keep_a_bfloat16_cache(tmp_path):
    """A GGUF whose blocks run as stored keeps K/V in bfloat16 under `auto` (as llama.cpp keeps its
    cache in 16 bits); `float32` keeps float32; the dequantized (exact) path keeps the model's."""
    from gguf_files import write_tiny

    path = str(tmp_path / "tiny.gguf")
    write_tiny(path, tied=True)
    common = dict(max_model_len=64, num_kv_blocks=16, kernel_autotune="off")
    seen = {}
    for name, options in {
        "native": {},
        "native float32": {"kv_cache_dtype": "float32"},
        "dequantize": {"gguf_weights": "dequantize"},
    }.items():
        llm = LLM(path, **common, **options)
        e = llm.engine
        seen[name] = (e.config.kv_cache_dtype, e.runner.kv_caches[0].data.dtype, e.kv_bytes_per_token)
        llm.shutdown()
    per_token = seen["dequantize"][2]
    assert seen == {
        "native": ("bfloat16", torch.bfloat16, per_token // 2),
        "native float32": ("float32", torch.float32, per_token),
        "dequantize": ("auto", torch.float32, per_token),
    }
