"""The decode pass in one native call (kvflow.models.decode_pass), over int8 weights, fp32 ones
(the native GEMV) and int4 blocks (the block kernel), against the per-layer path it replaces (Qwen3's
q/k norms included): same hidden states and same cache contents, bit for bit, on decode rows of different context lengths; and the engine uses it
without changing outputs or leaking blocks."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.attention.backend import LayerKVCache, SeqLayout

from conftest import assert_no_leaks


def _native_llm(path: str, kv_dtype: str, weights: str, monkeypatch) -> LLM:
    """weights "int8": W8A8; "fp32": float32 through the native GEMV at every row count; "int4":
    Q4_1 blocks through the block kernel."""
    if weights == "fp32":
        monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", "native")
    llm = LLM(
        model=path,
        quantization=_QUANT[weights],
        kv_cache_dtype=kv_dtype,
        num_kv_blocks=48,
        max_model_len=128,
        block_size=4,
    )
    if llm.engine.runner.model.native_decode is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built")
    return llm


_QUANT = {"int8": "int8", "fp32": None, "int4": "int4"}


def _clone(caches: list[LayerKVCache]) -> list[LayerKVCache]:
    return [LayerKVCache(c.data.clone(), None if c.scale is None else c.scale.clone()) for c in caches]


@pytest.mark.parametrize("weights", ["int8", "fp32", "int4"])
@pytest.mark.parametrize(
    "arch,kv_dtype", [("llama", "auto"), ("llama", "int8"), ("qwen2", "auto"), ("mistral", "int8"), ("qwen3", "auto")]
)
def test_native_decode_equals_per_layer_path(model_factory, arch, kv_dtype, weights, monkeypatch):
    path, _ = model_factory(arch, **({"sliding_window": 6} if arch == "mistral" else {}))
    llm = _native_llm(path, kv_dtype, weights, monkeypatch)
    runner, model = llm.engine.runner, llm.engine.runner.model
    attn = runner.attention
    g = torch.Generator().manual_seed(0)
    # Three sequences with 9, 4 and 16 tokens already cached (block boundary and mid-block), tables
    # scattered over the pool.
    tables = [[5, 2, 9], [7], [1, 11, 3, 8, 12]]
    contexts = [9, 4, 16]
    with torch.inference_mode():
        for table, n in zip(tables, contexts):
            ids = torch.randint(3, 200, (n,), generator=g)
            meta = attn.build_metadata([SeqLayout(0, n, table)])
            model(ids, meta.positions, runner.kv_caches, meta)
        # One new token per sequence, then (decodes verifying their drafts) 3, 1 and 4 new tokens.
        for new in ([1, 1, 1], [3, 1, 4]):
            meta = attn.build_metadata([SeqLayout(n, k, t) for n, k, t in zip(contexts, new, tables)])
            assert attn.decode_group(meta) is not None
            ids = torch.randint(3, 200, (sum(new),), generator=g)
            per_layer_caches = _clone(runner.kv_caches)
            native, model.native_decode = model.native_decode, None
            expect = model(ids, meta.positions, per_layer_caches, meta)
            model.native_decode = native
            got = model(ids, meta.positions, runner.kv_caches, meta)
            assert torch.equal(got, expect)
            for a, b in zip(runner.kv_caches, per_layer_caches):
                assert torch.equal(a.data, b.data)
                assert a.scale is None or torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("weights", ["int8", "fp32", "int4"])
def test_engine_outputs_with_and_without_native_decode(tiny_llama, weights, monkeypatch):
    """Batched decodes with preemption: the greedy tokens are the same when every step takes the
    per-layer path, and no block leaks."""
    path, _ = tiny_llama
    if weights == "fp32":
        monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", "native")
    prompts = [[(5 * i + j) % 190 + 3 for j in range(4 + 7 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    results = []
    for native in (True, False):
        llm = LLM(
            model=path,
            quantization=_QUANT[weights],
            num_kv_blocks=36,
            max_model_len=128,
            block_size=4,
            max_num_batched_tokens=32,
        )
        if not native:
            llm.engine.runner.model.native_decode = None
        elif llm.engine.runner.model.native_decode is None:
            pytest.skip("no C++ compiler: the native int8 kernels cannot be built")
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.get_stats().num_preemptions > 0
        assert_no_leaks(llm.engine)
    assert results[0] == results[1]


def test_int8_torch_op_fallback_close_to_native(model_factory, monkeypatch):
    """Without the native int8 library (no C++ compiler; forced here) the engine runs the per-layer
    path on torch's quantized ops: the same quantization rule, logits equal up to float32 rounding."""
    path, _ = model_factory("qwen2")
    prompt = [(11 * j) % 180 + 3 for j in range(21)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = []
    for native in ("1", "0"):
        monkeypatch.setenv("KVFLOW_INT8_NATIVE", native)
        llm = LLM(model=path, quantization="int8", num_kv_blocks=32, max_model_len=64, block_size=4)
        assert (llm.engine.runner.model.native_decode is None) == (native == "0")
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0])
    native_out, torch_out = outs
    assert native_out.token_ids == torch_out.token_ids
    for tok, a, b in zip(native_out.token_ids, native_out.logprobs, torch_out.logprobs):
        assert abs(a[tok].logprob - b[tok].logprob) < 1e-3
