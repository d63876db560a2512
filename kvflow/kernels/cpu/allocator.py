"""glibc malloc settings for a CPU engine's process.

glibc serves allocations above its mmap threshold (128 KB, rising to at most 32 MB as large blocks
are freed) with fresh mmaps and frees them with munmap, and trims the heap top past 128 KB: a
step's activations of a few MB each (a prefill chunk's [2048, 3072] projection output, a batch's
[64, 49152] logits) are then new pages every time, faulted in and zeroed by the kernel on first
touch. Raising both thresholds keeps freed blocks in the heap for the next step (as vLLM's CPU
build gets by preloading tcmalloc): steps carrying prefill chunks got markedly faster under
benchmarks/serve_replay.py (figures in docs/benchmarks/results/). The heap then holds its peak
(the pool of activations a step needs); the KV cache and the weights above 32 MB are mmaps of
their own either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
_TRIM_THRESHOLD = 1 << 30
_done = False


def _glibc(name: str):
    """glibc's function `name`, or None where the C library is not glibc (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Set the thresholds once per process (glibc only); whether they are set."""
    global _done
    if _done:
        return True
    mallopt = _glibc("mallopt")
    if mallopt is None:  # not glibc: its allocator's own policy
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if not _done:
        logger.debug("mallopt refused the thresholds; glibc's defaults stay")
    return _done


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system now (glibc's malloc_trim): once, when an engine
    has loaded its model. Loading's temporaries (a checkpoint's tensors before packing, the kernel
    choices' trial copies) leave the heap at their peak, which the thresholds above then keep
    resident; the packed weights live in mappings of their own (csrc/weight_memory.h), so that
    peak is no longer reused by them. Whether glibc released anything."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
