"""How long the int8 projections of one batch-1 decode step take on their own: the default model's
120 projection shapes (30 layers x qkv, o, gate_up, down) through FBGEMM, each with its own random
weight (so weights stream from memory as in a real step), nothing else: once as the bare FBGEMM
calls, once through `Int8Kernel` (which also scales each input row and the output). A floor for the
int8 decode step, and a gauge of how fast the shared host is right now (run it next to other figures).

    python benchmarks/int8_linear_floor.py
"""

from __future__ import annotations

import statistics
import time

import torch

from kvflow.layers.linear import make_linear_kernel

HIDDEN, INTER, Q, KV, LAYERS = 576, 1536, 576, 192, 30  # SmolLM2-135M


def main() -> None:
    torch.manual_seed(0)
    shapes = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS
    kernels = [make_linear_kernel("int8", torch.randn(n, k) * 0.05) for n, k in shapes]
    inputs = [torch.randn(1, k) for _, k in shapes]

    scaled = [x / x.abs().amax() for x in inputs]

    def bare() -> None:
        for kern, x in zip(kernels, scaled):
            kern._op(x, kern.x_scale, kern.x_zero_point, kern.packed)

    def through_kernel() -> None:
        for kern, x in zip(kernels, inputs):
            kern(x)

    mb = sum(k.nbytes for k in kernels) / 1e6
    print(f"{len(kernels)} int8 projections at batch 1 ({mb:.0f} MB of weights), {torch.get_num_threads()} threads")
    for name, step in (("bare FBGEMM calls", bare), ("through Int8Kernel", through_kernel)):
        for _ in range(5):
            step()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        print(f"  {name:<20} median {med * 1e3:.2f} ms (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}) "
              f"= {mb / 1e3 / med:.1f} GB/s")


if __name__ == "__main__":
    main()
