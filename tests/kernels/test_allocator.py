"""glibc heap settings of a CPU engine's process (kvflow.kernels.cpu.allocator)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from kvflow.kernels.cpu.allocator import keep_freed_memory, release_free_memory


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(not keep_freed_memory(), reason="not glibc: its allocator's own policy")
def test_loading_leftovers_go_back_but_freed_step_memory_stays():
    """With the engine's thresholds, freed blocks stay resident (for the next step's reuse) until
    release_free_memory, which gives them back."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(1 << 20) for _ in range(96)]  # 96 MB of 1 MB blocks: from the heap
    for p in blocks:
        ctypes.memset(p, 1, 1 << 20)
    held = _rss_kb()
    for p in blocks:
        libc.free(p)
    assert _rss_kb() > held - 16 * 1024  # kept: the trim threshold is far above 96 MB
    assert release_free_memory()
    assert _rss_kb() < held - 64 * 1024  # most of the 96 MB went back
