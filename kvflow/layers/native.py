"""Native CPU kernels (kvflow/layers/csrc/*.c), compiled at first use and called through ctypes.

Plain C with OpenMP, no torch headers: each library builds in about half a second with the gcc
every supported machine has (a torch C++ extension compiles the torch headers as well). The shared object is cached under
`$KVFLOW_CACHE_DIR` (default ``~/.cache/kvflow``), named by a hash of the source, the flags, the
compiler and the CPU (it is built with -march=native), and written atomically, so concurrent
processes and stale builds are harmless. When there is no compiler the callers fall back to the
torch path (`load` returns None and says why once).

-ffast-math lets gcc vectorise the reductions and call glibc's vector expf; objects are linked
without it, so loading the library does not switch the whole process to flush-to-zero.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")

_cache: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow") / "kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(name: str, cc: str) -> Path:
    src = CSRC / f"{name}.c"
    text = src.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([text, " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(),
                                     version.encode(), _cpu_id().encode()])).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.so"
        for cmd in ([cc, *COMPILE_FLAGS, "-c", str(src), "-o", str(obj)], [cc, str(obj), *LINK_FLAGS, "-o", str(lib)]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()[-2000:]}")
        os.replace(lib, out)
    return out


Signature = tuple[list[type], type | None]  # (argtypes, restype) of one exported function


def load(name: str, signatures: dict[str, Signature]) -> ctypes.CDLL | None:
    """The compiled library `csrc/<name>.c` with its functions typed by `signatures`, or None
    (logged once) when it cannot be built here."""
    if name in _cache:
        return _cache[name]
    lib = None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found (gcc/cc, or $CC): native %s kernel off, using the torch path", name)
    else:
        try:
            lib = ctypes.CDLL(str(_build(name, cc)))
        except (OSError, RuntimeError) as e:
            logger.warning("native %s kernel unavailable, using the torch path: %s", name, e)
    if lib is not None:
        for fn, (argtypes, restype) in signatures.items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
    _cache[name] = lib
    return lib
