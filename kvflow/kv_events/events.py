"""The KV cache events and the sink their sources write to.

The shapes are vLLM's (`vllm/distributed/kv_events.py`): a `BlockStored` names a run of blocks
just entered in the prefix cache (their hashes, the hash of the block before the first, their
token ids, the block size, the medium); a `BlockRemoved` names blocks that left a medium; an
`AllBlocksCleared` says the publisher's cache is empty. An engine step's events go out as one
`KVEventBatch`.

Media use vLLM's names: "GPU" is the engine's own KV pool, whatever its device (kvflow's default
device is the CPU: its pool is still "GPU"), "CPU" the CPU-memory offload tier, "DISK" the disk
tier. A hash may be in several media at once (a block loaded back from the CPU tier stays there).

Block hashes are kvflow's prefix-cache hashes (`kvflow.core.block_hash.hash_block`): 32-byte
sha256 digests chained from the parent's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEDIUM_GPU = "GPU"  # the engine's KV pool (vLLM's name for it, whatever the device)
MEDIUM_CPU = "CPU"  # the CPU-memory offload tier (--kv-offload-cpu-gb)
MEDIUM_DISK = "DISK"  # the disk tier (--kv-offload-disk-dir)
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)

BlockHash = bytes


@dataclass(slots=True)
class BlockStored:
    """Blocks entered in `medium`. In the pool ("GPU") they are a chain: `block_hashes[0]`'s parent
    is `parent_block_hash` (None: it starts the sequence), each next block's parent the one
    before, and `token_ids` holds their tokens, `block_size` per block. Blocks that reach a tier
    ("CPU", "DISK") move one by one: no token ids, no parent, and they are no chain."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks that left `medium` (evicted; the pool's may have moved to a tier, which says so)."""

    block_hashes: list[BlockHash]
    medium: str = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    """Every block of every medium is gone. kvflow sends it first, when an engine starts, so a
    subscriber that knew an earlier process of the same endpoint forgets what it held."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """One engine step's events, in the order they happened."""

    ts: float  # time.time() when the batch was made
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


class KVEventSink:
    """Where the event sources (the KV cache manager, the block pool, the offload tiers) put events
    as they happen; the engine takes them after each step and publishes them as one batch.

    Consecutive removals from one medium, and consecutive tier stores into one medium, are merged
    into one event (they carry no chain, so nothing is lost)."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def __len__(self) -> int:
        return len(self._events)

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def stored(
        self, block_hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int], block_size: int
    ) -> None:
        """A chain of blocks entered in the pool."""
        self._events.append(BlockStored(block_hashes, parent, token_ids, block_size, MEDIUM_GPU))

    def stored_in_tier(self, block_hash: BlockHash, block_size: int, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and last.medium == medium
            and last.parent_block_hash is None
            and not last.token_ids
        ):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockStored([block_hash], None, [], block_size, medium))

    def removed(self, block_hashes: list[BlockHash], medium: str) -> None:
        if not block_hashes:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.extend(block_hashes)
        else:
            self._events.append(BlockRemoved(list(block_hashes), medium))
