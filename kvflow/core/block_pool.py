"""The pool of fixed-size KV blocks: who holds which block, and which are free.

Pure bookkeeping: block ids and reference counts. The tensors live in the model runner.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def retain(self, blocks: list[int]) -> None:
        """Share blocks with one more holder."""
        for b in blocks:
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one holder of each block; blocks nobody holds go back to the free list.

        Released in reverse so a sequence's tail blocks are reused first and its head (the part
        most likely to be shared later) stays intact longest.
        """
        for b in reversed(blocks):
            rc = self.ref_counts[b] - 1
            if rc < 0:
                raise RuntimeError(f"KV block {b} released more often than it was held")
            self.ref_counts[b] = rc
            if rc == 0:
                self._free.append(b)

    def usage(self) -> float:
        """Share of the pool held by running requests, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def check_consistency(self) -> None:
        """Debug/test helper: free list and reference counts agree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        for b, rc in enumerate(self.ref_counts):
            if (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: ref count {rc} but free={b in free}")
