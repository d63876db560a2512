"""The pool of fixed-size KV blocks: who holds which block, which are free, which are cached.

Pure bookkeeping on block ids; the tensors live in the model runner.

A block whose reference count drops to zero keeps its contents and its hash: it is "cached-free".
It sits in the free queue and can be revived by a request with the same prefix until the pool
needs it for new tokens, at which point it is evicted. The free queue is in LRU order: blocks are
taken from the front, and released blocks join the back, a request's tail blocks ahead of its
head (the head is the part most likely to be shared again).

With KV events on (`events`, a `KVEventSink`), each eviction of a cached block is reported as a
`BlockRemoved` of the pool ("GPU"); the `BlockStored` events come from the KV cache manager, which
knows the blocks' tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvflow.core.block_hash import BlockHash
from kvflow.kv_events.events import MEDIUM_GPU

if TYPE_CHECKING:
    from kvflow.kv_events.events import KVEventSink

HASH_LEN = 32  # a sha256 block hash; a hybrid layout's window groups key theirs longer (kv_cache_manager)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evicted = 0
        self._num_cached_free = 0  # free blocks that still hold a cached prefix
        self.num_reserved = 0  # blocks taken out of circulation (see reserve)
        # Called with (block id, hash) just before a cached block's contents are overwritten.
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        self.events: KVEventSink | None = None  # KV events: None (off) costs nothing

    def reserve(self, block: int) -> None:
        """Take `block` out of circulation for good (the hybrid layout's NULL_BLOCK: freed table
        entries point at it; never written, so it stays zero). It counts as held."""
        if self.num_blocks < 2:
            raise ValueError("a KV pool with a reserved null block needs at least two blocks")
        del self._free[block]
        self.ref_counts[block] = 1
        self.num_reserved += 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds: truly free plus cached-free."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        evicted: list[BlockHash] = []
        for _ in range(count):
            b, _ = self._free.popitem(last=False)
            h = self.block_hashes[b]
            if h is not None:
                if self.on_evict is not None and len(h) == HASH_LEN:
                    self.on_evict(b, h)
                del self.cached[h]
                self.block_hashes[b] = None
                self.num_evicted += 1
                self._num_cached_free -= 1
                if len(h) == HASH_LEN:  # (a window group's keys are longer: not the prefix cache's events)
                    evicted.append(h)
            self.ref_counts[b] = 1
            blocks.append(b)
        if evicted and self.events is not None:
            self.events.removed(evicted, MEDIUM_GPU)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference on blocks found in the cache (reviving cached-free ones)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
                self._num_cached_free -= self.block_hashes[b] is not None
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            rc = self.ref_counts[b] - 1
            if rc < 0:
                raise RuntimeError(f"KV block {b} released more often than it was held")
            self.ref_counts[b] = rc
            if rc == 0:
                self._free[b] = None
                self._num_cached_free += self.block_hashes[b] is not None

    # ---- prefix cache ----------------------------------------------------------------------
    def cache_block(self, block: int, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its content hash (first writer wins). True when
        the hash entered the cache now."""
        if not self.enable_caching or self.block_hashes[block] is not None or block_hash in self.cached:
            return False
        self.cached[block_hash] = block
        self.block_hashes[block] = block_hash
        return True

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks of the longest cached run of `hashes` from the start."""
        found = []
        if self.enable_caching:
            for h in hashes:
                b = self.cached.get(h)
                if b is None:
                    break
                found.append(b)
        return found

    def usage(self) -> float:
        """Share of the pool held by running requests, in [0, 1] (reserved blocks left out)."""
        return 1.0 - len(self._free) / (self.num_blocks - self.num_reserved)

    def check_consistency(self) -> None:
        """Debug/test helper: free queue, reference counts and the hash map agree."""
        for b, rc in enumerate(self.ref_counts):
            if rc < 0 or (rc == 0) != (b in self._free):
                raise AssertionError(f"block {b}: ref count {rc} but free={b in self._free}")
        for h, b in self.cached.items():
            if self.block_hashes[b] != h:
                raise AssertionError(f"hash map points at block {b}, which holds another hash")
        if sum(h is not None for h in self.block_hashes) != len(self.cached):
            raise AssertionError("a block carries a hash the map does not know")
        if sum(self.block_hashes[b] is not None for b in self._free) != self._num_cached_free:
            raise AssertionError("cached-free block count is off")
