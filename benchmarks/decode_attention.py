"""The paged-attention kernel alone: one layer's attention for `--rows` sequences of `--context`
tokens whose last `--chunk` are new (1: decode rows; the context: whole prompts, causal), on the
default model's shape (9 query heads, 3 KV heads, head_dim 64), with a warm cache or (`--caches
30`) rotating through one per layer; `--backend torch` runs the gather + SDPA reference path
instead of the native kernel. Prints microseconds per layer, x30 (one step of the default model)
and GFLOP/s (4 flops per query-head x key x dim: the scores and the weighted sum).

    python benchmarks/decode_attention.py --rows 32 --context 100 --kv-cache-dtype int8
    python benchmarks/decode_attention.py --rows 64 --context 300 --dtype bfloat16
    python benchmarks/decode_attention.py --rows 11 --context 186 --chunk 186 --backend torch

Two builds of the native kernel side by side (`--compare A B`: shared libraries, timed in turns
in one process, the order alternating round by round; prints each one's median and the median
(min-max) of the rounds' ratios B / A):

    python benchmarks/decode_attention.py --which     # this checkout's library (built if needed)
    git stash; cp $(python benchmarks/decode_attention.py --which) /tmp/a.so; git stash pop
    python benchmarks/decode_attention.py --compare /tmp/a.so $(python benchmarks/decode_attention.py --which)
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from kvflow.attention.backend import SeqLayout
from kvflow.attention.backends.cpu import CpuPagedAttention
from kvflow.attention.backends.torch import TorchPagedAttention
from kvflow.kernels.cpu import native, paged_attention

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # SmolLM2-135M


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's dtype (with --kv-cache-dtype auto: the cache's)",
    )
    ap.add_argument("--chunk", type=int, default=1, help="new tokens per sequence (1: decode)")
    ap.add_argument("--backend", choices=("native", "torch"), default="native")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument(
        "--caches",
        type=int,
        default=1,
        help="layers' caches to rotate through (30: as a decode step of the default model "
        "reads them, from memory rather than a warm cache)",
    )
    ap.add_argument("--which", action="store_true", help="print this checkout's native library path and exit")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two builds of the native library, in turns")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of --compare")
    args = ap.parse_args()
    if args.which:
        print(paged_attention._lib()._name)
        return

    bs = args.block_size
    if not 1 <= args.chunk <= args.context:
        ap.error(f"--chunk must be 1..--context ({args.context}), got {args.chunk}")
    per_seq = -(-args.context // bs) + 1
    attn = (CpuPagedAttention if args.backend == "native" else TorchPagedAttention)(bs, None, torch.device("cpu"))
    dtype = getattr(torch, args.dtype)
    caches = attn.allocate_kv_cache(args.caches, args.rows * per_seq, KV_HEADS, HEAD_DIM, dtype, args.kv_cache_dtype)
    g = torch.Generator().manual_seed(0)
    for cache in caches:
        if cache.scale is None:
            cache.data.copy_(torch.randn(cache.data.shape, generator=g).to(dtype))
        else:
            cache.data.copy_(torch.randint(-100, 100, cache.data.shape, generator=g))
            cache.scale.fill_(0.01)
    start = args.context - args.chunk
    seqs = [SeqLayout(start, args.chunk, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(args.rows)]
    meta = attn.build_metadata(seqs)
    q = torch.randn(args.rows * args.chunk, HEADS, HEAD_DIM, generator=g).to(dtype)

    def attend(cache) -> None:
        out = None
        for group in meta.groups:
            out = attn._attend(q, cache, group, HEAD_DIM**-0.5, out)

    def timed() -> list[float]:
        for i in range(20):
            attend(caches[i % len(caches)])
        times = []
        for i in range(args.iters):
            cache = caches[i % len(caches)]
            t = time.perf_counter()
            attend(cache)
            times.append(time.perf_counter() - t)
        return times

    keys = sum(p + 1 for p in range(start, args.context))  # per sequence: each new row's context
    flops = 4 * args.rows * HEADS * keys * HEAD_DIM
    kv = args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    if args.compare:
        libs = [ctypes.CDLL(path) for path in args.compare]
        medians: list[list[float]] = [[], []]
        for r in range(args.rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                # (typed by the kernel module's next call; its handle is cached, so dropped first)
                native._cache["paged_attention"] = libs[i]
                paged_attention._lib.cache_clear()
                medians[i].append(statistics.median(timed()))
        ratios = sorted(b / a for a, b in zip(*medians))
        a, b = (statistics.median(m) * 1e6 for m in medians)
        print(
            f"{args.rows} x {args.chunk} new of {args.context}-token contexts, KV {kv}, {args.rounds} rounds: "
            f"A {a:.0f} us a layer, B {b:.0f}, B/A {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
        )
        return
    times = timed()
    med = statistics.median(times)
    print(
        f"{args.backend}: {args.rows} x {args.chunk} new of {args.context}-token contexts, KV {kv}, {torch.get_num_threads()} "
        f"threads: median {med * 1e6:.0f} us a layer (min {min(times) * 1e6:.0f}), x{LAYERS} = "
        f"{med * LAYERS * 1e3:.2f} ms, {flops / med / 1e9:.1f} GFLOP/s"
    )


if __name__ == "__main__":
    main()
