"""Block tables, and the prefix cache on top of them.

Every full block gets a content hash chained from its parent's: sha256(parent hash, token ids,
extra key). Equal hashes mean equal KV (same model, same tokens at the same positions), so a new
request can share the blocks of its longest cached prefix and prefill only the rest.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.core.block_pool import BlockHash, BlockPool
from kvflow.core.request import Request


class OffloadIndex(Protocol):
    """The scheduler's view of the lower KV tiers: which hashes can be loaded (no tensors)."""

    def acquire(self, block_hash: BlockHash) -> bool: ...


@dataclass
class ComputedBlocks:
    """A request's cached prefix: blocks already in the pool, then blocks to load from a tier."""

    blocks: list[int] = field(default_factory=list)
    load_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.load_hashes)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: BlockHash | None, token_ids: list[int], extra_key: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_key)
    return h.digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 extra_key: bytes = b"", offload: OffloadIndex | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.extra_key = extra_key  # e.g. the model identity, so hashes never match across models
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: leading blocks registered in the cache
        self.prefix_stats = PrefixCacheStats()
        self.offload = offload if enable_caching else None
        # KV transfers for the model runner, collected while scheduling a step.
        self.pending_saves: list[tuple[int, BlockHash]] = []  # evicted cached blocks -> tiers
        self.pending_loads: list[tuple[int, BlockHash]] = []  # tiers -> newly allocated blocks
        if self.offload is not None:
            self.pool.on_evict = lambda block, h: self.pending_saves.append((block, h))

    # ---- prefix cache ----------------------------------------------------------------------
    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes to cover every full block among its first num_tokens tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     req.token_ids_between(i * bs, (i + 1) * bs), self.extra_key))

    def get_computed_blocks(self, req: Request) -> ComputedBlocks:
        """req's longest cached prefix: in the pool, then in the offload tiers (nothing is
        referenced yet; see allocate_slots). At least one token is always left to compute so
        there are logits to sample from."""
        found = ComputedBlocks()
        if not self.enable_caching:
            return found
        self._update_hashes(req, req.num_tokens)
        wanted = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        found.blocks = self.pool.lookup(wanted)
        if self.offload is not None:
            for h in wanted[len(found.blocks):]:
                if not self.offload.acquire(h):
                    break
                found.load_hashes.append(h)
        return found

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, computed: ComputedBlocks | None = None) -> bool:
        """Make room for num_new_tokens more tokens of req, after the cached prefix it reuses
        (`computed`, for a request being admitted). Returns False, changing nothing, if the
        pool is short."""
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
            new = self.pool.allocate(needed)
            table.extend(new)
            self.pending_loads.extend(zip(new, computed.load_hashes))
        if self.enable_caching:
            # Blocks that will be full of the sequence's own tokens once this step has run (loaded
            # ones included). Registering them now is safe: the runner loads before the forward
            # pass, and within the pass every layer writes all new K/V before any attention reads
            # it. Draft tokens (speculative decoding) lie past num_tokens: a block holding any is
            # registered only once verification has made its tokens the sequence's.
            full = min(total, req.num_tokens) // self.block_size
            self._update_hashes(req, full * self.block_size)
            start = max(self.num_cached_blocks.get(req.request_id, 0), len(computed.blocks))
            for i in range(start, full):
                self.pool.cache_block(table[i], req.block_hashes[i])
            self.num_cached_blocks[req.request_id] = max(start, full)
        return True

    def take_transfers(self) -> tuple[list[tuple[int, BlockHash]], list[tuple[int, BlockHash]]]:
        """The step's (saves, loads); saves must run first (a saved block may be a load target)."""
        saves, loads = self.pending_saves, self.pending_loads
        self.pending_saves, self.pending_loads = [], []
        return saves, loads

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
