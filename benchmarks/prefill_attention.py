"""A prompt's attention alone: one layer's causal attention for a `--lengths` token prompt read from
the paged cache, through the native kernel's tiles (csrc/tiled_attention.h), its per-row path
(every query row on its own, as before tiles), and the torch backend's gather + SDPA; float32 and
bfloat16 caches; the default model's shape (9 query heads, 3 KV heads, head_dim 64) or
`--head-dim 128 --heads 32 --kv-heads 8` (Llama-3-8B's). Interleaved rounds, medians; prints
milliseconds per layer, x30 (the default model's 30 layers) and GFLOP/s (4 flops per query-head x
key x dim over the causal triangle).

    python benchmarks/prefill_attention.py --lengths 128,512,2048,4096 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvflow.attention.backend import SeqLayout
from kvflow.attention.backends.cpu import CpuPagedAttention
from kvflow.attention.backends.torch import TorchPagedAttention
from kvflow.kernels.cpu import paged_attention as kernel

LAYERS = 30  # SmolLM2-135M
PATHS = ("tiled", "per_row", "sdpa")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,512,2048,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="cache dtypes, comma-separated")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"of {PATHS}, comma-separated")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    paths = args.paths.split(",")
    if bad := [p for p in paths if p not in PATHS]:
        ap.error(f"--paths: unknown {bad}; choose from {PATHS}")
    bs, d = args.block_size, args.head_dim
    cpu = torch.device("cpu")
    native = CpuPagedAttention(bs, None, cpu)
    gather = TorchPagedAttention(bs, None, cpu)
    gen = torch.Generator().manual_seed(0)

    cases = []  # (dtype name, length, path, run)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for n in lengths:
            blocks = -(-n // bs)
            cache = native.allocate_kv_cache(1, blocks, args.kv_heads, d, dtype, "auto")[0]
            cache.data.copy_(torch.randn(cache.data.shape, generator=gen).to(dtype))
            seqs = [SeqLayout(0, n, torch.randperm(blocks, generator=gen).tolist())]
            q = torch.randn(n, args.heads, d, generator=gen)
            out = torch.empty(n, args.heads * d)
            g = native.build_metadata(seqs).groups[0]
            meta = gather.build_metadata(seqs)
            qd = q.to(dtype)

            def run_native(tiled, c=cache, g=g, q=q, out=out):
                kernel.paged_attention(
                    q, c.data, None, g.tables, g.context_lens, g.tokens, bs, None, d**-0.5, out, True, tiled=tiled
                )

            def run_sdpa(c=cache, meta=meta, qd=qd):
                o = None
                for grp in meta.groups:
                    o = gather._attend(qd, c, grp, d**-0.5, o)

            runs = {"tiled": lambda f=run_native: f(True), "per_row": lambda f=run_native: f(False), "sdpa": run_sdpa}
            for p in paths:
                cases.append((dtype_name, n, p, runs[p]))

    for _, _, _, run in cases:  # warm-up (and the kernel build)
        run()
    times: dict[tuple, list[float]] = {c[:3]: [] for c in cases}
    for _ in range(args.rounds):
        for dtype_name, n, p, run in cases:
            reps = max(1, int(2e8 / (n * n * args.heads * d)))  # ~ equal time per case
            t = time.perf_counter()
            for _ in range(reps):
                run()
            times[(dtype_name, n, p)].append((time.perf_counter() - t) / reps)

    print(
        f"heads {args.heads}/{args.kv_heads}, head_dim {d}, threads {torch.get_num_threads()}, medians of {args.rounds}"
    )
    print(f"{'cache':>9} {'tokens':>6} {'path':>8} {'ms/layer':>9} {'x30 ms':>8} {'GFLOP/s':>8} {'vs per_row':>10}")
    for (dtype_name, n, p), ts in times.items():
        med = statistics.median(ts)
        flops = 4 * args.heads * d * n * (n + 1) / 2
        base = times.get((dtype_name, n, "per_row"))
        ratio = f"{statistics.median(base) / med:.2f}x" if base else "-"
        print(
            f"{dtype_name:>9} {n:>6} {p:>8} {med * 1e3:>9.2f} {med * 1e3 * LAYERS:>8.1f} "
            f"{flops / med / 1e9:>8.1f} {ratio:>10}"
        )


if __name__ == "__main__":
    main()
