"""How long the int8 projections of one batch-1 decode step take on their own: the default model's
120 projection shapes (30 layers x qkv, o, gate_up, down) through FBGEMM, each with its own random
weight (so weights stream from memory as in a real step), nothing else. A floor for the int8
decode step, and a gauge of how fast the shared host is right now (run it next to other figures).

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

    def step() -> None:
        for kern, x in zip(kernels, inputs):
            kern(x)

    for _ in range(5):
        step()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    mb = sum(k.nbytes for k in kernels) / 1e6
    med = statistics.median(times)
    print(f"{len(kernels)} int8 projections at batch 1 ({mb:.0f} MB of weights): median {med * 1e3:.2f} ms "
          f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}) = {mb / 1e3 / med:.1f} GB/s, "
          f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
