"""Whole KV blocks under tensor parallelism: each rank holds its share of the KV heads of every
block, so a KV connector (the offload tiers) that reads or writes blocks on rank 0 needs every
rank's share. `TPBlockIO` is rank 0's side: it tells the workers which blocks (a `kv_read` /
`kv_write` message, ahead of the next step's), then gathers their shares into whole blocks, or
scatters a whole block's shares to them, over the group's gloo collectives. Blocks come out in
one rank's layout with the heads of all ranks in order, [n, layers, block_size, 2, kv_heads,
head_dim] (for quantized KV -- int8, fp8, int4 -- each rank's bytes in rank order); `serve_block_io` is a worker's side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvflow.worker.model_runner import ModelRunner


class TPBlockIO:
    # Its reads and writes are collectives: only the engine thread starts them, between steps (a
    # KV producer copies held blocks when the hold begins instead of reading them per fetch).
    collective = True

    def __init__(self, runner: ModelRunner, workers: Any) -> None:
        self.runner, self.workers = runner, workers
        self.size = runner.model.tp.size
        self.group = runner.model.tp.group
        shape = runner.kv_block_shape
        # The axis of [n, *kv_block_shape] the ranks' shares are stacked along: kv heads, or bytes.
        self.axis = 2 if runner.kv_caches[0].quantized else 4
        whole = list(shape)
        whole[self.axis - 1] *= self.size
        self.kv_block_shape = tuple(whole)
        self.kv_block_dtype = runner.kv_block_dtype

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        self.workers.kv_op("kv_read", blocks)
        mine = self.runner.read_blocks(blocks).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.gather(mine, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=self.axis)

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        self.workers.kv_op("kv_write", blocks)
        parts = [p.contiguous() for p in data.to(self.kv_block_dtype).chunk(self.size, dim=self.axis)]
        mine = torch.empty_like(parts[0])
        torch.distributed.scatter(mine, parts, src=0, group=self.group)
        self.runner.write_blocks(blocks, mine)


@torch.inference_mode()
def serve_block_io(runner: ModelRunner, op: str, blocks: list[int]) -> None:
    """A worker's part of rank 0's read_blocks (op "kv_read") or write_blocks ("kv_write")."""
    group = runner.model.tp.group
    if op == "kv_read":
        torch.distributed.gather(runner.read_blocks(blocks).contiguous(), None, dst=0, group=group)
    elif op == "kv_write":
        share = torch.empty((len(blocks), *runner.kv_block_shape), dtype=runner.kv_block_dtype)
        torch.distributed.scatter(share, None, src=0, group=group)
        runner.write_blocks(blocks, share)
    else:
        raise ValueError(f"unknown KV block operation {op!r}")
