"""Two builds of the native linear library (the linears and the fused decode pass) side by side in
one process: an engine on the default model for each, the same greedy decode run on each in turn
(the order alternating round by round). Prints each build's median decode tok/s and median time of
the decode pass per step, and the medians (min-max) of the per-round ratios B / A. Separate runs on
a shared host drift by +-10-25%; two engines in one process, timed in turns, show a few percent.
(benchmarks/block_linear_ab.py does the same for the block kernels alone.)

    python benchmarks/block_linear_ab.py --which      # this checkout's library (built if needed)
    git stash; A=$(python benchmarks/block_linear_ab.py --which); cp $A /tmp/a.so; git stash pop
    python benchmarks/decode_pass_ab.py /tmp/a.so $(python benchmarks/block_linear_ab.py --which) --batch 1
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu import native


class TimedPass:
    """The decode pass kernel with each call's wall time appended to `seconds`."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.seconds: list[float] = []

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.kernel(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - t0)

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)


def engine_on(library: str, max_model_len: int, **engine_args) -> tuple[LLM, TimedPass]:
    """An engine whose native kernels come from `library`, and its timed decode pass."""
    native._cache["linear"] = ctypes.CDLL(library)
    try:
        llm = LLM(max_model_len=max_model_len, num_kv_blocks=max(1024, max_model_len // 4), **engine_args)
    finally:
        native._cache.pop("linear", None)
    fused = llm.engine.executor.runner.model.native_decode
    if fused is None:
        raise SystemExit("the default model does not run the native decode pass here")
    fused.kernel = TimedPass(fused.kernel)
    return llm, fused.kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="shared library A (the baseline)")
    ap.add_argument("b", help="shared library B")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together")
    ap.add_argument("--context", type=int, default=0, help="prompt tokens (0: a short chat prompt)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--dtype", default=None, help="the engines' --dtype (default: the engine's)")
    ap.add_argument("--quantization", default=None, help="the engines' --quantization (e.g. int8)")
    args = ap.parse_args()
    engine_args = {k: v for k, v in (("dtype", args.dtype), ("quantization", args.quantization)) if v is not None}
    max_len = args.context + args.max_tokens + 64
    builds = {"A": engine_on(args.a, max_len, **engine_args), "B": engine_on(args.b, max_len, **engine_args)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.context:
        prompts = [
            {"prompt_token_ids": [(7 * i + 13 * j) % 30000 + 100 for j in range(args.context)]}
            for i in range(args.batch)
        ]
    else:
        prompts = [f"Tell me a story about dragon number {i}." for i in range(args.batch)]

    def decode(name: str) -> tuple[float, float]:
        llm, timed = builds[name]
        timed.seconds.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        return tokens / (last - first), statistics.median(timed.seconds)

    for name in builds:
        decode(name)  # warm: code, caches, the autotune's plan
    speed: dict[str, list[float]] = {"A": [], "B": []}
    pass_s: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            tok_s, seconds = decode(name)
            speed[name].append(tok_s)
            pass_s[name].append(seconds)
    print(
        f"A = {args.a}\nB = {args.b}\nbatch {args.batch}, context {args.context or 'a chat prompt'}, {args.rounds} rounds"
    )
    for label, values, unit, scale in (("decode tok/s", speed, "", 1.0), ("pass per step", pass_s, " ms", 1e3)):
        ratios = sorted(b / a for a, b in zip(values["A"], values["B"]))
        print(
            f"{label:14}: A {statistics.median(values['A']) * scale:8.3f}{unit}  B {statistics.median(values['B']) * scale:8.3f}{unit}"
            f"  B/A {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
        )


if __name__ == "__main__":
    main()
