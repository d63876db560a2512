"""CPU speed of the default model through each linear backend / KV dtype, side by side.

    python benchmarks/cpu_speed.py                  # all eight modes
    python benchmarks/cpu_speed.py --modes int8,int8+kv8 --skip-throughput --breakdown-batches 1

Modes: fp32 (the default: per shape and row count the path the kernel autotune chose), fp32-mkl
(plain F.linear, i.e. MKL sgemm), fp32-onednn (oneDNN's blocked layout), fp32-native (the native
GEMV and its fused decode pass at every row count), bf16 / bf16-native (bfloat16 weights and KV
cache: the autotune's choice, or the native kernels at every row count), int8 (W8A8 through
FBGEMM), int8+kv8 (int8 weights and int8 KV cache), gguf (the GGUF's own blocks, Q4_1 and Q8_0, through the block kernels),
int4 (the float weights rounded into Q4_1 blocks at load). The fp32 and int8 modes load the GGUF
dequantized. All the engines are loaded at once
and the short measurements go round-robin over them (`--rounds`, median reported), so the drift
of a shared machine falls on every mode alike:

* batch-1 decode tok/s: one request alone (32-token prompt), 64 greedy tokens, decode steps only;
* prefill tok/s: one 512-token prompt, max_tokens=1 (whole engine steps, first token included);
* offline throughput: 64 requests submitted at once through LLM.generate, prompts 32-256 tokens
  (uniform), outputs 5-256 tokens (log-normal quantiles, median 87), ignore_eos, seeded; output
  tok/s over the whole run;
* where a decode step's time goes, at batch 1 and 32 (`--breakdown-context` prompt tokens, 100 by
  default): matmuls (every projection + lm_head, per-token activation quantization included; int8
  also runs the RMSNorms and silu*mul inside its projection calls), attention (cache write, then the native decode kernel
  or gather + SDPA), other model ops (norms, rotary, residuals, activation, embedding), attention
  metadata, sampling, the rest of the runner and the engine outside it (scheduler, outputs,
  detokenize). Measured by timing wrappers around those pieces (~0.5 us each), not the profiler.
  Where the native kernels serve them (int8; fp32 up to the autotune's row limit) decode steps run
  all decoder layers in one native call
  (kvflow.models.decode_pass), timed as one piece and, inside it, per phase by the native code
  (omp_get_wtime); its table is followed by one of the same engine on the per-layer path.

The machine is shared: the script prints the load average and, per mode, the CPU time other
processes used while it was measured ("foreign", in cores); figures with foreign > 0.1 are suspect.
Other tenants of the host are not visible that way: run it twice.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from kvflow.worker.machine_load import ForeignLoad

_FLOAT = {"gguf_weights": "dequantize"}
MODES = {
    "fp32": (_FLOAT, None),
    "fp32-mkl": (_FLOAT, "dense"),
    "fp32-onednn": (_FLOAT, "onednn"),
    "fp32-native": (_FLOAT, "native"),
    "bf16": ({**_FLOAT, "dtype": "bfloat16"}, None),
    "bf16-native": ({**_FLOAT, "dtype": "bfloat16"}, "native"),
    "int8": ({"quantization": "int8"}, None),
    "int8+kv8": ({"quantization": "int8", "kv_cache_dtype": "int8"}, None),
    "gguf": ({}, None),
    "int4": ({"quantization": "int4"}, None),
}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# ---- workloads ---------------------------------------------------------------------------------
class Prompts:
    def __init__(self, tokenizer, seed: int) -> None:
        from kvflow.bench.datasets import PromptBuilder

        self.builder = PromptBuilder(tokenizer)
        self.rng = np.random.default_rng(seed)

    def ids(self, n: int) -> list[int]:
        return self.builder.build(n, self.rng, token_ids=True)[0]


def workload_lengths(n: int, seed: int) -> tuple[list[int], list[int]]:
    """Prompt lengths uniform on 32-256; output lengths on 5-256 with median exactly 87: the
    quantiles (i + 0.5) / n of a log-normal (sigma 1, median 87) whose halves are each truncated
    to the range (as kvflow.bench's sharegpt-like workload), shuffled with the seed."""
    from statistics import NormalDist

    rng = np.random.default_rng(seed)
    ins = rng.integers(32, 257, size=n)
    mu, sigma, lo, hi = np.log(87), 1.0, 5, 256
    nd = NormalDist()
    lo_cdf, hi_cdf = nd.cdf((mu - np.log(lo)) / sigma), nd.cdf((np.log(hi) - mu) / sigma)
    outs = []
    for i in range(n):
        u = (i + 0.5) / n
        if u < 0.5:  # lower half: distance below the median, as a truncated half-normal quantile
            z = -nd.inv_cdf(0.5 + (0.5 - u) / 0.5 * (lo_cdf - 0.5))
        else:
            z = nd.inv_cdf(0.5 + (u - 0.5) / 0.5 * (hi_cdf - 0.5))
        # The two middle quantiles of an even n sit either side of the median: make them the median.
        outs.append(87 if abs(u - 0.5) < 1 / n else int(np.clip(np.rint(np.exp(mu + sigma * z)), lo, hi)))
    outs = [outs[j] for j in rng.permutation(n)]
    return [int(i) for i in ins], outs


def throughput_workload(prompts: Prompts, n: int, seed: int) -> list[tuple[list[int], int]]:
    ins, outs = workload_lengths(n, seed)
    return [(prompts.ids(i), o) for i, o in zip(ins, outs)]


def decode_tok_s(llm, prompt: list[int], new_tokens: int) -> float:
    """One request alone: greedy decode steps per second (the prefill step is not counted)."""
    from kvflow import SamplingParams

    eng = llm.engine
    eng.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True))
    eng.step()  # prefill + first token
    steps, t_total = 0, 0.0
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        t_total += time.perf_counter() - t
        steps += 1
    return steps / t_total


def prefill_tok_s(llm, prompt: list[int]) -> float:
    from kvflow import SamplingParams

    eng = llm.engine
    eng.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return len(prompt) / (time.perf_counter() - t)


def throughput(llm, work: list[tuple[list[int], int]]) -> tuple[float, float, float, int]:
    from kvflow import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in work]
    before = llm.engine.get_stats().num_preemptions
    with ForeignLoad() as fo:
        t = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return n_out / dt, len(work) / dt, fo.value, llm.engine.get_stats().num_preemptions - before


# ---- where a decode step's time goes -------------------------------------------------------------
class Timers:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        t = self.t

        def timed(*a, **k):
            s = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t[name] += time.perf_counter() - s

        return timed


class _TimedKernel:
    def __init__(self, kernel, timed) -> None:
        self._kernel, self._timed = kernel, timed
        self.backend = kernel.backend

    def __call__(self, x, residual=None, **fused):
        return self._timed(x, residual, **fused)


class _TimedPass:
    def __init__(self, native, timed) -> None:
        self._timed, self.max_rows = timed, native.max_rows

    def __call__(self, *a):
        return self._timed(*a)


def breakdown(
    llm, prompts: Prompts, batch: int, steps: int = 24, per_layer: bool = False, context: int = 100
) -> tuple[dict[str, float], float, float]:
    """ms per decode step by component, at `batch` concurrent decodes (`context`-token prompts, then
    ~30 more).
    per_layer: an int8 engine's decode steps take the per-layer path instead of the one-call native
    pass (whose layers cannot be timed piece by piece from Python)."""
    from kvflow import SamplingParams
    from kvflow.kernels.cpu.decode_pass import PHASES
    from kvflow.layers.linear import Linear

    eng, runner = llm.engine, llm.engine.runner
    model = runner.model
    timers = Timers()
    saved = []

    def patch(obj, attr, name):
        saved.append((obj, attr, obj.__dict__.get(attr, None), attr in obj.__dict__))
        setattr(obj, attr, timers.wrap(name, getattr(obj, attr)))

    for m in model.modules():
        if isinstance(m, Linear):
            saved.append((m, "kernel", m.kernel, True))
            m.kernel = _TimedKernel(m.kernel, timers.wrap("matmul", m.kernel))
    saved.append((model, "logits_kernel", model.logits_kernel, True))
    model.logits_kernel = _TimedKernel(model.logits_kernel, timers.wrap("lm_head", model.logits_kernel))
    patch(runner.attention, "forward", "attention")
    native = model.native_decode
    if per_layer:
        model.native_decode = None
    elif native is not None:
        model.native_decode = _TimedPass(native, timers.wrap("native layers", native))
    patch(runner.attention, "build_metadata", "metadata")
    patch(model, "forward", "model forward")
    patch(runner, "sampler", "sampling")
    patch(runner, "execute", "runner")

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(None, prompts.ids(context), params)
    while any(
        r.num_computed_tokens < len(r.prompt_token_ids)
        for r in list(eng.scheduler.running) + list(eng.scheduler.waiting)
    ):
        eng.step()
    for _ in range(3):
        eng.step()
    timers.t.clear()
    if native is not None and not per_layer:
        native.phase_seconds = torch.zeros(len(PHASES), dtype=torch.float64)
    with ForeignLoad() as fo:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t0
    measured = dict(timers.t)
    # The native pass's own phase times over the same steps (not the drain below).
    phase_totals = native.phase_seconds.tolist() if native is not None and native.phase_seconds is not None else None
    while eng.has_unfinished_requests():
        eng.step()
    for obj, attr, old, had in reversed(saved):
        if had:
            setattr(obj, attr, old)
        else:
            delattr(obj, attr)
    model.native_decode = native
    phases = {}
    if phase_totals is not None:
        phases = {f"  of which {name}": v * 1000 / steps for name, v in zip(PHASES, phase_totals)}
        native.phase_seconds = None
    t = defaultdict(float, {k: v * 1000 / steps for k, v in measured.items()})
    step_ms = wall * 1000 / steps
    parts = {
        "matmuls (projections + lm_head)": t["matmul"] + t["lm_head"],
        "attention (KV write, paged attention)": t["attention"],
        "decoder layers in one native call (the decode pass: all of the above but the lm_head)": t["native layers"],
        **phases,
        # forward = its projections (not the lm_head: that runs after it) + attention + the rest
        "other model ops (norms, rotary, residual, silu, embedding)": t["model forward"]
        - t["matmul"]
        - t["attention"]
        - t["native layers"],
        "attention metadata (once per step)": t["metadata"],
        "sampling": t["sampling"],
        "rest of the runner (input tensors, logits rows)": t["runner"]
        - t["model forward"]
        - t["lm_head"]
        - t["metadata"]
        - t["sampling"],
        "engine outside the runner (scheduler, outputs, detokenize)": step_ms - t["runner"],
    }
    return parts, step_ms, fo.value


# ---- main ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--breakdown-batches", default="1,32", help="e.g. 1,32 ('' to skip)")
    ap.add_argument("--breakdown-context", type=int, default=100, help="prompt tokens of each breakdown request")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the decode / prefill measurements")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV cache budget of each engine")
    args = ap.parse_args()

    from kvflow import LLM

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    batches = [int(b) for b in args.breakdown_batches.split(",") if b.strip()]
    print(
        f"# {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    # All engines stay loaded, and the short measurements go round-robin over them: the machine's
    # speed drifts (other tenants), and interleaving spreads the drift evenly over the modes.
    llms, load_s = {}, {}
    for mode in modes:
        kwargs, backend = MODES[mode]
        old_env = os.environ.pop("KVFLOW_LINEAR_BACKEND", None)
        if backend is not None:
            os.environ["KVFLOW_LINEAR_BACKEND"] = backend
        t = time.perf_counter()
        try:
            llms[mode] = LLM(args.model, max_model_len=2048, kv_cache_memory_gb=args.kv_cache_gb, **kwargs)
        finally:
            os.environ.pop("KVFLOW_LINEAR_BACKEND", None)
            if old_env is not None:
                os.environ["KVFLOW_LINEAR_BACKEND"] = old_env
        load_s[mode] = time.perf_counter() - t
    prompts = Prompts(llms[modes[0]].tokenizer, args.seed)
    dec: dict[str, list[float]] = defaultdict(list)
    pre: dict[str, list[float]] = defaultdict(list)
    foreign: dict[str, float] = defaultdict(float)
    for _ in range(args.rounds):
        p_dec, p_pre = prompts.ids(32), prompts.ids(args.prefill_len)
        for mode in modes:
            with ForeignLoad() as fo:
                dec[mode].append(decode_tok_s(llms[mode], p_dec, args.decode_tokens))
                pre[mode].append(prefill_tok_s(llms[mode], p_pre + [len(pre[mode])]))  # no prefix-cache hit
            foreign[mode] = max(foreign[mode], fo.value)
    tput: dict[str, tuple] = {}
    if not args.skip_throughput:
        work = throughput_workload(Prompts(llms[modes[0]].tokenizer, args.seed + 1), args.requests, args.seed)
        for mode in modes:
            tput[mode] = throughput(llms[mode], work)
            foreign[mode] = max(foreign[mode], tput[mode][2])
            print(f"# {mode}: throughput done", file=sys.stderr, flush=True)
    breakdowns = {}
    for b in batches:
        for mode in modes:
            breakdowns[mode, b] = breakdown(llms[mode], prompts, b, context=args.breakdown_context)
            if llms[mode].engine.runner.model.native_decode is not None:
                breakdowns[f"{mode} (per-layer path)", b] = breakdown(
                    llms[mode], prompts, b, per_layer=True, context=args.breakdown_context
                )
    rows = []
    for mode in modes:
        eng = llms[mode].engine
        t_ = tput.get(mode, (float("nan"), float("nan"), 0.0, 0))
        rows.append(
            (
                mode,
                eng.runner.linear_backend,
                eng.kv_bytes_per_token,
                load_s[mode],
                dec[mode],
                pre[mode],
                t_[0],
                t_[1],
                t_[3],
                foreign[mode],
            )
        )

    print()
    print(
        f"| mode | linear backend | KV bytes/token | load s | batch-1 decode tok/s | prefill {args.prefill_len} tok/s | "
        f"{args.requests} requests: output tok/s | req/s | preemptions | foreign CPU (max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    def med(v: list[float], fmt: str) -> str:
        return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"

    for mode, be, kvb, ld, d, p, tp, rps, preempt, fo in rows:
        print(
            f"| {mode} | {be} | {kvb} | {ld:.1f} | {med(d, '.1f')} | {med(p, '.0f')} | {tp:.1f} | {rps:.2f} | "
            f"{preempt} | {fo:.2f} |"
        )
    print(
        f"\n# decode and prefill: median (min-max) of {args.rounds} rounds, modes interleaved; decode = "
        f"{args.decode_tokens} greedy tokens after a 32-token prompt, one request alone"
    )
    for (mode, b), (parts, step_ms, fo) in breakdowns.items():
        print(
            f"\n{mode}, decode step at batch {b}: {step_ms:.2f} ms/step ({b * 1000 / step_ms:.1f} tok/s), "
            f"foreign CPU {fo:.2f}"
        )
        print("| component | ms/step | share |")
        print("|---|---|---|")
        for name, ms in parts.items():
            if ms > 0.004:
                print(f"| {name} | {ms:.2f} | {ms / step_ms:.0%} |")
    if not args.skip_throughput:
        ins, outs = workload_lengths(args.requests, args.seed)
        print(
            f"\n# throughput workload: {len(outs)} requests, prompts {min(ins)}-{max(ins)} tokens, outputs "
            f"{min(outs)}-{max(outs)} (median {statistics.median(outs):.0f}, total {sum(outs)})"
        )
    print(f"# load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
