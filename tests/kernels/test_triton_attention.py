"""The Triton attention kernels and backend, run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1: the same kernels a GPU compiles, executed with numpy): against a float64
brute force, against the torch backend inside the engine, with mutated copies of the kernels that
must fail, and the CUDA-graph buffer path (padding, static metadata) run eagerly.

On a GPU machine `KVFLOW_TEST_DEVICE=cuda pytest tests/kernels/test_triton_attention.py` runs the same
tests with the kernels compiled for the GPU (benchmarks/gpu_check.sh does)."""

from __future__ import annotations

import os

DEVICE_NAME = os.environ.get("KVFLOW_TEST_DEVICE", "cpu")
if DEVICE_NAME == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (on first use)

import importlib.util  # noqa: E402
import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.attention.backend import LayerKVCache, SeqLayout  # noqa: E402
from kvflow.attention.backends.torch import TorchPagedAttention  # noqa: E402
from kvflow.attention.selector import make_attention_backend  # noqa: E402

from conftest import assert_no_leaks, assert_same_completions, paged_attention_reference, random_kv_cache  # noqa: E402

CPU = torch.device("cpu")
DEVICE = torch.device(DEVICE_NAME)


def _backend(block_size: int, window: int | None = None, device: torch.device = DEVICE):
    from kvflow.attention.backends.triton import TritonPagedAttention

    return TritonPagedAttention(block_size, window, device)


def _step(block_size: int, gen: torch.Generator, num_blocks: int = 64) -> list[SeqLayout]:
    """Decodes mid-block, at a block's first and last slot, a 1-token context, a long context (several
    key tiles), and chunks that
    start mid-context and cross block boundaries (one longer than a query tile), interleaved so
    the decode rows are not contiguous on the token axis."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = [
        (2 * block_size + 3, 1),
        (block_size - 5, block_size + 9),
        (0, 1),
        (block_size - 1, 1),
        (3, 37),
        (2 * block_size, 1),
        (0, 5),
        (5 * block_size + 7, 1),
    ]
    seqs, used = [], 0
    for start, new in shape:
        n = -(-(start + new) // block_size)
        seqs.append(SeqLayout(start, new, perm[used : used + n]))
        used += n
    return seqs


def _run(attn, seqs, heads, kv_heads, head_dim, kv_dtype, gen, dtype=torch.float32, torch_too=False):
    """One layer's step through `attn` on a random cache: (q, the cache after the write, output[,
    the torch backend's output on a copy of the same cache])."""
    host = _backend(attn.block_size, attn.sliding_window, CPU) if attn.device != CPU else attn
    cache = random_kv_cache(host, 64, kv_heads, head_dim, kv_dtype, gen, dtype)
    copy = LayerKVCache(cache.data.clone(), None if cache.scale is None else cache.scale.clone())
    t = sum(s.num_new for s in seqs)
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    kv = torch.randn(t, 2, kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    dev = LayerKVCache(cache.data.to(attn.device), None if cache.scale is None else cache.scale.to(attn.device))
    out = attn.forward(q.to(attn.device), kv.to(attn.device), dev, attn.build_metadata(seqs), scale).cpu()
    cache = LayerKVCache(dev.data.cpu(), None if dev.scale is None else dev.scale.cpu())
    if not torch_too:
        return q, cache, out
    ref = TorchPagedAttention(attn.block_size, attn.sliding_window, CPU)
    return q, cache, out, ref.forward(q, kv, copy, ref.build_metadata(seqs), scale)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 32), (8, 1, 64)])  # GQA 1, 3, 8
@pytest.mark.parametrize("window", [None, 7])
def test_kernels_match_float64(kv_dtype, block_size, heads, kv_heads, head_dim, window):
    gen = torch.Generator().manual_seed(heads * 1000 + block_size + head_dim)
    seqs = _step(block_size, gen)
    q, cache, out, torch_out = _run(
        _backend(block_size, window), seqs, heads, kv_heads, head_dim, kv_dtype, gen, torch_too=True
    )
    ref = paged_attention_reference(q, cache, seqs, block_size, head_dim**-0.5, window)
    assert (out.double() - ref).abs().max() < 2e-5
    assert (out - torch_out).abs().max() < 2e-5  # and the torch backend on the same step agrees


def test_bfloat16_within_rounding():
    """bf16 queries and cache: float32 accumulation inside, one bf16 rounding of the output."""
    gen = torch.Generator().manual_seed(7)
    seqs = _step(16, gen)
    q, cache, out = _run(_backend(16), seqs, 6, 2, 32, "auto", gen, dtype=torch.bfloat16)
    ref = paged_attention_reference(q, cache, seqs, 16, 32**-0.5, None)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 2e-2


def test_padding_rows_write_zeros_and_touch_no_real_block():
    """A decode row with context length 0 (a CUDA graph's padding) outputs zeros; its K/V goes to
    the spare block past the pool."""
    from kvflow.attention.backends.triton import TritonPagedAttention

    attn = TritonPagedAttention(16, None, DEVICE)
    gen = torch.Generator().manual_seed(3)
    cache = random_kv_cache(attn, 8, 2, 16, "auto", gen)
    before = cache.data[:8].clone()
    static = attn.static_decode_metadata(4, 3)
    q = torch.randn(4, 4, 16, generator=gen).to(DEVICE)
    kv = torch.randn(4, 2, 2, 16, generator=gen).to(DEVICE)
    out = attn.forward(q, kv, cache, static, 0.25)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(cache.data[:8], before)
    assert cache.data.shape[0] == 9 and attn.pad_slot == 8 * 16


# ---- planted bugs: each mutated copy of the kernels (every occurrence replaced) must fail the float64
# comparison ---------------------------------------------------------------------------------------
MUTATIONS = {
    "no online-softmax rescale": ("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"),
    "decode: no rescale": ("acc = acc * alpha[:, None] + tl.sum", "acc = acc + tl.sum"),
    "slot offset off by one": (
        "slot = page.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE",
        "slot = page.to(tl.int64) * BLOCK_SIZE + (n + 1) % BLOCK_SIZE",
    ),
    "causal mask excludes the diagonal": ("(n[None, :] <= q_pos[:, None])", "(n[None, :] < q_pos[:, None])"),
    "int8 V read with K's scale": ("scale_ptr + s_base + NUM_KV_HEADS", "scale_ptr + s_base"),
    "decode drops the last key": (
        "for start in range(lo, ctx, BLOCK_N):\n        n = start + tl.arange(0, BLOCK_N)\n        n_mask = n < ctx",
        "for start in range(lo, ctx, BLOCK_N):\n        n = start + tl.arange(0, BLOCK_N)\n"
        "        n_mask = n < ctx - 1",
    ),
    "GQA: wrong kv head for a query head": ("kvh = h // GROUP", "kvh = h % NUM_KV_HEADS"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_planted_bug_fails(mutation, tmp_path, monkeypatch):
    from kvflow.kernels.triton import attention_kernels

    old, new = MUTATIONS[mutation]
    source = inspect.getsource(attention_kernels)
    assert old in source, f"the mutation {mutation!r} no longer matches the kernel source"
    path = tmp_path / "mutant_kernels.py"
    path.write_text(source.replace(old, new))  # a file: Triton reads a kernel's source back
    spec = importlib.util.spec_from_file_location("mutant_kernels", path)
    mutant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutant)
    gen = torch.Generator().manual_seed(11)
    seqs = _step(16, gen)
    attn = _backend(16)
    monkeypatch.setattr(attn, "_kernels", mutant)
    q, cache, out = _run(attn, seqs, 6, 2, 32, "int8", gen)
    ref = paged_attention_reference(q, cache, seqs, 16, 32**-0.5, None)
    assert not (out.double() - ref).abs().max() < 1e-3  # (a NaN fails the comparison too)


# ---- in the engine ------------------------------------------------------------------------------
_BASE = [
    "The quick brown fox",
    "Once upon a time there was a little engine",
    "def hello(name):\n    return",
    "Paris is the capital of France. Berlin is",
]
# A shared prefix (a prefix-cache hit for the second request) and a prompt longer than the step
# budget of 32 tokens the tests use (chunked prefill).
PROMPTS = _BASE + [_BASE[1] + " that served", _BASE[0] * 6]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def _generate(path: str, **kw) -> tuple[list, object]:
    llm = LLM(path, num_kv_blocks=64, block_size=16, device=DEVICE_NAME, **kw)
    return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)], llm


@pytest.fixture(scope="module")
def torch_llama(tiny_llama):
    """The torch backend's completions of the tiny Llama (the reference of two tests below)."""
    return _generate(tiny_llama[0], attention_backend="torch", max_num_batched_tokens=32)[0]


@pytest.mark.parametrize("arch,kv_dtype", [("llama", "auto"), ("qwen3", "auto"), ("llama", "int8")])
def test_engine_greedy_matches_torch_backend(model_factory, torch_llama, arch, kv_dtype):
    path, _ = model_factory(arch)
    ref = (
        torch_llama
        if (arch, kv_dtype) == ("llama", "auto")
        else _generate(path, attention_backend="torch", kv_cache_dtype=kv_dtype, max_num_batched_tokens=32)[0]
    )
    outs, llm = _generate(path, attention_backend="triton", kv_cache_dtype=kv_dtype, max_num_batched_tokens=32)
    assert type(llm.engine.runner.attention).__name__ == "TritonPagedAttention"
    # An int8 cache rounds each written key/value to 1/127 of its head's scale: a difference of
    # 1e-7 in a float summation order can land a value on the other side of a rounding step, and that
    # step (not the attention) moves later logprobs by up to a few 1e-4 (seen 1.4e-4 on a Xeon).
    assert_same_completions(outs, ref, abs_tol=1e-3 if kv_dtype == "int8" else 1e-4)
    assert_no_leaks(llm.engine)


def test_decode_graph_buffers_pad_and_replay(tiny_llama, torch_llama):
    """The CUDA-graph path without a GPU: decode steps copied into static buffers padded to the
    next captured size and run from them (eagerly) give the torch backend's tokens."""
    from kvflow.worker.cuda_graphs import DecodeGraphs

    path, ref = tiny_llama[0], torch_llama
    llm = LLM(
        path,
        num_kv_blocks=64,
        block_size=16,
        attention_backend="triton",
        device=DEVICE_NAME,
        enforce_eager=True,
        max_num_batched_tokens=32,
    )
    runner = llm.engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.attention, runner.kv_caches, [1, 4, 8], 8, DEVICE, capture=DEVICE.type == "cuda"
    )
    used = []
    real_run = graphs.run
    graphs.run = lambda ids, meta: used.append(ids.shape[0]) or real_run(ids, meta)
    runner.decode_graphs = graphs
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    assert_same_completions(outs, ref, abs_tol=1e-4)
    assert 6 in used and any(n not in (1, 4, 8) for n in used)  # padded steps ran
    assert_no_leaks(llm.engine)


@pytest.mark.skipif(DEVICE_NAME != "cpu", reason="the CPU's backend choice")
def test_backend_choice_and_errors(monkeypatch):
    from kvflow.config import EngineConfig

    attn = make_attention_backend("triton", 16, None, CPU, torch.float32, 4, 2, 16)
    assert type(attn).__name__ == "TritonPagedAttention"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", 16, None, CPU, torch.float32, 4, 2, 16)
    assert (
        type(make_attention_backend("auto", 16, None, CPU, torch.float32, 4, 2, 16)).__name__ != "TritonPagedAttention"
    )
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            EngineConfig(device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=[0, 4])
    assert EngineConfig(max_num_seqs=20).graph_batch_sizes() == [1, 2, 4, 8, 16]
    assert EngineConfig(cuda_graph_sizes=["8", "2"], max_num_seqs=4).graph_batch_sizes() == [2]


@pytest.mark.server
@pytest.mark.skipif(DEVICE_NAME != "cpu", reason="the script itself runs on the GPU there")
def test_gpu_benchmark_script_smoke(tmp_path):
    """benchmarks/gpu_offline.py, the script a lent GPU runs, through every section at tiny sizes on
    the CPU: it finishes, reports each figure, and float32 greedy output equals HF's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_offline.py"), "--device", "cpu", "--smoke", "--out", str(out)],
        timeout=240,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["equiv"]["torch.float32"]["identical_sequences"] == "3/3"
    tput = res["throughput"]["smoke"]
    assert tput["kvflow"]["output_tokens"] == tput["hf"]["output_tokens"] > 0
    assert all(v["eager_ms"] > 0 and v["graphs_ms"] > 0 for k, v in res["graphs"].items() if k.startswith("batch"))
