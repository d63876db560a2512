"""Linear-kernel choice by measurement: which path runs each projection shape at each row count.

The fastest way to multiply a few rows by a weight differs between CPUs (on the AVX2 Zen 3 the
notes were written on, MKL's sgemv beat oneDNN at 1-2 rows; on an AVX512 EPYC oneDNN was 1.7x
faster there), so no rule is written down: at the first start on a machine `tune` times each
candidate path (`PATHS`: the native float GEMM, `F.linear`, oneDNN's blocked layout) on the
model's own projection shapes at the row counts of `ROW_BUCKETS`, weights cold (rotated through
copies larger than the last-level cache, as a decode step streams them), and keeps the times in the
kernel cache (``$KVFLOW_CACHE_DIR/kernels/autotune-<key>.json``), keyed by the CPU (model and
flags), torch's version, the thread count, the kernels' sources and the dtype. Later starts read
them; shapes not in the file are timed and added. From the times, `KernelPlan` picks per shape and
row bucket the fastest path, and the largest row count up to which a decode-only step should run as
one native pass (kvflow.kernels.cpu.decode_pass): where the native GEMV's time over a layer's
projections is within what the pass saves, the Python calls and the torch ops around the matmuls at
that many rows (measured too: `call_overhead_s`, `layer_ops_s`).

`--kernel-autotune off` uses `default_plan` instead, documented there. The thread count is the
engine's (one per core it may use); it is part of the key, not a candidate.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvflow.config import KERNEL_AUTOTUNE_MODES
from kvflow.kernels.cpu import native

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a call with m rows runs the choice of the first bucket >= m
PATHS = ("native", "dense", "onednn")
COLD_BYTES = 64 << 20  # weight copies rotated per timing: twice a 32 MB L3, so each call reads DRAM
ROUNDS = 3  # interleaved sweeps per (shape, rows)
WARM_ROWS = 16
PASS_CALLS_SAVED = 10  # Python-level calls per layer that the fused decode pass replaces
# Other processes' CPU (in cores) above which a shape's timing is not trusted: an OpenMP team that
# loses a core for a time slice waits at its barrier, so a loaded machine's times can rank the paths
# backwards. Such a shape is timed again (ATTEMPTS in all; each path keeps its best), and a timing
# that never ran unloaded is used for this start only, not stored.
LOAD_LIMIT = 0.25
ATTEMPTS = 3
# Paths built for many rows: beyond the last bucket (prefill chunks) only these run. The native
# GEMM re-reads each group of panels for every 4 rows and never blocks the rows for the cache.
MANY_ROWS = ("onednn", "dense")
VERSION = 2  # bump when what is stored changes meaning

Shape = tuple[int, int]  # (out_features, in_features)


@dataclass
class KernelPlan:
    """The chosen path per (shape, row bucket), and the decode pass's row limit (0: never)."""

    dtype: str
    choices: dict[Shape, dict[int, str]]
    decode_pass_rows: int
    source: str  # "measured" (this start), "cache" (an earlier start), "default" (autotune off)
    pass_shapes: tuple[Shape, ...] = ()  # one decoder layer's projections: what the decode pass runs
    seconds: float = 0.0  # spent measuring at this start

    def choice(self, shape: Shape) -> dict[int, str]:
        return self.choices.get(shape) or default_choice(self.dtype)

    def describe(self) -> str:
        """One line per shape: row ranges and their path; then the decode pass."""
        lines = []
        for (n, k), by_rows in sorted(self.choices.items()):
            spans: list[list] = []  # [first bucket, last bucket, path]
            for b, path in by_rows.items():
                if spans and spans[-1][2] == path:
                    spans[-1][1] = b
                else:
                    spans.append([b, b, path])
            text = ", ".join(f"{lo}{'' if lo == hi else f'-{hi}'} {path}" for lo, hi, path in spans)
            lines.append(f"{n}x{k}: {text}")
        rows = self.decode_pass_rows
        lines.append(f"decode pass: {'up to ' + str(rows) + ' rows' if rows else 'off'}")
        took = f" in {self.seconds:.1f} s" if self.source == "measured" else ""
        return f"linear kernels ({self.source}{took}, {self.dtype}): " + "; ".join(lines)


def native_available(dtype: torch.dtype) -> bool:
    from kvflow.kernels.cpu.float_linear import WEIGHT_TYPES, float_library

    return dtype in WEIGHT_TYPES and float_library() is not None


@functools.cache
def onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN's blocked-weight linear for `dtype` on this CPU (bf16 needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT; probed by reordering a small weight, as the check lives inside oneDNN)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available() or not hasattr(
            torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def candidates(dtype: torch.dtype) -> list[str]:
    return [p for p in PATHS if p == "dense" or (p == "native" and native_available(dtype))
            or (p == "onednn" and onednn_available(dtype))]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_choice(dtype: str) -> dict[int, str]:
    """`--kernel-autotune off`: the native GEMV up to 4 rows (where it builds), oneDNN's
    blocked layout from 8 (where it runs for the dtype), else `F.linear`. A fixed rule, not a
    measurement: on the AVX2 EPYC of 2026-12-01 the autotune chose native up to 4-16 rows and
    oneDNN beyond on most of the default model's shapes."""
    paths = candidates(getattr(torch, dtype))
    small = "native" if "native" in paths else "dense"
    large = "onednn" if "onednn" in paths else "dense"
    return {b: small if b <= 4 else large for b in ROW_BUCKETS}


def default_plan(shapes: Iterable[Shape], layer_shapes: list[Shape], dtype: torch.dtype) -> KernelPlan:
    name = dtype_name(dtype)
    choice = default_choice(name)
    # The pass runs as far as the rule keeps native from 1 row on.
    pass_rows = max((b for b in ROW_BUCKETS if all(choice[c] == "native" for c in ROW_BUCKETS if c <= b)), default=0)
    return KernelPlan(name, {s: dict(choice) for s in shapes}, pass_rows, "default", tuple(layer_shapes))


def plan_kernels(shapes: list[Shape], layer_shapes: list[Shape], dtype: torch.dtype, mode: str = "on") -> KernelPlan:
    """The plan for a model whose projections have `shapes` (`layer_shapes`: one decoder layer's
    qkv, o, gate_up, down, for the decode-pass decision). `mode` "off": `default_plan`."""
    if mode not in KERNEL_AUTOTUNE_MODES:
        raise ValueError(f"kernel_autotune must be one of {KERNEL_AUTOTUNE_MODES}, got {mode!r}")
    if mode == "off":
        return default_plan(shapes, layer_shapes, dtype)
    name = dtype_name(dtype)
    path = cache_path(name)
    stored = _read(path)
    times: dict[Shape, dict[int, dict[str, float]]] = {s: stored["shapes"][s] for s in shapes if s in stored["shapes"]}
    missing = [s for s in dict.fromkeys(shapes) if s not in times]
    paths = candidates(dtype)  # (builds the native library first: not part of the measuring time)
    t0 = time.perf_counter()
    if missing:
        logger.info("autotuning linear kernels: %d shapes x %d row counts x %s (first start on this CPU; "
                    "stored in %s)", len(missing), len(ROW_BUCKETS), "/".join(paths), path)
        overhead = stored.get("call_overhead_s") or call_overhead_s()
        unloaded = []
        for i, shape in enumerate(missing):
            times[shape], load = time_shape_unloaded(shape, dtype)
            if load <= LOAD_LIMIT:
                unloaded.append(shape)
            logger.info("autotune %d/%d: %dx%d done (%.1f s)%s", i + 1, len(missing), *shape,
                        time.perf_counter() - t0, "" if load <= LOAD_LIMIT else
                        f" -- other processes used {load:.2f} cores meanwhile: used now, not stored")
        stored["shapes"].update({s: times[s] for s in unloaded})
        stored["call_overhead_s"] = overhead
        if unloaded:
            _write(path, stored)
    pass_rows = 0
    if native_available(dtype) and layer_shapes:
        key = layer_key(layer_shapes)
        if key not in stored["layer_ops"] and len(layer_shapes) == 4:  # (qkv, o, gate_up, down)
            stored["layer_ops"][key] = layer_ops_s(layer_shapes, dtype)
            _write(path, stored)
        pass_rows = decode_pass_rows(times, layer_shapes, stored["call_overhead_s"], stored["layer_ops"].get(key))
    seconds = time.perf_counter() - t0
    choices = {s: choose(by_rows) for s, by_rows in times.items()}
    return KernelPlan(name, choices, pass_rows, "measured" if missing else "cache", tuple(layer_shapes), seconds)


def choose(by_rows: dict[int, dict[str, float]]) -> dict[int, str]:
    """The fastest path per bucket; the last bucket (which also runs every larger call) from the
    many-row paths only."""
    last = max(by_rows)
    return {b: min((p for p in t if b != last or p in MANY_ROWS), key=t.get, default=min(t, key=t.get))
            for b, t in by_rows.items()}


def time_shape_unloaded(shape: Shape, dtype: torch.dtype) -> tuple[dict[int, dict[str, float]], float]:
    """`time_shape`, again while other processes took more than LOAD_LIMIT cores (at most ATTEMPTS
    timings, each path keeping its best time: load only ever adds time); with the least load seen."""
    from kvflow.kernels.cpu.machine_load import ForeignLoad

    best: dict[int, dict[str, float]] = {}
    least = float("inf")
    for _ in range(ATTEMPTS):
        with ForeignLoad() as load:
            times = time_shape(shape, dtype)
        for b, by_path in times.items():
            for p, t in by_path.items():
                best.setdefault(b, {})[p] = min(t, best.get(b, {}).get(p, float("inf")))
        value = load.value if load.value == load.value else 0.0  # nan: no /proc/stat to judge by
        least = min(least, value)
        if value <= LOAD_LIMIT:
            break
    return best, least


def decode_pass_rows(times: dict[Shape, dict[int, dict[str, float]]], layer_shapes: list[Shape],
                     overhead_s: float, layer_ops: dict[int, float] | None = None) -> int:
    """The largest bucket up to which (from 1 row, without a gap) a layer's projections on the
    native GEMV cost no more than the fastest paths plus what the pass saves per layer: the
    per-layer calls (`overhead_s` each) and the torch ops around the matmuls at that many rows
    (`layer_ops`, measured by `layer_ops_s`; the pass runs them inside its native calls)."""
    rows = 0
    for b in ROW_BUCKETS:
        nat = sum(times[s][b].get("native", float("inf")) for s in layer_shapes)
        best = sum(min(times[s][b].values()) for s in layer_shapes)
        if nat > best + PASS_CALLS_SAVED * overhead_s + (layer_ops or {}).get(b, 0.0):
            break
        rows = b
    return rows


def layer_key(layer_shapes: list[Shape]) -> str:
    return ",".join(f"{n}x{k}" for n, k in layer_shapes)


def layer_ops_s(layer_shapes: list[Shape], dtype: torch.dtype, reps: int = 10) -> dict[int, float]:
    """Seconds per layer, at each row bucket, of the torch ops the per-layer path runs around a
    layer's matmuls when they are not fused into the native GEMV: the two RMSNorms, rotary on the
    q / k / v heads (an upper bound: v is not rotated), silu(gate) * up, the two residual adds."""
    from kvflow.layers.norm import RMSNorm
    from kvflow.layers.rotary import apply_rotary_

    (qkv_n, hidden), _, (gate_up_n, _), _ = layer_shapes
    norm = RMSNorm(hidden, 1e-5, dtype, torch.device("cpu"))
    head = 64  # (the ops' cost follows their element count; the head size only shapes the view)
    out: dict[int, float] = {}
    for b in ROW_BUCKETS:
        x, gate_up = torch.rand(b, hidden, dtype=dtype), torch.rand(b, gate_up_n, dtype=dtype)
        heads = torch.rand(b, max(1, qkv_n // head), head, dtype=dtype)
        cos = torch.rand(b, 1, head, dtype=dtype)

        def ops() -> None:
            norm(x), norm(x)
            apply_rotary_(heads, cos, cos)
            gate, up = gate_up.chunk(2, dim=-1)
            F.silu(gate) * up
            x + x, x + x

        ops()
        t = time.perf_counter()
        for _ in range(reps):
            ops()
        out[b] = (time.perf_counter() - t) / reps
    return out


def time_shape(shape: Shape, dtype: torch.dtype) -> dict[int, dict[str, float]]:
    """Seconds per call of each candidate path for `shape` at each row bucket, weights cold.

    Each call is timed on its own and a path's figure is the lower quartile of its calls over
    ROUNDS interleaved sweeps: another process taking a core for a time slice inflates some calls
    by milliseconds, and would decide a mean or a single sweep. Shapes larger than COLD_BYTES are
    timed on their first COLD_BYTES of output channels and scaled (the cost is linear in them)."""
    from kvflow.layers.linear import make_path_kernel

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
                best = min(min(v) for v in samples.values())
                samples = {p: v for p, v in samples.items() if min(v) <= 2 * best}
            for p in samples:
                for kern in kernels[p][sweep]:
                    t = time.perf_counter()
                    kern(x)
                    samples[p].append(time.perf_counter() - t)
        out[m] = {p: sorted(v)[len(v) // 4] * n / rows_timed for p, v in samples.items()}
    return out


def call_overhead_s(reps: int = 200) -> float:
    """Seconds of one small torch call from Python (what a fused pass saves per call it replaces)."""
    w, x = torch.zeros(8, 8), torch.zeros(1, 8)
    F.linear(x, w)
    t = time.perf_counter()
    for _ in range(reps):
        F.linear(x, w)
    return (time.perf_counter() - t) / reps


def cache_key(dtype: str) -> str:
    parts = [native.cpu_id(), torch.__version__, str(torch.get_num_threads()), dtype, str(VERSION),
             *(p.read_text() for p in sorted(native.CSRC.glob("float_linear.*")))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def cache_path(dtype: str) -> Path:
    return native.cache_dir() / f"autotune-{cache_key(dtype)}.json"


def _read(path: Path) -> dict:
    """The stored times ({"shapes": {(n, k): {rows: {path: s}}}, "call_overhead_s": s, "layer_ops":
    {layer_key: {rows: s}}}); empty when
    absent or unreadable (a torn or foreign file is re-measured, not trusted)."""
    empty: dict = {"shapes": {}, "call_overhead_s": None, "layer_ops": {}}
    try:
        raw = json.loads(path.read_text())
        shapes = {tuple(map(int, s.split("x"))): {int(b): {p: float(t) for p, t in by.items()}
                                                  for b, by in rows.items()}
                  for s, rows in raw["shapes"].items()}
        layer_ops = {str(k): {int(b): float(t) for b, t in by.items()} for k, by in raw.get("layer_ops", {}).items()}
        return {"shapes": shapes, "call_overhead_s": float(raw["call_overhead_s"]), "layer_ops": layer_ops}
    except FileNotFoundError:
        return empty
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("ignoring the unreadable autotune cache %s (%s); measuring again", path, e)
        return empty


def _write(path: Path, stored: dict) -> None:
    raw = {"cpu": native.cpu_id().split(" | ")[0], "torch": torch.__version__, "threads": torch.get_num_threads(),
           "call_overhead_s": stored["call_overhead_s"], "layer_ops": stored["layer_ops"],
           "shapes": {f"{n}x{k}": {str(b): by for b, by in rows.items()} for (n, k), rows in stored["shapes"].items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(raw, indent=1))
    os.replace(tmp, path)  # atomic: concurrent starts (replicas, ranks) never read a torn file
