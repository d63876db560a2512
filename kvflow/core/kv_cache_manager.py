"""Block tables: which KV blocks each running sequence holds."""

from __future__ import annotations

from kvflow.core.block_pool import BlockPool
from kvflow.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if the pool is short."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request.request_id]
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.release(table)

    def block_table(self, request: Request) -> list[int]:
        return self.block_tables[request.request_id]

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
