"""An all-reduce through shared memory, for ranks on one host: vLLM's CPU backend measured it far
faster than torch.distributed (gloo over loopback TCP), whose I/O threads compete for the very
cores the ranks compute on.

Each rank owns two slots (double buffering) in one /dev/shm segment and a sequence counter. A
round: write the tensor into this round's slot, publish the round number, wait until every rank
has published it, then sum all ranks' slots in rank order, so every rank gets bit-identical
results. A rank can be at most one round ahead of the slowest (it waits for everyone before
reading), so the other slot is never being read when it is rewritten. x86-64 keeps stores in
order (TSO), so a published counter means the data before it is visible.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

_LINE = 64  # one counter per cache line
_SPIN = 2000  # polls before yielding the core
_CHECK_EVERY_S = 0.5  # while waiting: how often to ask whether the other ranks are still alive


class ShmAllReduce:
    def __init__(
        self, path: str, rank: int, size: int, slot_bytes: int, create: bool, timeout_s: float = 120.0
    ) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.timeout_s = timeout_s
        # Raises when a peer is known dead (set by the executor): a wait never outlives its peers.
        self.check_peers: Callable[[], None] | None = None
        self.path = path
        total = size * _LINE + 2 * size * slot_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, total)
        self._counters = np.ndarray((size, _LINE // 8), dtype=np.int64, buffer=self._map)[:, 0]
        self._data = np.ndarray((2, size, slot_bytes), dtype=np.uint8, buffer=self._map, offset=size * _LINE)
        self._round = 0

    @staticmethod
    def new_path() -> str:
        fd, path = tempfile.mkstemp(prefix="kvflow-allreduce-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.close(fd)
        return path

    def fits(self, t: torch.Tensor) -> bool:
        return (
            t.dtype in (torch.float32, torch.float64)
            and t.is_contiguous()
            and t.device.type == "cpu"
            and t.numel() * t.element_size() <= self.slot_bytes
        )

    def _publish(self, t: torch.Tensor) -> tuple[int, int]:
        """Write t into this round's slot and say so; returns (round, parity)."""
        self._round += 1
        r, parity = self._round, self._round % 2
        n = t.numel() * t.element_size()
        self._data[parity, self.rank, :n] = t.view(torch.uint8).reshape(-1).numpy()
        self._counters[self.rank] = r
        return r, parity

    def _wait_all(self, r: int) -> None:
        spins = 0
        start = last_check = None
        while int(self._counters.min()) < r:
            spins += 1
            if spins > _SPIN:
                time.sleep(0)
                now = time.monotonic()
                if start is None:
                    start = last_check = now
                elif now - last_check > _CHECK_EVERY_S:
                    last_check = now
                    if self.check_peers is not None:
                        self.check_peers()
                    if now - start > self.timeout_s:
                        late = [i for i in range(self.size) if int(self._counters[i]) < r]
                        raise RuntimeError(
                            f"tensor-parallel all-reduce: rank(s) {late} did not arrive within {self.timeout_s:g} s"
                        )

    def gather(self, t: torch.Tensor, widths: list[int], is_first: bool) -> list[torch.Tensor] | None:
        """Every rank's 2-D `t` (the same rows; rank i's has widths[i] columns) to the first rank,
        in rank order. The others do not wait: their next round waits for everyone anyway before
        their slot of this parity is written again."""
        r, parity = self._publish(t)
        if not is_first:
            return None
        self._wait_all(r)
        rows, dtype = t.shape[0], t.numpy().dtype
        return [
            torch.from_numpy(self._data[parity, i, : rows * w * t.element_size()].view(dtype).reshape(rows, w).copy())
            for i, w in enumerate(widths)
        ]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        r, parity = self._publish(t)
        n = t.numel() * t.element_size()
        self._wait_all(r)
        dtype = t.numpy().dtype
        slots = self._data[parity, :, :n].view(dtype)
        out = t.view(-1).numpy()
        np.copyto(out, slots[0])
        for i in range(1, self.size):
            out += slots[i]
        return t

    def close(self, unlink: bool = False) -> None:
        self._counters = self._data = None
        self._map.close()
        os.close(self._fd)
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass
