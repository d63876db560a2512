"""Lower KV tiers: bounded CPU memory, then a bounded directory on disk.

Blocks arrive here when the main pool evicts a cached block, keyed by the block's content hash;
a later request whose prefix misses the main pool but hits a tier gets the block loaded back
instead of recomputed. A disk tier outlives the process: files carry the model identity and the
block hash in their name and header and a checksum of the payload, are written atomically
(temp file + rename), and anything corrupt or foreign is skipped with a warning, never loaded.

Tier order: a block evicted from CPU memory moves to disk. A disk hit is read and verified during
the scheduler's lookup, before the hit is counted, and staged for the step's load.

With KV events on (`set_event_sink`), every block that enters or leaves a tier is reported:
`BlockStored` / `BlockRemoved` with medium "CPU" or "DISK" (no token ids: a tier knows hashes only).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvflow.kv_events.events import MEDIUM_CPU, MEDIUM_DISK, KVEventSink

logger = logging.getLogger("kvflow")

_MAGIC = b"KVFLOWKV"
_VERSION = 1
# magic, version, identity (32 bytes), block hash (32), payload sha256 (32), payload bytes, dtype name
_HEADER = struct.Struct("<8sI32s32s32sQ16s")


@dataclass
class TierStats:
    stored: int = 0  # blocks written into this tier
    hits: int = 0  # lookups answered by this tier
    evicted: int = 0  # blocks pushed out (to the next tier or dropped)
    rejected: int = 0  # corrupt or foreign files skipped (disk)


@dataclass
class OffloadStats:
    cpu: TierStats = field(default_factory=TierStats)
    disk: TierStats = field(default_factory=TierStats)
    loaded: int = 0  # blocks copied back into the main pool


class KVOffloadStore:
    def __init__(
        self,
        identity: bytes,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        cpu_bytes: int,
        disk_dir: str | None = None,
        disk_bytes: int = 0,
    ) -> None:
        self.identity = hashlib.sha256(identity).digest()
        self.block_shape = block_shape
        self.dtype = dtype
        self.block_bytes = torch.empty(block_shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        self.cpu_capacity = cpu_bytes // self.block_bytes
        self.cpu: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.disk_dir = Path(disk_dir) if disk_dir else None
        self.disk_capacity = disk_bytes // self.block_bytes if disk_dir else 0
        self.disk: OrderedDict[bytes, Path] = OrderedDict()  # LRU order
        self._staged: dict[bytes, torch.Tensor] = {}  # read from disk, waiting for this step's load
        self.stats = OffloadStats()
        self._events: KVEventSink | None = None
        self._block_size = 0
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._scan_disk()

    def set_event_sink(self, events: KVEventSink, block_size: int) -> None:
        """Report tier changes to `events` from now on, starting with what the tiers hold (a disk
        tier's blocks from earlier runs)."""
        self._events, self._block_size = events, block_size
        for h in self.cpu:
            events.stored_in_tier(h, block_size, MEDIUM_CPU)
        for h in self.disk:
            events.stored_in_tier(h, block_size, MEDIUM_DISK)

    def _stored(self, block_hash: bytes, medium: str) -> None:
        if self._events is not None:
            self._events.stored_in_tier(block_hash, self._block_size, medium)

    def _removed(self, block_hash: bytes, medium: str) -> None:
        if self._events is not None:
            self._events.removed([block_hash], medium)

    @property
    def enabled(self) -> bool:
        return self.cpu_capacity > 0 or self.disk_capacity > 0

    # ---- lookups (metadata only, from the scheduler side) ---------------------------------------
    def acquire(self, block_hash: bytes) -> bool:
        """True if the block can be loaded in this step: it is in CPU memory, or was just read and
        verified from disk (a bad file is a miss, decided before the scheduler counts a hit)."""
        if block_hash in self.cpu:
            self.cpu.move_to_end(block_hash)
            self.stats.cpu.hits += 1
            return True
        path = self.disk.get(block_hash)
        if path is None:
            return False
        data = self._read(path, block_hash)
        if data is None:
            del self.disk[block_hash]
            path.unlink(missing_ok=True)
            self._removed(block_hash, MEDIUM_DISK)
            return False
        self.disk.move_to_end(block_hash)
        self.stats.disk.hits += 1
        self._staged[block_hash] = data
        return True

    # ---- data movement (from the model runner) ---------------------------------------------------
    def store(self, block_hash: bytes, data: torch.Tensor) -> None:
        if block_hash in self.cpu or block_hash in self.disk:
            return
        data = data.to("cpu", copy=True)
        if self.cpu_capacity == 0:
            self._put_disk(block_hash, data)
            return
        self.cpu[block_hash] = data
        self.stats.cpu.stored += 1
        self._stored(block_hash, MEDIUM_CPU)
        while len(self.cpu) > self.cpu_capacity:
            old_hash, old = self.cpu.popitem(last=False)
            self.stats.cpu.evicted += 1
            self._removed(old_hash, MEDIUM_CPU)
            self._put_disk(old_hash, old)

    def load(self, block_hash: bytes) -> torch.Tensor:
        data = self._staged.pop(block_hash, None)
        if data is None:
            data = self.cpu[block_hash]
        self.stats.loaded += 1
        return data

    def persist(self) -> None:
        """Copy everything held in CPU memory to the disk tier (at shutdown)."""
        for h, data in list(self.cpu.items()):
            self._put_disk(h, data)

    def end_step(self) -> None:
        """Drop disk reads that were acquired but not loaded (the request could not be admitted)."""
        self._staged.clear()

    def _put_disk(self, block_hash: bytes, data: torch.Tensor) -> None:
        if self.disk_capacity == 0 or block_hash in self.disk:
            return
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(
            _MAGIC,
            _VERSION,
            self.identity,
            block_hash,
            hashlib.sha256(payload).digest(),
            len(payload),
            str(self.dtype).removeprefix("torch.").encode()[:16],
        )
        path = self._path(block_hash)
        fd, tmp = tempfile.mkstemp(dir=self.disk_dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("KV disk tier: could not write %s: %s", path, e)
            Path(tmp).unlink(missing_ok=True)
            return
        self.disk[block_hash] = path
        self.stats.disk.stored += 1
        self._stored(block_hash, MEDIUM_DISK)
        while len(self.disk) > self.disk_capacity:
            old_hash, old = self.disk.popitem(last=False)
            old.unlink(missing_ok=True)
            self.stats.disk.evicted += 1
            self._removed(old_hash, MEDIUM_DISK)

    def _path(self, block_hash: bytes) -> Path:
        return self.disk_dir / f"{self.identity.hex()[:16]}-{block_hash.hex()}.kvblock"

    def _scan_disk(self) -> None:
        """Index the files a previous run left (oldest first); only ours, verified on read."""
        prefix = self.identity.hex()[:16] + "-"
        files = sorted(self.disk_dir.glob("*.kvblock"), key=lambda p: p.stat().st_mtime)
        for p in files:
            if not p.name.startswith(prefix):
                continue  # another model's blocks: not ours to use or delete
            try:
                block_hash = bytes.fromhex(p.stem[len(prefix) :])
            except ValueError:
                continue
            self.disk[block_hash] = p
        while len(self.disk) > self.disk_capacity:
            _, old = self.disk.popitem(last=False)
            old.unlink(missing_ok=True)
        if self.disk:
            logger.info("KV disk tier: %d blocks from earlier runs in %s", len(self.disk), self.disk_dir)

    def _read(self, path: Path, block_hash: bytes) -> torch.Tensor | None:
        try:
            raw = path.read_bytes()
        except OSError as e:
            return self._reject(path, f"unreadable ({e})")
        if len(raw) < _HEADER.size:
            return self._reject(path, "truncated header")
        magic, version, identity, stored_hash, digest, size, _dtype = _HEADER.unpack_from(raw)
        payload = raw[_HEADER.size :]
        if magic != _MAGIC or version != _VERSION:
            return self._reject(path, "not a kvflow KV block file")
        if identity != self.identity:
            return self._reject(path, "written for another model or configuration")
        if stored_hash != block_hash:
            return self._reject(path, "block hash in the header does not match the name")
        if size != self.block_bytes or len(payload) != size:
            return self._reject(path, f"payload is {len(payload)} bytes, expected {self.block_bytes}")
        if hashlib.sha256(payload).digest() != digest:
            return self._reject(path, "checksum mismatch")
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return buf.view(self.dtype).reshape(self.block_shape)

    def _reject(self, path: Path, why: str) -> None:
        logger.warning("KV disk tier: ignoring %s: %s", path, why)
        self.stats.disk.rejected += 1
        return None
