"""How long the int8 projections of one batch-1 decode step take on their own: the default model's
120 projection shapes (30 layers x qkv, o, gate_up, down) through FBGEMM, each with its own random
weight (so weights stream from memory as in a real step), nothing else: once as bare calls of
torch's quantized op (`linear_with_input_q_dq_qweight_dq_output_fp32`, input already row-scaled),
once through `Int8Kernel` (native: FBGEMM called directly, per-token quantization and rescale in
the same call). A floor for the int8 decode step, and a gauge of how fast the shared host is right
now (run it next to other figures).

    python benchmarks/int8_linear_floor.py
"""

from __future__ import annotations

import statistics
import time

import torch

from kvflow.kernels.cpu.int8_linear import Int8Kernel, activation_qparams, fbgemm_prepack
from kvflow.quantization.int8 import quantize_weight_per_channel

HIDDEN, INTER, Q, KV, LAYERS = 576, 1536, 576, 192, 30  # SmolLM2-135M


def main() -> None:
    torch.manual_seed(0)
    shapes = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS
    weights = [torch.randn(n, k) * 0.05 for n, k in shapes]
    kernels = [Int8Kernel(w, None) for w in weights]
    packed = [fbgemm_prepack(*quantize_weight_per_channel(w)) for w in weights]
    del weights
    inputs = [torch.randn(1, k) for _, k in shapes]
    scaled = [x / x.abs().amax() for x in inputs]
    op, (x_scale, x_zero_point) = (
        torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32,
        activation_qparams(),
    )

    def bare() -> None:
        for p, x in zip(packed, scaled):
            op(x, x_scale, x_zero_point, p)

    def through_kernel() -> None:
        for kern, x in zip(kernels, inputs):
            kern(x)

    mb = sum(k.nbytes for k in kernels) / 1e6
    print(
        f"{len(kernels)} int8 projections at batch 1 ({mb:.0f} MB of weights), {torch.get_num_threads()} threads, "
        f"Int8Kernel native: {kernels[0].native}"
    )
    for name, step in (("torch quantized op", bare), ("Int8Kernel", through_kernel)):
        for _ in range(5):
            step()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        print(
            f"  {name:<20} median {med * 1e3:.2f} ms (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}) "
            f"= {mb / 1e3 / med:.1f} GB/s"
        )


if __name__ == "__main__":
    main()
