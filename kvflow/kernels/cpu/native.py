"""Native CPU kernels (kvflow/kernels/cpu/csrc/*.c, *.cpp), compiled at first use and called through ctypes.

Small C++ libraries with OpenMP. The attention library includes no torch headers; its fixed-shape
paths are instantiated per head size, group and cache format (and compiled into the decode pass
too), which is most of a first start's build time (benchmarks/startup.py). The linear library
includes the FBGEMM headers that ship with torch and links against torch's own libtorch_cpu
(already loaded), to call FBGEMM's kernels directly; its sources compile side by side (a torch C++
extension would compile the torch headers as well). Both build once per machine and source
change. The shared object is cached under `$KVFLOW_CACHE_DIR` (default
``~/.cache/kvflow``), named by a hash of the sources and headers, the flags, the compiler, torch's
version and the CPU (it is built with -march=native), and written atomically, so concurrent
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvflow.cache import cache_root
from kvflow.kernels.norm import NormWeights

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
_TORCH = Path(torch.__file__).parent
LANGUAGES = {  # suffix -> (compiler: $env or the first found, standard, extra compile flags, extra link flags)
    ".c": (("CC", "gcc", "cc"), "-std=c11", (), ()),
    ".cpp": (
        ("CXX", "g++", "c++"),
        "-std=c++17",
        (f"-I{_TORCH / 'include'}",),
        (f"-L{_TORCH / 'lib'}", "-ltorch_cpu", f"-Wl,-rpath,{_TORCH / 'lib'}"),
    ),
}

_cache: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    return cache_root() / "kernels"


def cpu_id() -> str:
    """The CPU as /proc/cpuinfo names it: its model and its feature flags (what -march=native and
    the autotune's measurements depend on)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
                if "model name" in fields and "flags" in fields:
                    break
    except OSError:
        pass
    if "flags" not in fields:
        return platform.processor() or platform.machine()
    return f"{fields.get('model name', platform.machine())} | {fields['flags']}"


# Sources that need flags of their own: the block and float kernels' sums must not be reassociated
# or contracted differently from one tile shape to the next (a token's result would depend on its
# batch: gcc fused one float tile shape's multiply-adds and not another's on an AVX2 EPYC); the
# float kernel's FMAs are written out (simd.h fmadd); the MoE experts' weighted sum must be the per-layer
# path's multiply then add; the q/k norms' sums must not depend on where they are inlined.
SOURCE_FLAGS = {
    "block_linear.cpp": ("-fno-associative-math", "-ffp-contract=off"),
    "float_linear.cpp": ("-fno-associative-math", "-ffp-contract=off"),
    "lora.cpp": ("-fno-associative-math", "-ffp-contract=off"),
    "moe_experts.cpp": ("-fno-associative-math", "-ffp-contract=off"),
    "qk_norm.cpp": ("-fno-associative-math", "-ffp-contract=off"),
}

# Library -> its sources (one language per library). Headers (csrc/*.h) are shared.
# "block_amx_emulated": the block kernels with the AMX-INT8 instructions emulated in C++ (csrc/amx.h),
# so that their AMX path is tested on CPUs without AMX (tests/kernels/test_block_linear.py); not used to serve.
LIBRARIES = {
    "block_amx_emulated": ("block_linear.cpp",),
    "paged_attention": ("paged_attention.cpp",),
    "linear": (
        "int8_linear.cpp",
        "float_linear.cpp",
        "block_linear.cpp",
        "lora.cpp",
        "decode_pass.cpp",
        "moe_experts.cpp",
        "qk_norm.cpp",
    ),
}


# Library -> defines of its own (every source of it).
LIBRARY_FLAGS = {"block_amx_emulated": ("-DKVFLOW_AMX_EMULATE",)}


def _compiler(suffix: str) -> str | None:
    env, *names = LANGUAGES[suffix][0]
    return os.environ.get(env) or next(filter(None, map(shutil.which, names)), None)


def _build(name: str, sources: list[Path], cc: str) -> Path:
    _, std, extra_compile, extra_link = LANGUAGES[sources[0].suffix]
    compile_flags = (*COMPILE_FLAGS, std, *extra_compile, *LIBRARY_FLAGS.get(name, ()))
    link_flags = (*LINK_FLAGS, *extra_link)
    texts = [p.read_bytes() for p in (*sources, *sorted(CSRC.glob("*.h")))]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    per_source = [" ".join(SOURCE_FLAGS.get(src.name, ())).encode() for src in sources]
    key = hashlib.sha256(
        b"\0".join(
            [
                *texts,
                *per_source,
                " ".join(compile_flags + link_flags).encode(),
                version.encode(),
                torch.__version__.encode(),
                cpu_id().encode(),
            ]
        )
    ).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs = [Path(tmp) / f"{src.stem}.o" for src in sources]
        lib = Path(tmp) / f"{name}.so"
        cmds = [
            [cc, *compile_flags, *SOURCE_FLAGS.get(src.name, ()), "-c", str(src), "-o", str(obj)]
            for src, obj in zip(sources, objs)
        ]
        # The sources compile side by side, one process per CPU this process may use (a first start).
        with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
            for cmd, r in zip(cmds, pool.map(_run, cmds)):
                _check(cmd, r)
        link = [cc, *map(str, objs), *link_flags, "-o", str(lib)]
        _check(link, _run(link))
        os.replace(lib, out)
    return out


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def _check(cmd: list[str], r: subprocess.CompletedProcess) -> None:
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()[-2000:]}")


Signature = tuple[list[type], type | None]  # (argtypes, restype) of one exported function


def load(name: str, signatures: dict[str, Signature]) -> ctypes.CDLL | None:
    """The compiled library `name` (see LIBRARIES) with its functions typed by `signatures`, or
    None (logged once) when it cannot be built here."""
    if name not in _cache:
        _cache[name] = _open(name)
    lib = _cache[name]
    if lib is not None:  # each caller types the functions it uses
        for fn, (argtypes, restype) in signatures.items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
    return lib


def _open(name: str) -> ctypes.CDLL | None:
    sources = [CSRC / f for f in LIBRARIES[name]]
    suffix = sources[0].suffix
    cc = _compiler(suffix)
    if cc is None:
        env, *names = LANGUAGES[suffix][0]
        logger.warning(
            "no compiler for %s found (%s, or $%s): native %s kernels off, using the torch path",
            suffix,
            "/".join(names),
            env,
            name,
        )
        return None
    try:
        return ctypes.CDLL(str(_build(name, sources, cc)))
    except (OSError, RuntimeError) as e:
        logger.warning("native %s kernels unavailable, using the torch path: %s", name, e)
        return None


# The op a native linear applies to each input row first (enum Prologue in csrc/linear_ops.h).
PLAIN, RMSNORM, SILU_MUL = 0, 1, 2


def call_linear(
    fn,
    handle: int,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: NormWeights | None,
    silu_mul: bool,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """One call of a native linear (kvflow_int8_linear / kvflow_float_linear / kvflow_block_linear
    share this signature): out = residual + W . pre(x) + bias, pre being the RMSNorm `norm`, silu *
    mul, or nothing. x and residual: 2-D float32 with unit column stride."""
    out = torch.empty(x.shape[0], out_features)
    if norm is not None:
        kind, norm_w, eps = RMSNORM, norm.float_weight.data_ptr(), norm.eps
    else:
        kind, norm_w, eps = (SILU_MUL if silu_mul else PLAIN), None, 0.0
    fn(
        handle,
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        kind,
        norm_w,
        eps,
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def fused_linear(
    kernel, fn, x: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights | None, silu_mul: bool, what: str
) -> torch.Tensor:
    """A native linear `kernel` (in_features, out_features, bias, native_handle) called through
    `fn` on any input: the width checked (`what` names the kernel in the error), leading dims
    flattened, float32 unit-stride rows made, the result back in x's dtype."""
    width = (2 if silu_mul else 1) * kernel.in_features
    if x.shape[-1] != width:
        raise ValueError(
            f"{what} of {kernel.in_features} inputs got rows of {x.shape[-1]}"
            + (" (silu_mul takes gate and up: twice the inputs)" if silu_mul else "")
        )
    if x.dim() != 2:
        res = None if residual is None else residual.reshape(-1, kernel.out_features)
        return fused_linear(kernel, fn, x.reshape(-1, x.shape[-1]), res, norm, silu_mul, what).view(
            *x.shape[:-1], kernel.out_features
        )
    dtype = x.dtype
    if dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    if residual is not None and (residual.stride(1) != 1 or residual.dtype != torch.float32):
        residual = residual.float().contiguous()
    out = call_linear(fn, kernel.native_handle, x, residual, norm, silu_mul, kernel.bias, kernel.out_features)
    return out if dtype == torch.float32 else out.to(dtype)
