"""Decode-only steps replayed from CUDA graphs.

A decode step of a small model is dozens of kernel launches of a few microseconds of work each;
launching them from Python costs more than running them. At start-up the model runner captures
the model's forward pass (embedding to final norm; the logits and the sampler stay eager) once per
batch size in `sizes`, over static input buffers: the token ids here and the attention backend's
static metadata (its `static_decode_metadata`). A step of n decodes copies its inputs into those
buffers, pads them to the next captured size b >= n (padding rows attend to nothing and write their
K/V into a spare block) and replays graph b. The graphs share one memory pool, captured largest
first (as vLLM and nano-vllm do).

`capture=False` builds the same buffers and runs the same padded forward eagerly: how the tests
check the padding and buffer logic on a machine without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("kvflow")


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        attention,
        kv_caches: list,
        sizes: list[int],
        max_blocks: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        """`attention`: a backend with `static_decode_metadata`, `view_decode_metadata` and
        `copy_decode_metadata` (kvflow.attention.backends.triton.TritonPagedAttention);
        `max_blocks`: the widest block table a step can bring."""
        self.sizes = sorted(set(sizes))
        self.attention = attention
        self.max_blocks = max_blocks
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.static = attention.static_decode_metadata(top, max_blocks)
        # batch size -> a call that runs the padded forward and returns its hidden states
        self._replay: dict[int, Callable[[], torch.Tensor]] = {}
        start = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for b in reversed(self.sizes):
                meta = attention.view_decode_metadata(self.static, b)
                ids = self.input_ids[:b]

                def forward(ids=ids, meta=meta) -> torch.Tensor:
                    return model(ids, meta.positions, kv_caches, meta)

                if not capture:
                    self._replay[b] = forward
                    continue
                # Warm up off the capture (Triton compiles, cuBLAS picks its kernels), then capture.
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        forward()
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = forward()
                pool = graph.pool()

                def replay(graph=graph, out=out) -> torch.Tensor:
                    graph.replay()
                    return out  # the graph's own output buffer, refilled by each replay

                self._replay[b] = replay
        if capture:
            torch.cuda.synchronize(device)
            logger.info(
                "CUDA graphs: decode batch sizes %s captured in %.1f s",
                _ranges(self.sizes),
                time.perf_counter() - start,
            )

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def can_run(self, num_rows: int, table_width: int) -> bool:
        return num_rows <= self.max_batch and table_width <= self.max_blocks

    def run(self, input_ids: torch.Tensor, meta) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step of n = len(input_ids) rows, from the
        graph of the smallest captured batch >= n. `meta`: the step's own metadata (its tensors
        are copied into the static buffers)."""
        n = input_ids.shape[0]
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:b].zero_()
        self.attention.copy_decode_metadata(self.static, meta, b)
        return self._replay[b]()[:n]


def _ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ... {sizes[-1]} ({len(sizes)})"
