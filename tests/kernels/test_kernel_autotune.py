"""The fp32 linear paths the kernel autotune chooses between, and the autotune's cache.

Every path (the native GEMV with its fused prologues, F.linear, oneDNN, and `TunedKernel` mixing
them by row count) is checked against a float64 recomputation; the native GEMV also for batch
invariance (a row's result is the same bit for bit whatever else the call holds). The cache: a
second plan reads the stored times without measuring, a different CPU measures again, and a torn
file is measured again rather than trusted.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import native
from kvflow.layers import linear_kernels
from kvflow.layers.linear_kernels import TunedKernel, make_linear_kernel, make_path_kernel
from kvflow.layers.norm import RMSNorm
from kvflow.worker import autotune, machine_load

pytestmark = pytest.mark.skipif(
    not linear_kernels.native_available(torch.float32), reason="no C++ compiler: the native fp32 linear cannot be built"
)

# Odd shapes: channels not a multiple of the 4-channel quad, features not a multiple of 8.
# (520, 96): enough full panel groups per thread for the one-row path's three and two streams
SHAPES = [(1, 8), (5, 13), (37, 64), (64, 77), (130, 200), (520, 96)]


def _ref(w, x, bias=None, residual=None):
    y = x.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    return y if residual is None else y + residual.double()


def _close(got, expect, k):
    # fp32 summation over k products: error grows ~ sqrt(k) * eps * |terms|
    tol = 1e-6 * (k**0.5 + 4) * (1 + expect.abs().max().item())
    assert (got.double() - expect).abs().max().item() <= tol


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 17, 64])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_native_gemv_matches_float64(n, k, rows, wdtype):
    """bf16 weights: products of the bf16 values with float32 inputs (widened), or with the inputs
    rounded to bf16 (the CPU's bf16 dot product, `bf16_dot`): exact either way, so the float32
    tolerance holds against the reference of those values."""
    from kvflow.kernels.cpu.float_linear import bf16_dot

    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w, x = torch.randn(n, k, generator=g).to(wdtype), torch.randn(rows, k, generator=g)
    xr = x.bfloat16().float() if wdtype == torch.bfloat16 and bf16_dot() else x
    bias, res = torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    kern = make_path_kernel("native", w, bias)
    assert torch.equal(kern.dequantized_weight(), w)  # packing loses nothing
    _close(kern(x), _ref(w, xr, bias), k)
    _close(kern(x, res), _ref(w, xr, bias, res), k)
    # strided input (a view into a wider tensor) takes the same result
    wide = torch.randn(rows, k + 3, generator=g)
    wide[:, :k] = x
    _close(kern(wide[:, :k]), _ref(w, xr, bias), k)


@pytest.mark.parametrize("n,k", [(37, 64), (64, 77)])
def test_native_gemv_fused_prologues(n, k):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g)
    norm = RMSNorm(k, 1e-5, torch.float32, torch.device("cpu"))
    norm.weight.data = torch.rand(k, generator=g) + 0.5
    x = torch.randn(6, k, generator=g) * 3
    kern = make_path_kernel("native", w, None)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    _close(kern(x, norm=norm.kernel_args()), _ref(w, normed), k)
    gate_up = torch.randn(6, 2 * k, generator=g)
    act = F.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
    _close(kern(gate_up, silu_mul=True), _ref(w, act), k)
    with pytest.raises(ValueError, match="silu_mul takes gate and up"):
        kern(x, silu_mul=True)


def test_native_silu_mul_within_a_few_ulp_over_its_range():
    """The prologue's own vector exp: through an identity weight each output is silu(g) * u itself,
    set against float64 over gates from -100 to 100 (past exp's clamp), with a tail of 13 features."""
    k = 2 * 16 * 64 + 13
    gate = torch.linspace(-100, 100, k)
    up = torch.linspace(0.5, 2.0, k).flip(0)
    kern = make_path_kernel("native", torch.eye(k), None)
    got = kern(torch.cat([gate, up]).unsqueeze(0), silu_mul=True)[0].double()
    ref = F.silu(gate.double()) * up.double()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("n,k", [(130, 200), (520, 200), (130, 96)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_native_gemv_is_batch_invariant(wdtype, n, k):
    """(k = 96: bf16 through AMX tiles where the CPU has them, whose calls pad rows to 16.)"""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(n, k, generator=g).to(wdtype), torch.randn(21, k, generator=g)
    kern = make_path_kernel("native", w, None)
    together = kern(x)
    for r in range(21):
        assert torch.equal(kern(x[r : r + 1]), together[r : r + 1])
    assert torch.equal(kern(x[2:5]), together[2:5])
    assert torch.equal(kern(x[2:12]), together[2:12])  # (8-12 rows: one pass, half a group at a time)
    assert torch.equal(kern(x[3:20]), together[3:20])


def test_bf16_products_run_where_the_cpu_has_them():
    """AMX tiles where /proc/cpuinfo lists amx_bf16 (and the kernel asked Linux for them), vdpbf16ps
    where it lists avx512_bf16, widened weights elsewhere: what the README promises per CPU."""
    from kvflow.kernels.cpu.float_linear import bf16_amx, bf16_dot

    flags = set(native.cpu_id().split("|", 1)[1].split())
    assert bf16_dot() == ("avx512_bf16" in flags)
    assert bf16_amx() == ("amx_bf16" in flags and "amx_tile" in flags and "avx512_bf16" in flags)


@pytest.mark.parametrize("path", linear_kernels.candidates(torch.float32))
def test_every_candidate_path_matches_float64(path):
    g = torch.Generator().manual_seed(11)
    w, bias = torch.randn(96, 72, generator=g), torch.randn(96, generator=g)
    for rows in (1, 4, 33):
        x, res = torch.randn(rows, 72, generator=g), torch.randn(rows, 96, generator=g)
        kern = make_path_kernel(path, w, bias)
        _close(kern(x), _ref(w, x, bias), 72)
        _close(kern(x, res), _ref(w, x, bias, res), 72)


def test_tuned_kernel_dispatches_by_rows():
    """A mixed choice runs the named path per row count (first bucket >= rows; the last beyond)."""
    paths = linear_kernels.candidates(torch.float32)
    choice = {b: paths[i % len(paths)] for i, b in enumerate(linear_kernels.ROW_BUCKETS)}
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 24, generator=g)
    kern = TunedKernel(w, None, choice)
    buckets = sorted(choice)
    for rows in (1, 2, 3, 4, 5, 9, 16, 40, 64, 100):
        want = choice[next((b for b in buckets if b >= rows), buckets[-1])]
        assert kern.kernel_for(rows) is kern.paths[want]
        x = torch.randn(rows, 24, generator=g)
        _close(kern(x), _ref(w, x), 24)
    assert set(kern.paths) == set(choice.values())


class _Load:
    """Stands in for machine_load.ForeignLoad: reports `values` in turn (the last one repeated)."""

    values = [0.0]  # noqa: RUF012 (each test sets its own list)
    seen = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        i = min(_Load.seen, len(_Load.values) - 1)
        self.value, _Load.seen = _Load.values[i], _Load.seen + 1


def _plan(shapes, monkeypatch, tmp_path, cpu="cpu A", load=(0.0,)):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVFLOW_AUTOTUNE_DIR", raising=False)  # (the kernel cache's own place)
    monkeypatch.setattr(native, "cpu_id", lambda: cpu)
    monkeypatch.setattr(machine_load, "ForeignLoad", _Load)
    _Load.values, _Load.seen = list(load), 0
    return autotune.plan_kernels(shapes, shapes, torch.float32)


def test_autotune_times_again_under_load_and_never_stores_a_loaded_timing(monkeypatch, tmp_path):
    """Other processes busy while a shape is timed: timed again (each path keeping its best); a
    shape that never got an unloaded timing is used for this start but measured again at the next."""
    calls = []
    real = autotune.time_shape
    monkeypatch.setattr(autotune, "time_shape", lambda s, d, evict=None: calls.append(s) or real(s, d, evict))
    shapes = [(24, 16)]
    busy = _plan(shapes, monkeypatch, tmp_path, load=(1.5,))
    assert len(calls) == autotune.ATTEMPTS and busy.source == "measured"
    assert not list(tmp_path.glob("kernels/autotune-*.json"))  # nothing stored
    quiet_on_retry = _plan(shapes, monkeypatch, tmp_path, load=(1.5, 0.0))
    assert len(calls) == autotune.ATTEMPTS + 2 and quiet_on_retry.source == "measured"
    assert _plan(shapes, monkeypatch, tmp_path).source == "cache"  # that one was stored


def test_native_gemv_never_runs_past_the_last_bucket():
    """The last bucket's choice also runs prefill chunks of thousands of rows: a many-row path
    there even where the GEMV timed fastest at its rows."""
    last = linear_kernels.ROW_BUCKETS[-1]
    times = {b: {"native": 1e-6, "onednn": 2e-6, "dense": 3e-6} for b in linear_kernels.ROW_BUCKETS}
    chosen = autotune.choose(times)
    assert chosen[1] == "native" and chosen[last] == "onednn"
    assert autotune.choose({1: {"native": 1e-6}, last: {"native": 1e-6}})[last] == "native"  # nothing else timed


def test_autotune_cache_is_read_back_and_keyed_by_cpu(monkeypatch, tmp_path):
    shapes = [(24, 16), (16, 24)]
    calls = []
    real = autotune.time_shape
    monkeypatch.setattr(autotune, "time_shape", lambda s, d, evict=None: calls.append(s) or real(s, d, evict))
    first = _plan(shapes, monkeypatch, tmp_path)
    assert first.source == "measured" and sorted(calls) == sorted(shapes)
    for s in shapes:
        assert set(first.choices[s]) == set(linear_kernels.ROW_BUCKETS)
        paths = linear_kernels.candidates(torch.float32)
        assert all(first.choices[s][b] in paths for b in linear_kernels.ROW_BUCKETS)
    second = _plan(shapes, monkeypatch, tmp_path)
    assert second.source == "cache" and len(calls) == 2  # nothing measured again
    assert second.choices == first.choices
    # a decoder layer's qkv, o, gate_up, down: the pass limit is still to be timed on the model
    # (up to where native stayed among the timed paths), until one is stored for those shapes
    layer = [(48, 16), (16, 16), (64, 16), (16, 32)]
    unmeasured = _plan(layer, monkeypatch, tmp_path)
    bound = autotune.pass_bound(autotune._read(autotune.cache_path("float32"))["shapes"], layer)
    assert unmeasured.decode_pass_rows == bound and unmeasured.pass_unmeasured == (bound > 0)
    autotune.store_pass_rows(unmeasured, 8)
    stored = json.loads(autotune.cache_path("float32").read_text())
    assert stored["pass_rows"] == {autotune.layer_key(layer): 8}
    again = _plan(layer, monkeypatch, tmp_path)
    assert again.source == "cache" and not again.pass_unmeasured and again.decode_pass_rows == 8
    # one new shape: only it is measured, the others come from the file
    third = _plan([*shapes, (8, 8)], monkeypatch, tmp_path)
    assert third.source == "measured" and calls[-1:] == [(8, 8)]
    # another CPU: a different file, everything measured
    before = len(calls)
    other = _plan(shapes, monkeypatch, tmp_path, cpu="cpu B")
    assert other.source == "measured" and len(calls) == before + 2
    assert len(list(tmp_path.glob("kernels/autotune-*.json"))) == 2


def test_the_suites_timings_stay_out_of_the_kernel_cache(monkeypatch, tmp_path):
    """conftest points KVFLOW_AUTOTUNE_DIR at a directory of the run's own; without it the files are
    the kernel cache's."""
    import os
    from pathlib import Path

    assert autotune.cache_path("float32").parent == Path(os.environ["KVFLOW_AUTOTUNE_DIR"]) != native.cache_dir()
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVFLOW_AUTOTUNE_DIR")
    assert autotune.cache_path("float32").parent == native.cache_dir() == tmp_path / "kernels"


def test_autotune_ignores_a_torn_cache_file(monkeypatch, tmp_path):
    shapes = [(24, 16)]
    _plan(shapes, monkeypatch, tmp_path)
    path = autotune.cache_path("float32")
    path.write_text(path.read_text()[:20])
    again = _plan(shapes, monkeypatch, tmp_path)
    assert again.source == "measured"
    json.loads(path.read_text())  # rewritten whole


def test_pass_bound_and_measured_pass_rows(monkeypatch):
    """The pass is timed up to the last bucket (from 1, without a gap) where native was still timed;
    its limit is the last bucket where a fused step was no slower than the per-layer one."""
    layer = [(8, 8), (9, 9)]
    times = {s: {b: {"native": 1e-5, "onednn": 2e-5} for b in linear_kernels.ROW_BUCKETS} for s in layer}
    assert autotune.pass_bound(times, layer) == linear_kernels.ROW_BUCKETS[-1]
    del times[layer[1]][16]["native"]  # dropped as twice the best there
    assert autotune.pass_bound(times, layer) == 8
    del times[layer[0]][1]["native"]
    assert autotune.pass_bound(times, layer) == 0

    clock = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])
    calls = []

    def step(rows, fused):  # fused: 1 s a step up to 4 rows, then 3 s; per layer: 2 s
        calls.append((rows, fused))
        clock[0] += (1.0 if rows <= 4 else 3.0) if fused else 2.0

    assert autotune.measure_pass_rows(step, 64)[0] == 4
    assert max(r for r, _ in calls) == 8  # stopped at the first bucket the pass lost
    calls.clear()
    assert autotune.measure_pass_rows(step, 2)[0] == 2 and max(r for r, _ in calls) == 2


def test_engine_times_the_decode_pass_once(tiny_llama, monkeypatch, tmp_path):
    """The first start times decode steps both ways and stores the limit; the next reads it."""
    from kvflow import LLM

    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVFLOW_AUTOTUNE_DIR", raising=False)
    # (on tiny shapes the native GEMV may time out of the running: the pass is timed all the same)
    monkeypatch.setattr(autotune, "pass_bound", lambda times, layer: 8)
    monkeypatch.setattr(machine_load, "ForeignLoad", _Load)  # (another process's burst would keep it from the file)
    _Load.values, _Load.seen = [0.0], 0
    timed = []
    real = autotune.measure_pass_rows
    monkeypatch.setattr(autotune, "measure_pass_rows", lambda step, bound: timed.append(bound) or real(step, bound))
    first = LLM(model=tiny_llama[0], num_kv_blocks=64, max_model_len=64).engine.runner
    assert timed == [8] and not first.kernel_plan.pass_unmeasured
    rows = first.kernel_plan.decode_pass_rows
    assert first.model.native_decode.max_rows == rows  # the limit in force is the one measured
    plan = first.kernel_plan
    stored = json.loads(autotune.cache_path(plan.dtype, plan.weights_cold).read_text())
    assert stored["pass_rows"] == {autotune.layer_key(list(plan.pass_shapes)): rows}
    second = LLM(model=tiny_llama[0], num_kv_blocks=64, max_model_len=64).engine.runner
    assert len(timed) == 1 and second.kernel_plan.decode_pass_rows == rows


def test_autotune_off_uses_the_documented_default():
    plan = autotune.plan_kernels([(24, 16)], [(24, 16)], torch.float32, mode="off")
    assert plan.source == "default"
    assert plan.choices[(24, 16)] == linear_kernels.default_choice("float32")
    with pytest.raises(ValueError, match="kernel_autotune must be one of"):
        autotune.plan_kernels([(24, 16)], [(24, 16)], torch.float32, mode="fast")


def test_engine_reports_the_choice_and_config_validates(tiny_llama):
    from kvflow import LLM
    from kvflow.config import EngineConfig

    path, _ = tiny_llama
    llm = LLM(model=path, num_kv_blocks=16, max_model_len=64, kernel_autotune="off")
    stats = llm.engine.get_stats()
    assert stats.linear_kernels.startswith("linear kernels (default, float32)")
    assert "decode pass: up to 4 rows" in stats.linear_kernels
    with pytest.raises(ValueError, match="kernel_autotune must be one of on, off, got 'maybe'"):
        EngineConfig(kernel_autotune="maybe")


def test_make_linear_kernel_auto_without_plan_uses_default():
    w = torch.randn(12, 8)
    kern = make_linear_kernel("auto", w)
    assert isinstance(kern, TunedKernel)
    assert set(kern.paths) == set(linear_kernels.default_choice("float32").values())


def test_native_gemv_bf16_model_rows():
    """A bf16 model's rows in, bf16 out, and an RMSNorm whose weight is bf16 fused in: float32 maths
    on the bf16 values, rounded once."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(48, 40, generator=g).bfloat16()
    norm = RMSNorm(40, 1e-5, torch.bfloat16, torch.device("cpu"))
    norm.weight.data = (torch.rand(40, generator=g) + 0.5).bfloat16()
    x = (torch.randn(5, 40, generator=g) * 2).bfloat16()
    kern = make_path_kernel("native", w, None)
    y = kern(x, norm=norm.kernel_args())
    assert y.dtype == torch.bfloat16
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    expect = _ref(w, normed)
    # the output's bf16 rounding, and (bf16 dot product) the normed input's
    assert ((y.double() - expect).abs() <= 2**-7 * expect.abs() + 2**-8 * expect.abs().max()).all()


@pytest.mark.parametrize("path_env", [None, "dense", "onednn", "native"])
def test_bf16_engine_tracks_fp32_reference(model_factory, monkeypatch, path_env):
    """bf16 weights and KV through whichever bf16 path (the autotune's, or forced): each greedy
    token's logprob is within bf16 rounding of HF's float32 logprob for the same sequence, and
    each chosen token is near-optimal under float32 (exactness is promised for fp32 only; on a CPU
    without bf16 math this is the slow fallback, checked for correctness here)."""
    from kvflow import LLM, SamplingParams

    if path_env == "onednn" and "onednn" not in linear_kernels.candidates(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 path on this CPU (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)")
    if path_env is not None:
        monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", path_env)
    path, hf = model_factory("llama")
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=32, max_model_len=128)
    model = llm.engine.runner.model
    if path_env == "native":  # forced native: every decode step runs the fused pass over bf16 weights
        assert model.native_decode is not None and model.native_decode.max_rows > 1
    prompt = [5, 17, 33, 2, 90, 41, 7, 12]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1), use_tqdm=False
    )[0].outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].double(), -1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp[tok].logprob - row[tok].item()) < 0.1
        assert row.max().item() - row[tok].item() < 0.1


@pytest.mark.parametrize("path_env", ["dense", "onednn", "native"])
def test_every_fp32_path_keeps_hf_greedy_equivalence(model_factory, monkeypatch, path_env):
    """Whichever path the autotune picks, fp32 greedy output equals HF transformers'."""
    from kvflow import LLM, SamplingParams

    from conftest import hf_greedy

    if path_env not in linear_kernels.candidates(torch.float32):
        pytest.skip(f"{path_env} not available here")
    monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", path_env)
    path, hf = model_factory("qwen2")
    llm = LLM(path, num_kv_blocks=64, max_model_len=256)
    prompts = [[(7 * i + 3 * j) % 400 + 2 for j in range(5 + 9 * i)] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 20)
