"""`--gguf-weights auto`: the choice between a GGUF's blocks as stored and a float path, by timing."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.kernels.cpu.block_linear import block_kernels_unavailable
from kvflow.quantization.gguf_blocks import quantize
from kvflow.worker import gguf_weights
from kvflow.worker.gguf_weights import MARGIN, ROWS, decide, measure

needs_blocks = pytest.mark.skipif(
    block_kernels_unavailable() is not None, reason=f"block kernels unavailable: {block_kernels_unavailable()}"
)


def _times(blocks: float, f32: float, bf16: float) -> dict[str, dict[int, float]]:
    return {
        "blocks": {1: 1.0, ROWS[-1]: blocks},
        "float32": {1: 2.0, ROWS[-1]: f32},
        "bfloat16": {1: 1.5, ROWS[-1]: bf16},
    }


def test_the_rule():
    # the fastest float path at the batched row count, when it beats the blocks by the margin
    c = decide(_times(10.0, 12.0, 5.0), 1000, 1e12, "measured")
    assert (c.gguf_weights, c.dtype) == ("dequantize", "bfloat16")
    c = decide(_times(10.0, 8.0, 9.0), 1000, None, "measured")
    assert (c.gguf_weights, c.dtype) == ("dequantize", "float32")
    # within the margin, or slower: the blocks
    c = decide(_times(10.0, 12.0, 10.0 * (1 - MARGIN / 2)), 1000, 1e12, "measured")
    assert (c.gguf_weights, c.dtype) == ("native", "float32")
    assert "bfloat16" in c.why and "ms at 64 rows" in c.why
    # faster, but the dequantized weights would take more than the memory share: the blocks, and why
    c = decide(_times(10.0, 12.0, 5.0), 4 * 10**9, 10e9, "measured")
    assert (c.gguf_weights, c.dtype) == ("native", "float32")
    assert "8.0 GB" in c.why and "10.0 GB available" in c.why


@needs_blocks
def test_measure_times_every_candidate():
    g = torch.Generator().manual_seed(0)
    parts = {
        "q+k+v": [quantize(torch.randn(n, 64, generator=g), "Q4_1") for n in (64, 32, 32)],
        "down": [quantize(torch.randn(64, 128, generator=g), "Q4_0")],
        "logits": [quantize(torch.randn(256, 64, generator=g), "Q8_0")],
    }
    times = measure(parts, 3, ["float32", "bfloat16"])
    assert set(times) == {"blocks", "float32", "bfloat16"}
    for by_rows in times.values():
        assert set(by_rows) == set(ROWS) and all(0 < t < 1 for t in by_rows.values())


def test_auto_leaves_the_dtype_to_the_choice():
    with pytest.raises(ValueError, match="gguf_weights='auto' chooses the dtype itself.*bfloat16"):
        EngineConfig(gguf_weights="auto", dtype="bfloat16")


def test_auto_without_block_kernels_dequantizes_without_timing(monkeypatch):
    monkeypatch.setattr(gguf_weights, "measure", lambda *a: pytest.fail("nothing to time"))
    c = gguf_weights.resolve(EngineConfig(gguf_weights="auto", quantization="int8"))
    assert (c.gguf_weights, c.dtype) == ("dequantize", "float32")


@needs_blocks
def test_auto_on_the_default_model(tmp_path, monkeypatch):
    """Measured at the first start and stored; a later start reads the times; the engine then runs
    the chosen path: the same tokens as that path asked for by name."""
    monkeypatch.setenv("KVFLOW_AUTOTUNE_DIR", str(tmp_path))
    first = gguf_weights.choose(EngineConfig(gguf_weights="auto"))
    assert set(first.times) >= {"blocks", "float32"}
    rule = decide(first.times, 1, None, "")  # (the rule on the measured times)
    assert (first.gguf_weights, first.dtype) == (rule.gguf_weights, rule.dtype)
    assert len(list(tmp_path.glob("gguf-weights-*.json"))) == 1
    monkeypatch.setattr(gguf_weights, "measure", lambda *a: pytest.fail("the stored times are not read"))
    again = gguf_weights.choose(EngineConfig(gguf_weights="auto"))
    assert (again.gguf_weights, again.dtype, again.times) == (first.gguf_weights, first.dtype, first.times)

    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = "The capital of France is"
    common = dict(max_model_len=128, num_kv_blocks=32, kernel_autotune="off", enable_prefix_caching=False)
    llm = LLM(gguf_weights="auto", **common)
    assert (llm.engine.config.gguf_weights, llm.engine.config.dtype) == (first.gguf_weights, first.dtype)
    auto = llm.generate([prompt], params)[0].outputs[0].token_ids
    llm.shutdown()
    llm = LLM(gguf_weights=first.gguf_weights, dtype=first.dtype, **common)
    named = llm.generate([prompt], params)[0].outputs[0].token_ids
    llm.shutdown()
    assert auto == named and len(auto) == 8
