"""Two builds of the block kernels side by side in one process: the matmuls of a default-model decode
step (30 layers x qkv, o, gate_up, down, each its own random Q4_1 weight so that the weights stream
from memory as in a real step, then the Q8_0 lm_head) at the given row counts, the two builds
alternating round by round. Prints each build's median and the median (min-max) of the per-round
ratios B / A. Separate runs on a shared host drift by +-10%; two libraries in one process, timed
in turns, show a 5% difference.

    python benchmarks/block_linear_ab.py --which      # this checkout's library (built if needed)
    git stash; A=$(python benchmarks/block_linear_ab.py --which); git stash pop
    python benchmarks/block_linear_ab.py $A $(python benchmarks/block_linear_ab.py --which) --rows 1,8,32
    python benchmarks/block_linear_ab.py --amx --rows 8,16,40,64,512   # one library: AMX-INT8 off (A), on (B)
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from kvflow.kernels.cpu import block_linear
from kvflow.kernels.norm import NormWeights
from kvflow.quantization.gguf_blocks import quantize

HIDDEN, INTER, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152  # SmolLM2-135M


def open_library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for fn, (argtypes, restype) in block_linear._SIGNATURES.items():
        if hasattr(lib, fn):  # (an older build may lack a newer function)
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
    return lib


def kernels(lib: ctypes.CDLL, blocks: dict) -> dict:
    """BlockQuantKernels over `blocks` that call `lib`."""
    return {name: [block_linear.BlockQuantKernel([b], lib=lib) for b in bs] for name, bs in blocks.items()}


def step(k: dict, x: torch.Tensor, norm: NormWeights) -> None:
    h = x
    for i in range(LAYERS):
        k["qkv"][i](h, norm=norm)
        h = k["o"][i](h, h)
        h = k["down"][i](k["gate_up"][i](h, norm=norm), h, silu_mul=True)
    k["lm_head"][0](h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", nargs="?", help="shared library A (the baseline)")
    ap.add_argument("b", nargs="?", help="shared library B")
    ap.add_argument("--which", action="store_true", help="print this checkout's library path and exit")
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--amx", action="store_true", help="A and B: this checkout's library, its AMX-INT8 tiles off / on")
    args = ap.parse_args()
    if args.which:
        print(block_linear.block_library()._name)
        return
    if args.amx:
        if not block_linear.block_amx():
            ap.error("this CPU (or KVFLOW_AMX=0) gives the block kernels no AMX-INT8 tiles")
        args.a = args.b = block_linear.block_library()._name
    if not (args.a and args.b):
        ap.error("give two libraries (or --which, or --amx)")
    torch.manual_seed(0)
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
    blocks = {name: [quantize(torch.randn(*s) * 0.05, "Q4_1") for _ in range(LAYERS)] for name, s in shapes.items()}
    blocks["lm_head"] = [quantize(torch.randn(VOCAB, HIDDEN) * 0.05, "Q8_0")]
    libs = {"A": open_library(args.a), "B": open_library(args.b)}
    builds = {name: kernels(lib, blocks) for name, lib in libs.items()}
    norm = NormWeights(torch.ones(HIDDEN), torch.ones(HIDDEN), 1e-5)
    print(f"A = {args.a}\nB = {args.b}\n{torch.get_num_threads()} threads; ms per step's matmuls")
    for m in (int(v) for v in args.rows.split(",")):
        x = torch.randn(m, HIDDEN) * 0.1
        times: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                if args.amx:
                    block_linear.block_amx(libs[name], enable=name == "B")
                step(builds[name], x, norm)  # warm: code, activations
                t0 = time.perf_counter()
                for _ in range(3):
                    step(builds[name], x, norm)
                times[name].append((time.perf_counter() - t0) / 3)
        ratios = sorted(b / a for a, b in zip(times["A"], times["B"]))
        print(
            f"rows {m:4d}: A {statistics.median(times['A']) * 1e3:8.3f}  B {statistics.median(times['B']) * 1e3:8.3f}"
            f"  B/A {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
