"""Block tables, and the prefix cache on top of them.

Every full block gets a content hash chained from its parent's: sha256(parent hash, token ids,
extra key). Equal hashes mean equal KV (same model, same tokens at the same positions), so a new
request can share the blocks of its longest cached prefix and prefill only the rest.

With KV events on (`events`), every run of blocks entered in the cache is reported as one
`BlockStored` (hashes, parent hash, token ids), evictions by the pool as `BlockRemoved`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.core.block_hash import hash_block
from kvflow.core.block_pool import BlockPool
from kvflow.core.request import Request

if TYPE_CHECKING:
    from kvflow.kv_events.events import KVEventSink


@dataclass
class ComputedBlocks:
    """A request's cached prefix: blocks already in the pool, then blocks a KV connector supplies
    (an offload tier, another engine) into fresh blocks."""

    blocks: list[int] = field(default_factory=list)
    num_external_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + self.num_external_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        extra_key: bytes = b"",
        events: KVEventSink | None = None,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.events = events  # KV events (None: off); the offload tiers report into it too
        self.pool.events = events
        self.enable_caching = enable_caching
        self.extra_key = extra_key  # e.g. the model identity, so hashes never match across models
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: leading blocks registered in the cache
        self.prefix_stats = PrefixCacheStats()

    # ---- prefix cache ----------------------------------------------------------------------
    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes to cover every full block among its first num_tokens tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(
                hash_block(hashes[-1] if hashes else None, req.token_ids_between(i * bs, (i + 1) * bs), self.extra_key)
            )

    def get_computed_blocks(self, req: Request) -> ComputedBlocks:
        """req's longest cached prefix in the pool (nothing is referenced yet; see allocate_slots).
        At least one token is always left to compute so there are logits to sample from. Also
        brings req.block_hashes up to date, for the KV connector's lookup after this one."""
        found = ComputedBlocks()
        if not self.enable_caching:
            return found
        self._update_hashes(req, req.num_tokens)
        found.blocks = self.pool.lookup(req.block_hashes[: (req.num_tokens - 1) // self.block_size])
        return found

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: ComputedBlocks | None = None, register: bool = True
    ) -> bool:
        """Make room for num_new_tokens more tokens of req, after the cached prefix it reuses
        (`computed`, for a request being admitted: its external blocks are the first new ones).
        Returns False, changing nothing, if the pool is short. `register=False`: do not enter
        the new full blocks in the prefix cache yet (their KV arrives asynchronously)."""
        computed = computed or ComputedBlocks()
        table = self.block_tables.get(req.request_id, [])
        num_computed = req.num_computed_tokens + computed.num_blocks * self.block_size
        total = num_computed + num_new_tokens
        needed = cdiv(total, self.block_size) - len(table) - len(computed.blocks)
        # Reviving cached-free blocks takes them out of the free queue too.
        revived = sum(1 for b in computed.blocks if self.pool.ref_counts[b] == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed.blocks)
        table = self.block_tables.setdefault(req.request_id, table)
        table.extend(computed.blocks)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        if self.enable_caching and register:
            # Blocks that will be full of the sequence's own tokens once this step has run (loaded
            # ones included). Registering them now is safe: the runner loads before the forward
            # pass, and within the pass every layer writes all new K/V before any attention reads
            # it. Draft tokens (speculative decoding) lie past num_tokens: a block holding any is
            # registered only once verification has made its tokens the sequence's.
            full = min(total, req.num_tokens) // self.block_size
            self._update_hashes(req, full * self.block_size)
            start = max(self.num_cached_blocks.get(req.request_id, 0), len(computed.blocks))
            self._cache_blocks(req, table, start, full)
            self.num_cached_blocks[req.request_id] = max(start, full)
        return True

    def _cache_blocks(self, req: Request, table: list[int], start: int, end: int) -> None:
        """Enter blocks [start, end) of req in the prefix cache (their hashes are computed)."""
        if self.events is None:
            for i in range(start, end):
                self.pool.cache_block(table[i], req.block_hashes[i])
            return
        run = start  # the first block of the current run of newly cached blocks
        for i in range(start, end + 1):
            if i < end and self.pool.cache_block(table[i], req.block_hashes[i]):
                continue
            if i > run:  # blocks [run, i) entered the cache: one event, a chain
                bs = self.block_size
                self.events.stored(
                    req.block_hashes[run:i],
                    req.block_hashes[run - 1] if run > 0 else None,
                    req.token_ids_between(run * bs, i * bs),
                    bs,
                )
            run = i + 1

    def register_loaded(self, req: Request) -> None:
        """Enter req's full blocks in the prefix cache once their asynchronously loaded KV is in."""
        table = self.block_tables.get(req.request_id, [])
        full = min(len(table), req.num_tokens // self.block_size)
        self._update_hashes(req, full * self.block_size)
        self._cache_blocks(req, table, 0, full)

    def hold(self, req: Request, key: str) -> None:
        """Keep a finished request's blocks under `key` (for a KV transfer); see release_held."""
        self.num_cached_blocks.pop(req.request_id, None)
        table = self.block_tables.pop(req.request_id, None)
        if table:
            self.block_tables[key] = table

    def release_held(self, key: str) -> None:
        table = self.block_tables.pop(key, None)
        if table:
            self.pool.release(table)

    def free(self, req: Request) -> None:
        self.num_cached_blocks.pop(req.request_id, None)
        table = self.block_tables.pop(req.request_id, None)
        if table:
            self.pool.release(table)

    def block_table(self, req: Request) -> list[int]:
        return self.block_tables[req.request_id]

    @property
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
