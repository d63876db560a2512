"""The prefix cache's lower tiers (CPU memory, then disk) as a connector.

Blocks the pool evicts are saved to the tiers by content hash; a request whose prefix misses the
pool but hits a tier gets those blocks loaded into fresh blocks in the same step, before the
forward pass (a synchronous load). The store itself is `offload_store.KVOffloadStore`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvflow.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker
from kvflow.kv_transfer.offload_store import KVOffloadStore, OffloadStats

if TYPE_CHECKING:
    from kvflow.core.kv_cache_manager import KVCacheManager
    from kvflow.core.request import Request


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    # (block id, content hash); saves run first: a saved block may be this step's load target.
    saves: list[tuple[int, bytes]] = field(default_factory=list)
    loads: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.saves and not self.loads


class OffloadConnectorScheduler(KVConnectorScheduler):
    def __init__(self, store: KVOffloadStore, block_size: int) -> None:
        self.store = store  # only its index is used here: acquire() is metadata
        self.block_size = block_size
        self._saves: list[tuple[int, bytes]] = []
        self._loads: list[tuple[int, bytes]] = []
        self._matched: dict[str, list[bytes]] = {}
        self._kv_cache: KVCacheManager | None = None

    def bind(self, kv_cache: KVCacheManager) -> None:
        self._kv_cache = kv_cache
        kv_cache.pool.on_evict = lambda block, h: self._saves.append((block, h))
        if kv_cache.events is not None:  # KV events: the tiers report into the pool's sink
            self.store.set_event_sink(kv_cache.events, self.block_size)

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        # At least one token is left to compute, so there are logits to sample from.
        start, end = num_computed_tokens // self.block_size, (req.num_tokens - 1) // self.block_size
        hashes = []
        for h in req.block_hashes[start:end]:
            if not self.store.acquire(h):
                break
            hashes.append(h)
        self._matched[req.request_id] = hashes
        return len(hashes) * self.block_size, False

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_external_tokens: int) -> None:
        hashes = self._matched.pop(req.request_id, [])
        self._loads.extend(zip(block_ids, hashes[: num_external_tokens // self.block_size]))

    def build_connector_meta(self) -> OffloadMetadata:
        meta = OffloadMetadata(self._saves, self._loads)
        self._saves, self._loads = [], []
        self._matched.clear()  # matched but not admitted: the store drops their staged reads
        return meta

    def build_shutdown_meta(self) -> OffloadMetadata:
        """Save every cached block of the pool (a disk tier then serves the next run)."""
        pool = self._kv_cache.pool
        return OffloadMetadata(saves=[(b, h) for b, h in enumerate(pool.block_hashes) if h is not None])


class OffloadConnectorWorker(KVConnectorWorker):
    def __init__(self, store: KVOffloadStore) -> None:
        self.store = store

    def start_load_kv(self, meta: OffloadMetadata) -> None:
        for i in range(0, len(meta.saves), 64):  # bounded copies at shutdown, when every block is saved
            chunk = meta.saves[i : i + 64]
            for (_, h), block in zip(chunk, self.io.read_blocks([b for b, _ in chunk])):
                self.store.store(h, block)
        if meta.loads:
            data = torch.stack([self.store.load(h) for _, h in meta.loads])
            self.io.write_blocks([b for b, _ in meta.loads], data)
        self.store.end_step()

    def shutdown(self) -> None:
        self.store.persist()

    def stats(self) -> OffloadStats:
        return self.store.stats
