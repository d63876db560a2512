"""Linear-kernel choice by measurement: which path runs each projection shape at each row count,
and the other start-up measurements of the CPU kernels (the decode pass's row limit, the path of
prefill attention rows).

The fastest way to multiply a few rows by a weight differs between CPUs (MKL's sgemv, oneDNN's
blocked layout and the native GEMV each win somewhere: docs/benchmarks/results/), so no rule is
written down: at the first start on a machine `plan_kernels` times each candidate path
(kvflow.layers.linear_kernels.PATHS: the native float GEMM, `F.linear`, oneDNN's blocked layout)
on the model's own projection shapes at the row counts of `ROW_BUCKETS`, each call on its own
copy of the weight, and where a decode step's weights are more than the last-level cache holds,
with the copies pushed out of it first (`CacheEvictor`: a step streams them from memory); it keeps
the times in the kernel cache (``$KVFLOW_CACHE_DIR/kernels/autotune-<key>.json``), keyed by the
CPU (model and flags), torch's version, the thread count, the kernels' sources, the dtype and
whether the weights were timed from memory. Later starts read them; shapes not in the file are
timed and added. From the times, a `KernelPlan` (kvflow.layers.linear_kernels, which owns the
choice) holds per shape and row bucket the fastest path. Whether a decode-only step of so many
rows should run as one native pass (kvflow.models.decode_pass) is measured on the model itself,
once its KV cache exists: `measure_pass_rows` times decode steps both ways (the model runner
provides them), because what the pass saves -- the per-layer path's Python, its torch ops and the
idle threads between its calls -- was seen to be several times what timing the matmuls alone
predicts. That limit is stored beside the times (`store_pass_rows`), as is the path prefill rows
of attention take on the CPU backend (`measure_prefill_attention`).

`--kernel-autotune off` uses `default_plan` instead, documented there. The thread count is the
engine's (one per core it may use); it is part of the key, not a candidate.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from kvflow.config import KERNEL_AUTOTUNE_MODES
from kvflow.kernels.cpu import native
from kvflow.layers.linear_kernels import (
    ROW_BUCKETS,
    KernelPlan,
    Shape,
    candidates,
    default_choice,
    dtype_name,
    make_path_kernel,
    native_available,
)
from kvflow.worker import machine_load

logger = logging.getLogger(__name__)

COLD_BYTES = 64 << 20  # weight copies rotated per timing (at most 64 copies; see time_shape)
EVICT_MAX_BYTES = 1 << 30  # the most read to push the copies out of a last-level cache larger than them
ROUNDS = 3  # interleaved sweeps per (shape, rows)
WARM_ROWS = 16
# Other processes' CPU (in cores) above which a shape's timing is not trusted: an OpenMP team that
# loses a core for a time slice waits at its barrier, so a loaded machine's times can rank the paths
# backwards. Such a shape is timed again (ATTEMPTS in all; each path keeps its best), and a timing
# that never ran unloaded is used for this start only, not stored.
LOAD_LIMIT = 0.25
ATTEMPTS = 3
# Paths built for many rows: beyond the last bucket (prefill chunks) only these run. The native
# GEMM re-reads each group of panels for every 4 rows and never blocks the rows for the cache.
MANY_ROWS = ("onednn", "dense")
# bump when what is stored changes meaning (3: weights evicted from a large last-level cache; 4: the
# native GEMM timed at every row count)
VERSION = 4


def default_plan(shapes: Iterable[Shape], layer_shapes: list[Shape], dtype: torch.dtype) -> KernelPlan:
    name = dtype_name(dtype)
    choice = default_choice(name)
    # The pass runs as far as the rule keeps native from 1 row on.
    pass_rows = max((b for b in ROW_BUCKETS if all(choice[c] == "native" for c in ROW_BUCKETS if c <= b)), default=0)
    return KernelPlan(name, {s: dict(choice) for s in shapes}, pass_rows, "default", tuple(layer_shapes))


def plan_kernels(
    shapes: list[Shape], layer_shapes: list[Shape], dtype: torch.dtype, mode: str = "on", num_layers: int = 1
) -> KernelPlan:
    """The plan for a model whose projections have `shapes` (`layer_shapes`: one decoder layer's
    qkv, o, gate_up, down, for the decode-pass decision; `num_layers` of them). `mode` "off":
    `default_plan`."""
    if mode not in KERNEL_AUTOTUNE_MODES:
        raise ValueError(f"kernel_autotune must be one of {KERNEL_AUTOTUNE_MODES}, got {mode!r}")
    if mode == "off":
        return default_plan(shapes, layer_shapes, dtype)
    name = dtype_name(dtype)
    # Timed from memory where a decode step's weights are more than the last-level cache holds.
    llc = last_level_cache_bytes()
    step_bytes = dtype.itemsize * (
        sum(n * k for n, k in shapes if (n, k) not in layer_shapes) + num_layers * sum(n * k for n, k in layer_shapes)
    )
    cold = 0 < llc < step_bytes
    path = cache_path(name, cold)
    stored = _read(path)
    times: dict[Shape, dict[int, dict[str, float]]] = {s: stored["shapes"][s] for s in shapes if s in stored["shapes"]}
    missing = [s for s in dict.fromkeys(shapes) if s not in times]
    paths = candidates(dtype)  # (builds the native library first: not part of the measuring time)
    t0 = time.perf_counter()
    if missing:
        logger.info(
            "autotuning linear kernels: %d shapes x %d row counts x %s (first start on this CPU; stored in %s)",
            len(missing),
            len(ROW_BUCKETS),
            "/".join(paths),
            path,
        )
        unloaded = []
        evict = CacheEvictor(llc) if cold else None
        for i, shape in enumerate(missing):
            times[shape], load = time_shape_unloaded(shape, dtype, evict)
            if load <= LOAD_LIMIT:
                unloaded.append(shape)
            logger.info(
                "autotune %d/%d: %dx%d done (%.1f s)%s",
                i + 1,
                len(missing),
                *shape,
                time.perf_counter() - t0,
                ""
                if load <= LOAD_LIMIT
                else f" -- other processes used {load:.2f} cores meanwhile: used now, not stored",
            )
        stored["shapes"].update({s: times[s] for s in unloaded})
        if unloaded:
            _write(path, stored)
    pass_rows, unmeasured = 0, False
    if native_available(dtype) and len(layer_shapes) == 4:  # (qkv, o, gate_up, down)
        pass_rows = stored["pass_rows"].get(layer_key(layer_shapes), -1)
        if pass_rows < 0:
            pass_rows, unmeasured = pass_bound(times, layer_shapes), True
    seconds = time.perf_counter() - t0
    choices = {s: choose(by_rows) for s, by_rows in times.items()}
    return KernelPlan(
        name,
        choices,
        pass_rows,
        "measured" if missing else "cache",
        tuple(layer_shapes),
        seconds,
        pass_unmeasured=unmeasured and pass_rows > 0,
        weights_cold=cold,
    )


def choose(by_rows: dict[int, dict[str, float]]) -> dict[int, str]:
    """The fastest path per bucket; the last bucket (which also runs every larger call) from the
    many-row paths only."""
    last = max(by_rows)
    return {
        b: min((p for p in t if b != last or p in MANY_ROWS), key=t.get, default=min(t, key=t.get))
        for b, t in by_rows.items()
    }


def time_shape_unloaded(
    shape: Shape, dtype: torch.dtype, evict: Callable[[], None] | None = None
) -> tuple[dict[int, dict[str, float]], float]:
    """`time_shape`, again while other processes took more than LOAD_LIMIT cores (at most ATTEMPTS
    timings, each path keeping its best time: load only ever adds time); with the least load seen."""
    best: dict[int, dict[str, float]] = {}
    least = float("inf")
    for _ in range(ATTEMPTS):
        with machine_load.ForeignLoad() as load:
            times = time_shape(shape, dtype, evict)
        for b, by_path in times.items():
            for p, t in by_path.items():
                best.setdefault(b, {})[p] = min(t, best.get(b, {}).get(p, float("inf")))
        value = load.value if load.value == load.value else 0.0  # nan: no /proc/stat to judge by
        least = min(least, value)
        if value <= LOAD_LIMIT:
            break
    return best, least


def pass_bound(times: dict[Shape, dict[int, dict[str, float]]], layer_shapes: list[Shape]) -> int:
    """The largest bucket up to which (from 1 row, without a gap) the native GEMV was timed for every
    projection of a layer: what `measure_pass_rows` times the pass up to."""
    rows = 0
    for b in ROW_BUCKETS:
        if not all("native" in times[s][b] for s in layer_shapes):
            break
        rows = b
    return rows


def layer_key(layer_shapes: list[Shape]) -> str:
    return ",".join(f"{n}x{k}" for n, k in layer_shapes)


def measure_pass_rows(step: Callable[[int, bool], None], bound: int) -> tuple[int, float]:
    """Up to how many rows a decode-only step is faster as the native pass: `step(rows, fused)` runs
    one step of `rows` decode rows with (fused) or without the pass; each bucket up to `bound` is
    timed ROUNDS times each way, interleaved, best of each. The limit is the last bucket (from 1,
    without a gap) where the pass was no slower; with the most CPU other processes used meanwhile."""
    rows = 0
    with machine_load.ForeignLoad() as load:
        for b in (b for b in ROW_BUCKETS if b <= bound):
            best = best_times(lambda fused, b=b: step(b, fused), (True, False))
            if best[True] > best[False]:
                break
            rows = b
    return rows, load.value


def best_times(run: Callable, variants: Iterable) -> dict:
    """Seconds of `run(v)` for each variant: once each to warm (buffers sized, code paths loaded),
    then ROUNDS times each, interleaved, the best of each."""
    best = dict.fromkeys(variants, float("inf"))
    for v in best:
        run(v)
    for _ in range(ROUNDS):
        for v in best:
            t = time.perf_counter()
            run(v)
            best[v] = min(best[v], time.perf_counter() - t)
    return best


def _store(plan: KernelPlan, section: str, key: str, value) -> None:
    """One measured choice beside `plan`'s stored times ("pass_rows" or "prefill_attention")."""
    path = cache_path(plan.dtype, plan.weights_cold)
    stored = _read(path)
    stored[section][key] = value
    _write(path, stored)


def store_pass_rows(plan: KernelPlan, rows: int) -> None:
    """Keep the measured pass limit for `plan`'s layer shapes; later starts read it."""
    _store(plan, "pass_rows", layer_key(list(plan.pass_shapes)), rows)


PREFILL_PATHS = ("native", "torch")  # kvflow.attention.backends.cpu.CpuPagedAttention.prefill_path


def prefill_attention_key(heads: int, kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> str:
    """The stored prefill choice's key: the attention shape, the cache dtype and the native attention
    sources (a choice measured against other code, such as the per-row kernel before tiles, is not
    reused)."""
    sources = b"\0".join(p.read_bytes() for p in sorted(native.CSRC.glob("*attention*")))
    digest = hashlib.sha256(sources).hexdigest()[:8]
    return f"{heads}x{kv_heads}x{head_dim}:{str(cache_dtype).removeprefix('torch.')}:{digest}"


def stored_prefill_attention(plan: KernelPlan, key: str) -> str | None:
    """The path stored for prefill rows of attention shape `key` on this CPU, or None."""
    return _read(cache_path(plan.dtype, plan.weights_cold))["prefill_attention"].get(key)


def measure_prefill_attention(run: Callable[[str], None]) -> tuple[str, float]:
    """Which path runs a prefill chunk's attention faster here: `run(path)` runs one probe through
    it; ROUNDS times each, interleaved, best of each. With the most CPU other processes used
    meanwhile. (Before the tiled kernel, the native per-row kernel won on the AVX-512 EPYC and gather
    + SDPA, through oneDNN's bf16 kernels, on the AMX Xeon in bf16.)"""
    with machine_load.ForeignLoad() as load:
        best = best_times(run, PREFILL_PATHS)
    return min(best, key=best.get), load.value


def store_prefill_attention(plan: KernelPlan, key: str, path: str) -> None:
    _store(plan, "prefill_attention", key, path)


def last_level_cache_bytes() -> int:
    """Size of this CPU's largest cache (sysfs, else sysconf; 0 when unknown)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * unit)
        except ValueError:
            pass
    if not sizes:
        try:
            sizes.append(os.sysconf("SC_LEVEL3_CACHE_SIZE"))
        except (ValueError, OSError):
            pass
    return max(sizes, default=0)


class CacheEvictor:
    """Reads a buffer of twice the last-level cache (at most EVICT_MAX_BYTES): before each sweep
    where a model's weights are more than that cache holds, so the copies a sweep rotates through are
    timed from memory, as a decode step streaming all of the weights reads them. Under a large L3
    (480 MB on some Xeons) the copies otherwise stay in it, and MKL's sgemv, fast on cache-hot
    weights, gets chosen over the native GEMV, faster from memory. A model that fits is timed hot."""

    def __init__(self, llc_bytes: int) -> None:
        self._buf = torch.ones(min(2 * llc_bytes, EVICT_MAX_BYTES) // 4)

    def __call__(self) -> None:
        self._buf.sum()


def time_shape(
    shape: Shape, dtype: torch.dtype, evict: Callable[[], None] | None = None
) -> dict[int, dict[str, float]]:
    """Seconds per call of each candidate path for `shape` at each row bucket, each call on a copy of
    the weight that no call of the sweep touched before.

    Each call is timed on its own and a path's figure is the lower quartile of its calls over
    ROUNDS interleaved sweeps: another process taking a core for a time slice inflates some calls
    by milliseconds, and would decide a mean or a single sweep. Shapes larger than COLD_BYTES are
    timed on their first COLD_BYTES of output channels and scaled (the cost is linear in them).
    Each sweep reads every path's copies once, after `evict()` where given (a `CacheEvictor`)."""
    n, k = shape
    itemsize = dtype.itemsize
    rows_timed = max(1, min(n, COLD_BYTES // (k * itemsize)))
    gen = torch.Generator().manual_seed(0)
    base = (torch.rand(rows_timed, k, generator=gen, dtype=torch.float32) - 0.5).to(dtype)
    copies = max(1, min(64, -(-COLD_BYTES // (base.numel() * itemsize))))
    weights = [base] + [base.clone() for _ in range(copies - 1)]
    kernels = {p: [make_path_kernel(p, w, None) for w in weights] for p in candidates(dtype)}
    out: dict[int, dict[str, float]] = {}
    for m in ROW_BUCKETS:
        x = (torch.rand(m, k, generator=gen) - 0.5).to(dtype)
        # From WARM_ROWS rows on the weights are reused across rows and their read matters less:
        # a quarter of the copies.
        sweep = slice(None) if m < WARM_ROWS else slice(0, max(1, copies // 4))
        samples: dict[str, list[float]] = {}
        for p, ks in kernels.items():
            ks[0](x)  # the code path warm (compiled, allocated)
            samples[p] = []
        for r in range(ROUNDS):
            if r == 1:  # a path twice as slow as the best after one sweep will not win: drop it
                # (but the native GEMM: the decode pass runs it whatever its time alone, and the pass
                # is timed on the model up to where the native times go -- pass_bound. Alone, a bf16
                # 64-row down projection through AMX was over twice oneDNN's time, yet the pass of
                # all layers at 64 rows beat the per-layer path around oneDNN.)
                best = min(min(v) for v in samples.values())
                samples = {p: v for p, v in samples.items() if min(v) <= 2 * best or p == "native"}
            if evict is not None:
                evict()
            for p in samples:
                for kern in kernels[p][sweep]:
                    t = time.perf_counter()
                    kern(x)
                    samples[p].append(time.perf_counter() - t)
        out[m] = {p: sorted(v)[len(v) // 4] * n / rows_timed for p, v in samples.items()}
    return out


def cache_key(dtype: str, cold: bool = False) -> str:
    parts = [
        native.cpu_id(),
        torch.__version__,
        str(torch.get_num_threads()),
        dtype,
        str(VERSION),
        str(cold),
        *(p.read_text() for p in sorted(native.CSRC.glob("float_linear.*"))),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def store_dir() -> Path:
    """Where start-up measurements are kept: the kernel cache, or $KVFLOW_AUTOTUNE_DIR where set (the
    test suite sets it: timings taken beside its own threads and servers must not become a user's
    choices)."""
    root = os.environ.get("KVFLOW_AUTOTUNE_DIR")
    return Path(root) if root else native.cache_dir()


def cache_path(dtype: str, cold: bool = False) -> Path:
    return store_dir() / f"autotune-{cache_key(dtype, cold)}.json"


def _read(path: Path) -> dict:
    """The stored times, pass limits and prefill-attention paths ({"shapes": {(n, k): {rows: {path:
    s}}}, "pass_rows": {layer_key: rows}, "prefill_attention": {key: path}}); empty when absent or
    unreadable (a torn or foreign file is re-measured, not trusted)."""
    empty: dict = {"shapes": {}, "pass_rows": {}, "prefill_attention": {}}
    try:
        raw = json.loads(path.read_text())
        shapes = {
            tuple(map(int, s.split("x"))): {int(b): {p: float(t) for p, t in by.items()} for b, by in rows.items()}
            for s, rows in raw["shapes"].items()
        }
        prefill = {str(k): str(v) for k, v in raw.get("prefill_attention", {}).items() if v in PREFILL_PATHS}
        return {
            "shapes": shapes,
            "pass_rows": {str(k): int(v) for k, v in raw.get("pass_rows", {}).items()},
            "prefill_attention": prefill,
        }
    except FileNotFoundError:
        return empty
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("ignoring the unreadable autotune cache %s (%s); measuring again", path, e)
        return empty


def _write(path: Path, stored: dict) -> None:
    raw = {
        "cpu": native.cpu_id().split(" | ")[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "pass_rows": stored["pass_rows"],
        "prefill_attention": stored["prefill_attention"],
        "shapes": {f"{n}x{k}": {str(b): by for b, by in rows.items()} for (n, k), rows in stored["shapes"].items()},
    }
    write_json(path, raw)


def write_json(path: Path, raw: dict) -> None:
    """`raw` to `path` as JSON, atomically: concurrent starts (replicas, ranks) never read a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(raw, indent=1))
    os.replace(tmp, path)
