"""Where a serving workload's engine time goes, offline: `benchmarks/serve_peers.py`'s requests
(sharegpt-like, 64 at once, seeded) added to one `LLMEngine` and stepped to the end, each step timed
and binned by kind (decode-only, or carrying prefill chunks) and by the requests running when it
began (rounded up to a power of two; the first step, which admits them, counts as 1). No HTTP, no client: set its output tok/s beside serve_peers' to see what the server costs.

    python benchmarks/serve_replay.py --model DIR [--dtype bfloat16] [--kv-cache-dtype auto] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> int:
    from kvflow import LLM, SamplingParams
    from kvflow.bench.datasets import WorkloadSpec, generate_requests
    from kvflow.bench.report import cpu_line

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded GGUF)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=4)  # as serve_peers.py's servers
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    print(cpu_line())
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_model_len=args.max_model_len,
    )
    engine = llm.engine
    reqs = generate_requests(
        WorkloadSpec(dataset="sharegpt-like", num_prompts=args.num_prompts, seed=args.seed, token_ids=True),
        engine.tokenizer,
    )
    for r in reqs:
        engine.add_request(None, r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
    bins: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        decode_only = not sched.waiting and all(r.num_computed_tokens == r.num_tokens - 1 for r in sched.running)
        rows = max(1, len(sched.running))
        t = time.perf_counter()
        engine.step()
        bins[("decode" if decode_only else "with prefill", 1 << (rows - 1).bit_length())].append(
            time.perf_counter() - t
        )
    total = time.perf_counter() - t0
    out = sum(r.output_len for r in reqs)
    print(
        f"{args.dtype} (KV {engine.config.kv_cache_dtype}): {len(reqs)} requests, {sum(r.prompt_len for r in reqs)} prompt / {out} output tokens in "
        f"{total:.1f} s = {out / total:.1f} output tok/s"
    )
    print("\n| steps | running (up to) | count | seconds | share | ms/step |\n|---|---|---|---|---|---|")
    for (kind, rows), ts in sorted(bins.items()):
        print(
            f"| {kind} | {rows} | {len(ts)} | {sum(ts):.1f} | {100 * sum(ts) / total:.0f}% | "
            f"{1e3 * sum(ts) / len(ts):.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
