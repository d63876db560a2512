"""The block-quantized linear (kvflow.kernels.cpu.block_linear over csrc/block_linear.cpp) against
float64 references built from gguf-py's own dequantization (an independent implementation of the
formats), and int4 / GGUF-native weights in the engine.

The kernel quantizes each activation row per 32 values to int8 (x ~= dx * qx) and then computes
the exact integer dot products; what is left is float32 rounding of the block scales and of the
sum over blocks, so the bound is derived from that: (blocks + 10) float32 epsilons of the sum of
the absolute terms (scale * value and offset parts apart, so cancellation between them does not
shrink the bound below what the float32 arithmetic can do)."""

from __future__ import annotations

import math

import gguf.quants
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from kvflow.kernels.cpu.block_linear import BlockQuantKernel, block_amx, block_kernels_unavailable, block_library
from kvflow.layers.norm import RMSNorm
from kvflow.quantization.gguf_blocks import FORMATS, BlockQuantized, quantize

pytestmark = pytest.mark.skipif(
    block_kernels_unavailable() is not None, reason=f"block kernels unavailable: {block_kernels_unavailable()}"
)

EPS32 = 2.0**-23
# Where each format keeps its fp16 scales (offset, low value, high value) and its quantized values.
_SCALES = {
    "Q8_0": [(0, -0.05, 0.05)],
    "Q4_0": [(0, -0.05, 0.05)],
    "Q4_1": [(0, 0, 0.02), (2, -0.1, 0.1)],
    "Q4_K": [(0, 0, 0.01), (2, 0, 0.01)],
    "Q6_K": [(208, 0, 0.01)],
}
_VALUES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q4_K": (16, 144)}  # offset formats: where the values are


def random_blocks(name: str, rows: int, cols: int, seed: int) -> BlockQuantized:
    """Random bytes for every value and sub-scale, fp16 scales in a sane range."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    nb = cols // fmt.block_values
    data = torch.randint(0, 256, (rows, nb, fmt.block_bytes), dtype=torch.uint8, generator=g)
    for off, lo, hi in _SCALES[name]:
        v = (torch.rand(rows, nb, generator=g) * (hi - lo) + lo).half().contiguous()
        data[:, :, off : off + 2] = v.view(torch.uint8).view(rows, nb, 2)
    return BlockQuantized(fmt, data.reshape(rows, -1))


def gguf_dequantize(b: BlockQuantized) -> np.ndarray:
    return gguf.quants.dequantize(b.data.numpy(), Q[b.format.name]).reshape(b.shape).astype(np.float64)


def magnitude(b: BlockQuantized) -> np.ndarray:
    """|scale * value| + |offset| per weight (offset formats), |w| otherwise."""
    w = gguf_dequantize(b)
    if b.format.name not in _VALUES:
        return np.abs(w)
    start, end = _VALUES[b.format.name]
    zero = b.data.clone().view(b.shape[0], -1, b.format.block_bytes)
    zero[:, :, start:end] = 0  # every value 0: what is left is the offset
    offset = gguf_dequantize(BlockQuantized(b.format, zero.reshape(b.shape[0], -1)))
    return np.abs(w - offset) + np.abs(offset)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per 32 values, round(x / dx) * dx with dx = max|x| / 127."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / torch.where(dx > 0, dx, 1)) * dx).reshape(x.shape)


def check(kernel: BlockQuantKernel, parts: list[BlockQuantized], x: torch.Tensor, y: torch.Tensor) -> None:
    w = np.concatenate([gguf_dequantize(p) for p in parts])
    mag = np.concatenate([magnitude(p) for p in parts])
    xq = quantized_activations(x).numpy()
    ref = xq @ w.T
    bound = (x.shape[1] / 32 + 10) * EPS32 * (np.abs(xq) @ mag.T) + 1e-30
    err = np.abs(y.double().numpy() - ref)
    assert (err <= bound).all(), f"max err / bound {(err / bound).max():.2f}"


ROWS = range(1, 65)


@pytest.mark.parametrize("name,cols", [("Q8_0", 96), ("Q4_0", 160), ("Q4_1", 64), ("Q4_K", 512), ("Q6_K", 256)])
# 48 and 40: the repacked layout (40: five groups of 8 channels, so with AVX-512 a group outside the
# pairs, and with two threads a thread that starts inside a pair); 37: GGUF's own rows
@pytest.mark.parametrize("channels", [37, 40, 48])
def test_each_format_against_float64(name, cols, channels):
    b = random_blocks(name, channels, cols, seed=channels)
    kernel = BlockQuantKernel([b])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, cols, generator=g) * torch.rand(64, 1, generator=g) * 3
    full = kernel(x)
    check(kernel, [b], x, full)
    for m in ROWS:
        y = kernel(x[:m])
        # A row's result does not depend on how many rows the call holds (tiles differ by row count).
        assert torch.equal(y, full[:m]), m
    # The kernel's own copy (repacked or in place) dequantizes back to gguf-py's values.
    np.testing.assert_array_equal(kernel.dequantized_weight().double().numpy(), gguf_dequantize(b))


@pytest.fixture(scope="module")
def amx_library():
    """The block kernels with their AMX-INT8 path: the engine's own where this CPU has AMX, else the
    build that emulates the tile instructions in C++ (csrc/amx.h)."""
    if block_amx():
        return block_library()
    lib = block_library("block_amx_emulated")
    if lib is None:
        pytest.fail("the AMX-emulating build of the block kernels could not be built (see the log)")
    if not block_amx(lib):
        pytest.skip("the AMX path reads the paired layout of AVX-512 VNNI, which this CPU lacks")
    return lib


@pytest.mark.parametrize("name,cols", [("Q8_0", 96), ("Q4_0", 160), ("Q4_1", 64), ("Q4_K", 512)])
@pytest.mark.parametrize("channels", [40, 48])
def test_amx_tiles_give_the_vector_tiles_bits(amx_library, name, cols, channels):
    """Calls of 8 rows and more run on the AMX-INT8 tiles (blocks of 16, and a last one of 8-15;
    fewer on the vector tiles): every row the same bits as with the tiles off, and as the row alone;
    within the float64 bound."""
    b = random_blocks(name, channels, cols, seed=channels + 7)
    kernel = BlockQuantKernel([b], lib=amx_library)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, cols, generator=g) * torch.rand(70, 1, generator=g) * 3
    alone = torch.cat([kernel(x[i : i + 1]) for i in range(70)])  # one row: never on the tiles
    try:
        for m in (8, 12, 15, 16, 17, 24, 31, 32, 40, 64, 70):
            assert block_amx(amx_library, enable=True)
            y = kernel(x[:m])
            assert torch.equal(y, alone[:m]), m
            block_amx(amx_library, enable=False)
            assert torch.equal(kernel(x[:m]), y), m
        check(kernel, [b], x, y)
    finally:
        block_amx(amx_library, enable=True)


def test_fused_parts_of_different_formats():
    """q | k | v of three formats (two repacked, one in place) in one call."""
    parts = [random_blocks("Q4_1", 64, 256, 1), random_blocks("Q6_K", 32, 256, 2), random_blocks("Q8_0", 24, 256, 3)]
    kernel = BlockQuantKernel(parts)
    x = torch.randn(5, 256)
    check(kernel, parts, x, kernel(x))
    ids = torch.tensor([[0, 63], [64, 119]])
    rows = kernel.rows(ids)
    w = np.concatenate([gguf_dequantize(p) for p in parts])
    np.testing.assert_array_equal(rows.double().numpy(), w[ids.numpy()])


def test_prologue_bias_and_residual():
    """norm= / silu_mul= / residual / bias in the call equal the same ops done in torch first."""
    b = random_blocks("Q4_0", 40, 64, 5)
    bias = torch.randn(40)
    kernel = BlockQuantKernel([b], bias)
    x, res = torch.randn(3, 64), torch.randn(3, 40)
    norm = RMSNorm(64, 1e-5, torch.float32, torch.device("cpu"))
    norm.weight.data = torch.rand(64) + 0.5
    torch.testing.assert_close(
        kernel(x, res, norm=norm.kernel_args()), kernel(norm.forward(x)) + res, atol=1e-4, rtol=1e-4
    )
    gate_up = torch.randn(3, 128)
    act = torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:]
    torch.testing.assert_close(kernel(gate_up, silu_mul=True), kernel(act), atol=1e-4, rtol=1e-4)
    check(kernel, [b], x, kernel(x) - bias)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="share their inputs"):
        BlockQuantKernel([random_blocks("Q8_0", 8, 64, 0), random_blocks("Q8_0", 8, 96, 0)])
    kernel = BlockQuantKernel([random_blocks("Q8_0", 8, 64, 0)])
    with pytest.raises(ValueError, match="64 inputs got rows of 65"):
        kernel(torch.randn(2, 65))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), "Q4_1")


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_round_to_nearest_matches_gguf(name):
    """int4's quantizer (and the Q8_0 of its logits) against gguf-py's reference quantizer: the
    same blocks up to a one-step rounding tie, and within the format's error of the float weight
    (half a step; Q4_0 a whole one, its range -8..7 clips the side opposite the largest value)."""
    w = torch.randn(16, 128) * 0.05
    ours = quantize(w, name)
    theirs = gguf.quants.quantize(w.numpy(), Q[name])
    deq, ref = ours.dequantize().double().numpy(), gguf.quants.dequantize(theirs, Q[name]).astype(np.float64)
    blocks = w.double().numpy().reshape(-1, 32)
    if name == "Q4_1":
        step, within = (blocks.max(1) - blocks.min(1)) / 15, 0.51
    else:
        step, within = np.abs(blocks).max(1) / (127 if name == "Q8_0" else 8), 0.51 if name == "Q8_0" else 1.01
    step = step.repeat(32).reshape(w.shape)
    assert (np.abs(deq - ref) <= step * 1.01 + 1e-6).all()
    assert (np.abs(deq - w.double().numpy()) <= step * within + 1e-4).all()
    assert np.mean(deq == ref) > 0.95


@pytest.mark.parametrize("name", list(FORMATS))
def test_scaled_blocks_are_the_weight_times_the_factor(name):
    """`BlockQuantized.scaled` (Granite's residual multiplier folded into blocks as stored) against
    gguf-py's own dequantization of the unscaled blocks times the factor, in float64: each value
    within the fp16 rounding of its block's scales (2^-11 relative of each term), far below what
    a scale left unscaled (Q4_1's m, Q4_K's dmin) would be off by."""
    blocks = random_blocks(name, 8, 512, seed=3)  # (random scales and mins: Q4_1 / Q4_K's m not 0)
    data = blocks.data.reshape(-1)
    for factor in (0.22, 3.5):
        got = blocks.scaled(factor).dequantize().double()
        ref = torch.from_numpy(gguf.quants.dequantize(data.numpy(), Q[name]).astype(np.float64)).reshape(8, -1)
        per_block = ref.abs().reshape(-1, 32).amax(1, keepdim=True).expand(-1, 32).reshape(ref.shape)
        err = (got - factor * ref).abs()
        assert (err <= 2.0**-9 * factor * per_block + 1e-9).all(), (factor, err.max().item())
        assert not torch.equal(got, factor * ref) or name == "Q8_0"  # (fp16 rounding shows somewhere)
    with pytest.raises(ValueError, match="leaves fp16's range"):
        blocks.scaled(1e9)


# ---- in the engine ----------------------------------------------------------------------------------


def _perplexity(llm, ids: list[int]) -> float:
    from conftest import engine_logits

    lp = torch.log_softmax(engine_logits(llm, ids)[:-1].double(), -1)
    return math.exp(-lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


def test_int4_perplexity_tiny_model(tiny_llama):
    """The tiny random model's perplexity on its own sampled text: int4 within 10% of fp32 (measured
    +4.6%: 338.7 vs 354.4); the engine serves int4 without leaking blocks."""
    from kvflow import LLM, SamplingParams

    from conftest import assert_no_leaks

    path, _ = tiny_llama
    fp32 = LLM(path, max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False)
    int4 = LLM(path, max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False, quantization="int4")
    assert int4.engine.runner.linear_backend == "int4"
    sp = SamplingParams(temperature=0.8, max_tokens=120, seed=3, ignore_eos=True)
    ids = [5, 9, 33] + fp32.generate([[5, 9, 33]], sp, use_tqdm=False)[0].outputs[0].token_ids
    ppl32, ppl4 = _perplexity(fp32, ids), _perplexity(int4, ids)
    assert ppl4 / ppl32 < 1.10, (ppl4, ppl32)
    assert abs(ppl4 / ppl32 - 1) > 0  # int4 is not silently fp32
    assert_no_leaks(int4.engine)


@pytest.mark.slow
def test_default_model_native_gguf_agrees_with_dequantized():
    """The embedded SmolLM2-135M Q4_1 GGUF run on its own blocks (and as int4 of its float copy)
    against the same file dequantized to float32. Measured (first 1024 tokens of benchmarks/quality.py's text): perplexity -0.02%,
    mean KL 0.0028 nats, top-1 next token the same at 96.8% of positions; weights 96.6 MB as held
    (the dequantized model: 651 MB). Greedy continuations drift apart where the float model's top
    two are near a tie (as llama.cpp's do on the same file); agreement is asserted teacher-forced
    and on greedy text."""
    import sys
    from pathlib import Path

    from kvflow import LLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from quality import eval_text, window_logits

    llms = {
        mode: LLM(max_model_len=1024, num_kv_blocks=80, enable_prefix_caching=False, **opts)
        for mode, opts in (
            ("native", {"gguf_weights": "native"}),
            ("dequantize", {"gguf_weights": "dequantize"}),
            ("int4", {"quantization": "int4"}),
        )
    }
    native = llms["native"].engine.runner
    assert native.linear_backend == "gguf" and native.model.native_decode is not None
    assert native.model.weight_bytes() <= 110e6
    ids = llms["native"].tokenizer(eval_text(), add_special_tokens=False)["input_ids"][:1024]
    nll = dict.fromkeys(llms, 0.0)
    kl = top1 = 0.0
    for start in range(0, len(ids), 512):
        w = ids[start : start + 512]
        lp = {m: torch.log_softmax(window_logits(llm, w)[:-1].double(), -1) for m, llm in llms.items()}
        for m in llms:
            nll[m] += -lp[m].gather(1, torch.tensor(w[1:])[:, None]).sum().item()
        ref = lp["dequantize"]
        kl += (ref.exp() * (ref - lp["native"])).sum().item()
        top1 += (ref.argmax(-1) == lp["native"].argmax(-1)).sum().item()
    n = len(ids) - 2
    assert abs(math.exp((nll["native"] - nll["dequantize"]) / n) - 1) < 0.02
    assert kl / n < 0.01
    assert top1 / n > 0.94
    # Greedy: 8 of quality.py's chat prompts, 32 tokens (measured: common prefixes 10, 0, 31, 31,
    # 32, 32, 32, 32; 78% of the tokens the same at the same position).
    from quality import PROMPTS

    from kvflow import SamplingParams

    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:8]]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {
        m: [o.outputs[0].token_ids for o in llms[m].chat(chats, sp, use_tqdm=False)] for m in ("native", "dequantize")
    }
    same = sum(a == b for x, y in zip(outs["native"], outs["dequantize"]) for a, b in zip(x, y))
    assert same / (8 * 32) > 0.6
    assert sum(x[:4] == y[:4] for x, y in zip(outs["native"], outs["dequantize"])) >= 6
    # int4 of the dequantized floats: perplexity within 3% of fp32 (measured -0.02%: these floats
    # came from Q4_1 blocks, which round to nearest finds again), weights 66 MB + the 8-bit logits.
    assert abs(math.exp((nll["int4"] - nll["dequantize"]) / n) - 1) < 0.03
    assert llms["int4"].engine.runner.model.weight_bytes() <= 110e6


def test_engine_on_a_k_quant_gguf(tmp_path):
    """A tiny GGUF laid out like a Q4_K_M file (Q4_K projections, Q6_K v / down and a tied Q6_K
    embedding): served on its blocks, its logits follow the dequantized model's within the
    activation quantization's noise, and the engine's own paths agree with each other."""
    from kvflow import LLM, SamplingParams

    from conftest import assert_no_leaks
    from gguf_files import write_tiny

    hidden, ffn, heads, kv_heads, vocab = 256, 512, 4, 2, 361
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv_heads * 64, hidden),
        "attn_v": (kv_heads * 64, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    raw = {}
    for i in range(2):
        for j, (name, (rows, cols)) in enumerate(shapes.items()):
            fmt = "Q6_K" if name in ("attn_v", "ffn_down") else "Q4_K"
            raw[f"blk.{i}.{name}.weight"] = (Q[fmt], random_blocks(fmt, rows, cols, 10 * i + j).data.numpy())
    raw["token_embd.weight"] = (Q.Q6_K, random_blocks("Q6_K", vocab, hidden, 99).data.numpy())
    path = tmp_path / "kquant.gguf"
    write_tiny(path, tied=True, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads, raw_blocks=raw)
    llms = {
        m: LLM(str(path), max_model_len=128, num_kv_blocks=32, enable_prefix_caching=False, gguf_weights=m)
        for m in ("native", "dequantize")
    }
    model = llms["native"].engine.runner.model
    assert llms["native"].engine.runner.linear_backend == "gguf" and model.native_decode is not None
    assert model.layers[0].qkv_proj.kernel.formats == ["Q4_K", "Q4_K", "Q6_K"]
    prompt = [5, 9, 33, 2, 71, 100, 12, 8, 40, 41, 42]
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from quality import window_logits

    native, ref = (window_logits(llms[m], prompt) for m in ("native", "dequantize"))
    scale = ref.std().item()
    assert (native - ref).abs().max().item() < 0.1 * scale, ((native - ref).abs().max(), scale)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llms["native"].generate([prompt, prompt[:5]], sp, use_tqdm=False)]
    alone = llms["native"].generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert batched[0] == alone  # a row's result does not depend on its batch
    assert_no_leaks(llms["native"].engine)
