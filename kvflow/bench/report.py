"""Reporting: aligned plain-text tables, a JSON file with every figure + machine info, PNG plots.

matplotlib is imported lazily and uses the Agg backend (no display needed).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from kvflow.bench.metrics import BenchmarkMetrics, GroupMetrics, RequestRecord, tpot, ttft

# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def fmt_num(x: Any, digits: int = 2) -> str:
    """Numbers with thousands separators; None/NaN as '-'; inf as 'inf'."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return f"{x:,.{digits}f}"
    return str(x)


def format_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], digits: int = 2, title: str | None = None
) -> str:
    """Plain-text table: text columns left-aligned, numeric columns right-aligned."""
    rows = [list(r) for r in rows]
    cells = [[c if isinstance(c, str) else fmt_num(c, digits) for c in r] for r in rows]
    numeric = [
        all(not isinstance(r[i], str) or r[i] in ("-", "") for r in rows) if rows else False
        for i in range(len(headers))
    ]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if numeric[i] else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))
        ).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(list(headers)))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def format_kv(pairs: Sequence[tuple[str, Any]], digits: int = 2, title: str | None = None) -> str:
    """Two aligned columns: label, value."""
    width = max((len(k) for k, _ in pairs), default=0)
    out = [f"{'=' * 12} {title} {'=' * 12}"] if title else []
    for k, v in pairs:
        out.append(f"{k.ljust(width)}  {v if isinstance(v, str) else fmt_num(v, digits)}")
    return "\n".join(out)


def metrics_summary(m: BenchmarkMetrics, title: str = "Serving benchmark") -> str:
    """A vLLM-style block of the run's figures (latencies in ms)."""
    pairs: list[tuple[str, Any]] = [
        ("Successful requests", m.completed),
        ("Failed requests", m.failed),
        ("Benchmark duration (s)", m.duration_s),
        ("Total input tokens", m.total_input_tokens),
        ("Total output tokens", m.total_output_tokens),
        ("Request throughput (req/s)", m.request_throughput),
        ("Input token throughput (tok/s)", m.input_throughput),
        ("Output token throughput (tok/s)", m.output_throughput),
        ("Total token throughput (tok/s)", m.total_token_throughput),
        ("Max concurrent requests", m.max_concurrent_requests),
    ]
    if m.goodput is not None:
        slo = ", ".join(f"{k[:-3]}<={v:g}ms" for k, v in (m.slo or {}).items() if v is not None)
        pairs.append((f"Goodput (req/s) [{slo}]", m.goodput))
    if m.per_request_slo is not None:
        pairs.append(("Goodput, own SLOs (req/s)", m.per_request_slo.goodput))
        pairs.append(("SLO attainment, own SLOs (%)", percent(m.per_request_slo.attainment)))
    text = [format_kv(pairs, title=title)]
    stat_names = [k for k in m.ttft_ms if k not in ("count", "std", "min", "max", "p50")]
    rows = []
    for label, s in (
        ("TTFT", m.ttft_ms),
        ("TPOT", m.tpot_ms),
        ("ITL (excl. TTFT)", m.itl_ms),
        ("E2EL", m.e2el_ms),
        ("Client queue", m.queue_delay_ms),
    ):
        rows.append([label, s["count"]] + [s[k] for k in stat_names])
    text.append(format_table(["latency (ms)", "n"] + stat_names, rows))
    return "\n".join(text)


def percent(x: float | None) -> float | None:
    """A share in [0, 1] as a percentage (None stays None)."""
    return None if x is None else 100.0 * x


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, None when either is missing or NaN or den is 0 (for comparison columns)."""
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def group_table(
    groups: dict[str, GroupMetrics], overall: GroupMetrics | None = None, label: str = "class", title: str | None = None
) -> str:
    """One row per group (and an `all` row): SLO attainment against each request's own SLO, TTFT/TPOT."""
    rows = []
    named = list(groups.items()) + ([("all", overall)] if overall is not None else [])
    for name, g in named:
        slo = g.slo or {}
        rows.append(
            [
                name,
                g.sent,
                g.completed,
                g.met_slo,
                percent(g.attainment),
                slo.get("ttft_ms"),
                slo.get("tpot_ms"),
                g.ttft_ms.get("median"),
                g.ttft_ms.get("p99"),
                g.tpot_ms.get("median"),
                g.tpot_ms.get("p99"),
                g.goodput,
            ]
        )
    return format_table(
        [
            label,
            "sent",
            "ok",
            "met SLO",
            "attain %",
            "TTFT SLO",
            "TPOT SLO",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "TPOT p99",
            "goodput",
        ],
        rows,
        title=title,
    )


def slo_tables(m: BenchmarkMetrics) -> str:
    """Per-class and per-client tables of a run ('' when its requests have neither)."""
    parts = []
    if m.classes:
        parts.append(
            group_table(
                m.classes, m.per_request_slo, "class", "Per class, each request against its own SLO (ms; goodput req/s)"
            )
        )
    if m.users:
        parts.append(group_table(m.users, None, "client", "Per client (ms; goodput req/s)"))
    return "\n".join(parts)


def run_goodput(m: BenchmarkMetrics) -> float | None:
    """Goodput on the run-wide SLO flags, else against each request's own SLO (None without either)."""
    if m.goodput is not None:
        return m.goodput
    return m.per_request_slo.goodput if m.per_request_slo is not None else None


def sweep_table(results: Sequence[Any]) -> str:
    """One row per request rate of a sweep (RunResult objects)."""
    rows = []
    for r in results:
        m = r.metrics
        rows.append(
            [
                f"{r.request_rate:g}",
                m.completed,
                m.failed,
                m.request_throughput,
                m.output_throughput,
                m.ttft_ms.get("median"),
                m.ttft_ms.get("p99"),
                m.tpot_ms.get("median"),
                m.tpot_ms.get("p99"),
                m.itl_ms.get("p99"),
                run_goodput(m),
            ]
        )
    return format_table(
        [
            "rate",
            "ok",
            "failed",
            "req/s",
            "out tok/s",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "TPOT p99",
            "ITL p99",
            "goodput",
        ],
        rows,
        title="Sweep (latencies in ms)",
    )


def run_report(r: Any, title: str | None = None) -> str:
    """Everything printed about one run (a RunResult): figures, per-class/client tables, failures."""
    title = title or f"Serving benchmark, {r.model}, rate {r.request_rate:g} req/s"
    parts = [metrics_summary(r.metrics, title=title), slo_tables(r.metrics), failure_summary(r.records)]
    return "\n".join(p for p in parts if p)


def setup_block(pairs: Sequence[tuple[str, Any]], title: str, records: Sequence[RequestRecord]) -> str:
    """One setup's figures (`format_kv`), then its failed requests' errors when there are any."""
    fails = failure_summary(records)
    return format_kv(pairs, title=title) + ("\n" + fails if fails else "")


def failure_summary(records: Sequence[RequestRecord], limit: int = 5) -> str:
    """The most common error texts of failed requests, with counts ('' if none failed)."""
    from collections import Counter

    errs = Counter(r.error for r in records if not r.success)
    if not errs:
        return ""
    lines = [f"{sum(errs.values())} request(s) failed; most common errors:"]
    for err, n in errs.most_common(limit):
        lines.append(f"  {n:>5} x {err[:200]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------------------


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_line(lscpu: str | None = None) -> str:
    """`CPU: <lscpu Model name>; avx2 yes, avx512f no, ...` (amx: any amx_* flag)."""
    if lscpu is None:
        try:
            import subprocess

            lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        except OSError:
            lscpu = ""
    model = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.strip().startswith("Model name")), "unknown"
    )
    flags_line = next((ln.split(":", 1)[1] for ln in lscpu.splitlines() if ln.strip().startswith("Flags")), "")
    flags = set(flags_line.split())
    have = {
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "avx512_vnni": "avx512_vnni" in flags,
        "amx": any(f.startswith("amx") for f in flags),
    }
    return f"CPU: {model}; " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in have.items())


def machine_info() -> dict:
    """CPU model, cores, memory, python/torch versions, platform and the date (UTC, ISO 8601)."""
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    try:
        info["usable_cores"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        info["usable_cores"] = os.cpu_count()
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory_gb"] = round(int(line.split()[1]) * 1024 / 1e9, 2)
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except Exception:
        info["torch"] = None
    try:
        from importlib.metadata import version

        info["kvflow"] = version("kvflow")
    except Exception:
        pass
    return info


def json_safe(obj: Any) -> Any:
    """Replace NaN/inf (not valid JSON) by None / "inf" / "-inf", recursively; dataclasses → dicts."""
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = obj.to_dict() if hasattr(obj, "to_dict") else dataclasses.asdict(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return json_safe(obj.item())
    return obj


def dump_json(path: str, config: dict, results: Any, extra: dict | None = None) -> str:
    """Write {"config", "machine", "results", ...extra} to `path` (folders created). Returns path."""
    doc = {"config": config, "machine": machine_info(), "results": results}
    if extra:
        doc.update(extra)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_safe(doc), f, indent=2)
        f.write("\n")
    return path


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf_plot(series: dict[str, list[float]], xlabel: str, title: str, path: str) -> str | None:
    import numpy as np

    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, vals in series.items():
        x = np.sort(np.asarray(vals, dtype=float))
        y = np.arange(1, x.size + 1) / x.size
        ax.step(x, y, where="post", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(series) > 1 or next(iter(series)):
        ax.legend(fontsize="small")
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: str) -> str:
    """Write the figure as a PNG (folders created), free it, return the path."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rate_label(rate: float) -> str:
    return "rate inf" if rate == math.inf else f"rate {rate:g} req/s"


def plot_cdfs(results: Sequence[Any], out_dir: str, prefix: str = "") -> list[str]:
    """TTFT and TPOT CDF PNGs (one line per run). Returns the paths written."""
    ttfts = {_rate_label(r.request_rate): [v * 1e3 for v in map(ttft, r.records) if v is not None] for r in results}
    tpots = {_rate_label(r.request_rate): [v * 1e3 for v in map(tpot, r.records) if v is not None] for r in results}
    paths = [
        _cdf_plot(ttfts, "TTFT (ms)", "TTFT CDF", os.path.join(out_dir, f"{prefix}ttft_cdf.png")),
        _cdf_plot(tpots, "TPOT (ms)", "TPOT CDF", os.path.join(out_dir, f"{prefix}tpot_cdf.png")),
    ]
    return [p for p in paths if p]


def plot_sweep(results: Sequence[Any], out_dir: str, prefix: str = "") -> str | None:
    """p99 TTFT, p99 TPOT and goodput (or request throughput) vs request rate, one PNG."""
    finite = [r for r in results if r.request_rate != math.inf]
    if len(finite) < 2:
        return None
    plt = _pyplot()
    rates = [r.request_rate for r in finite]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(rates, [r.metrics.ttft_ms["p99"] for r in finite], "o-")
    axes[0].set_title("p99 TTFT")
    axes[0].set_ylabel("ms")
    axes[1].plot(rates, [r.metrics.tpot_ms["p99"] for r in finite], "o-")
    axes[1].set_title("p99 TPOT")
    axes[1].set_ylabel("ms")
    has_goodput = any(run_goodput(r.metrics) is not None for r in finite)
    axes[2].plot(rates, [r.metrics.request_throughput for r in finite], "s--", label="throughput")
    if has_goodput:
        axes[2].plot(rates, [run_goodput(r.metrics) for r in finite], "o-", label="goodput")
    axes[2].plot(rates, rates, ":", color="gray", label="offered rate")
    axes[2].set_title("goodput" if has_goodput else "request throughput")
    axes[2].set_ylabel("req/s")
    axes[2].legend(fontsize="small")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}sweep.png")
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_plot(
    series: dict[str, tuple[Sequence[float], Sequence[float | None]]], xlabel: str, ylabel: str, title: str, path: str
) -> str | None:
    """One line per series (label -> (xs, ys); None ys are gaps), one PNG. None when there is nothing to draw."""
    series = {k: v for k, v in series.items() if len(v[0])}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), [math.nan if y is None else y for y in ys], "o-", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(plt, fig, path)
