"""SLO-aware scheduling: goodput and per-class SLO attainment of each scheduling policy, in one run.

    .venv/bin/python benchmarks/slo_scheduling.py [--policies fcfs,priority,slo] [--rates 0.5,1,1.5,2]
        [--num-prompts 100] [--seed 0] [--server-args "--model PATH ..."] [--plot-dir DIR] [--result-json FILE]
    .venv/bin/python benchmarks/slo_scheduling.py --scenario vtc [--vtc-ratio 10] [--rates ...]

`--scenario policies` (default): for each policy, start `kvflow serve --scheduling-policy P
<--server-args>` on a free port, wait for /health, send one untimed warm-up request, run the
`mixed` workload of `kvflow bench serve` (interactive and batch requests in one Poisson stream,
each request carrying its own priority, ttft_slo_ms and tpot_slo_ms) at one rate, then stop the
server; a fresh server for every rate. Every policy gets the same requests and arrivals (same --seed). Prints one table (policy x
rate: goodput against each request's own SLO, attainment overall / interactive / batch,
interactive TTFT p99, share of batch requests that finished) and plots goodput vs rate.

`--scenario vtc`: two clients in one stream, `user` "heavy" sending --vtc-ratio times the
requests of "light". The server runs with `--fairness none`, then `--fairness vtc`; the table gives
the light client's TTFT p99 alone (its requests only, at its own rate), mixed without VTC and
mixed with VTC. Rates are the total offered rate of both clients.

Every workload flag of `kvflow bench serve` works here (--scale 0.1 and the --interactive-* /
--batch-* SLO flags are the useful ones on a CPU). Needs a server with --scheduling-policy and
--fairness: without them the harness stops with a message saying so.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.bench.metrics import GroupMetrics
from kvflow.bench.report import format_table, line_plot, percent
from kvflow.bench.serve_client import RunResult, parse_rates
from kvflow.bench.servers import flag_value, harness_tokenizer, scrape, server_max_model_len
from kvflow.cli.bench import _positive_float, add_client_args, add_dataset_args
from kvflow.utils.processes import ManagedProcess, ServerError, exit_on_sigterm, free_port, indented_tail
from kvflow.utils.prometheus import parse_prometheus

POLICIES = ("fcfs", "priority", "slo")
SCHEDULING_FLAGS = ("--scheduling-policy", "--fairness", "--default-ttft-slo-ms", "--default-tpot-slo-ms")
DEFAULT_SERVER_CMD = f"{shlex.quote(sys.executable)} -m kvflow.cli.main serve"

# ----------------------------------------------------------------------------------------------
# What runs: server variants and workloads
# ----------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """Requests sent at `rate_factor` x each rate of --rates (the light client alone runs at its share)."""

    name: str
    requests: list
    rate_factor: float = 1.0


@dataclass
class ServerVariant:
    """One server configuration: a label for the tables and the flags that make it."""

    label: str
    flags: list[str]
    workloads: list[Workload] = field(default_factory=list)


@dataclass
class Run:
    """One workload at one rate on one server variant. `rate` is the nominal (total) rate of --rates."""

    server: str
    workload: str
    rate: float
    result: RunResult

    def to_dict(self) -> dict:
        return {"server": self.server, "workload": self.workload, "rate": self.rate, **self.result.to_dict()}


def policy_variants(policies: Sequence[str], requests: list) -> list[ServerVariant]:
    return [ServerVariant(p, ["--scheduling-policy", p], [Workload("mixed", requests)]) for p in policies]


def vtc_variants(requests: list, light: str = "light") -> list[ServerVariant]:
    """Without VTC: the light client alone at its share of the rate, then both; with VTC: both."""
    alone = [r for r in requests if r.extra_body.get("user") == light]
    if not alone:
        raise ValueError(f"the workload has no request from client {light!r}: raise --num-prompts")
    # Its share of the requests is exact (the mixed dataset assigns clients by exact counts), so
    # alone it arrives at the same mean rate as it does inside the mixed stream.
    share = len(alone) / len(requests)
    return [
        ServerVariant(
            "no VTC", ["--fairness", "none"], [Workload("light only", alone, share), Workload("mixed", requests)]
        ),
        ServerVariant("VTC", ["--fairness", "vtc"], [Workload("mixed", requests)]),
    ]


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def _policies(spec: str) -> list[str]:
    names = [p.strip() for p in spec.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"policies must be among {', '.join(POLICIES)}, got {spec!r}")
    return names


def _rates(spec: str) -> list[float]:
    try:
        rates = parse_rates(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if math.inf in rates:  # a goodput-vs-rate curve needs finite offered rates
        raise argparse.ArgumentTypeError("--rates must be finite")
    return rates


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scenario",
        choices=("policies", "vtc"),
        default="policies",
        help="policies: one server per --policies; vtc: fairness none vs vtc (default policies)",
    )
    ap.add_argument(
        "--policies",
        type=_policies,
        default=list(POLICIES),
        help=f"comma-separated scheduling policies (default {','.join(POLICIES)})",
    )
    ap.add_argument(
        "--rates",
        type=_rates,
        default=[0.5, 1.0, 1.5, 2.0],
        help="comma-separated request rates, req/s (default 0.5,1,1.5,2)",
    )
    ap.add_argument("--server-args", default="", help='more `kvflow serve` flags, one string (e.g. "--model DIR")')
    ap.add_argument(
        "--server-cmd",
        default=DEFAULT_SERVER_CMD,
        help="the command that starts the server, before its flags (default: this python's "
        "`-m kvflow.cli.main serve`; e.g. `taskset -c 0-7 kvflow serve`)",
    )
    ap.add_argument(
        "--startup-timeout", type=_positive_float, default=600.0, help="seconds to wait for /health (default 600)"
    )
    ap.add_argument(
        "--stop-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds after SIGTERM before the server is killed (default 30)",
    )
    ap.add_argument(
        "--vtc-ratio",
        type=_positive_float,
        default=10.0,
        help="vtc: the heavy client's rate over the light one's (default 10)",
    )
    ap.add_argument("--plot-dir", default=None, help="write the goodput (vtc: light TTFT p99) vs rate PNG here")
    ap.add_argument("--result-json", default=None, help="write config, machine info and every run here")
    add_client_args(ap, default_timeout=600.0)
    add_dataset_args(ap, 100)
    ap.set_defaults(dataset="mixed")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.server_flags = shlex.split(args.server_args)
    own = "--fairness" if args.scenario == "vtc" else "--scheduling-policy"
    if flag_value(args.server_flags, own) is not None:  # the harness sets it, one server per value
        raise SystemExit(
            f"slo_scheduling: error: the {args.scenario} scenario sets {own} itself; drop it from --server-args"
        )
    if args.scenario == "vtc" and not args.mixed_users:
        args.mixed_users = f"heavy:{args.vtc_ratio:g},light:1"
    return args


# ----------------------------------------------------------------------------------------------
# The server subprocess
# ----------------------------------------------------------------------------------------------


def start_failure_message(log: str, returncode: int | None) -> str:
    """Why the server did not come up, from its log: an unknown scheduling flag gets its own message."""
    lines = log.strip().splitlines()
    for line in lines:
        if ("unrecognized arguments" in line or "invalid choice" in line) and any(f in line for f in SCHEDULING_FLAGS):
            return (
                f"kvflow serve does not accept the scheduling flags ({line.strip()}). The harness needs a server "
                "with --scheduling-policy fcfs|priority|slo and --fairness none|vtc: the SLO-aware scheduling "
                "work has not landed in this checkout, or this environment runs another kvflow."
            )
    how = f"exited with code {returncode}" if returncode is not None else "did not answer /health in time"
    return f"kvflow serve {how}; last lines of its log:\n{indented_tail(log)}"


class ManagedServer(ManagedProcess):
    """`kvflow serve` (`cmd`, then `--port P`, then `flags`) on a free port, its log in a temporary
    file; a failed start is explained by `start_failure_message`. Always stopped on exit."""

    def __init__(self, cmd: Sequence[str], flags: Sequence[str], startup_timeout: float, stop_timeout: float):
        port = free_port()
        super().__init__(
            [*cmd, "--port", str(port), *flags], port, startup_timeout=startup_timeout, stop_timeout=stop_timeout
        )

    def failure(self, returncode: int | None) -> ServerError:
        return ServerError(start_failure_message(self.log_text() or "", returncode))


def check_fits(requests: Sequence[Any], max_model_len: int | None) -> None:
    """Fail before measuring when a request cannot fit: its 400 would read as a scheduling failure."""
    if max_model_len is None:
        return
    need = max(r.prompt_len + r.output_len + 1 for r in requests)  # +1: a BOS the server may add
    if need > max_model_len:
        raise ServerError(
            f"the longest request needs {need} tokens but the server's max_model_len is "
            f"{max_model_len}: lower --scale or --max-input-len/--max-output-len, or serve a "
            "longer --max-model-len"
        )


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def warm_up(cfg: Any, tokenizer: Any, requests: Sequence[Any] = ()) -> None:
    """Untimed requests first: a short one, then one as long as the workload's longest prompt (two
    output tokens, no SLO), so first-call set-up (allocation, kernels, the first full-size prefill chunks) is not
    charged to whichever policy or rate runs first."""
    from kvflow.bench.datasets import BenchRequest
    from kvflow.bench.serve_client import run_benchmark

    warm = [BenchRequest(prompt="the city of light", prompt_len=4, output_len=2)]
    if requests:
        longest = max(requests, key=lambda r: r.prompt_len)
        # Its words reversed: as long, but no prefix-cache hit for the measured request.
        prompt = longest.prompt[::-1] if isinstance(longest.prompt, list) else " ".join(longest.prompt.split()[::-1])
        warm.append(replace(longest, prompt=prompt, output_len=2, extra_body={}))
    for req in warm:
        res = run_benchmark([req], replace(cfg, disable_tqdm=True), tokenizer)
        if not res.records[0].success:
            raise ServerError(f"the warm-up request failed: {res.records[0].error}")


def run_variant(variant: ServerVariant, args: argparse.Namespace, tokenizer: Any) -> list[Run]:
    """Each workload at each rate on a fresh server: nothing one run leaves behind (prefix-cache
    hits on the same prompts, VTC counters, a fitted cost model) helps or hurts the next."""
    from kvflow.bench.report import slo_tables
    from kvflow.bench.serve_client import run_benchmark
    from kvflow.cli.bench import serve_config

    runs = []
    for w in variant.workloads:
        for rate in args.rates:
            with ManagedServer(
                shlex.split(args.server_cmd), variant.flags + args.server_flags, args.startup_timeout, args.stop_timeout
            ) as server:
                cfg = serve_config(args, server.url)
                check_fits(w.requests, server_max_model_len(server.url))
                warm_up(cfg, tokenizer, w.requests)
                res = run_benchmark(w.requests, replace(cfg, request_rate=rate * w.rate_factor), tokenizer)
                server.check_alive()
                error = step_cost_error(server.url)
            runs.append(Run(variant.label, w.name, rate, res))
            print(
                f"\n{variant.label}, {w.name}, rate {rate:g} req/s: {res.metrics.completed}/"
                f"{res.metrics.num_requests} ok in {res.duration_s:.1f} s"
            )
            print(slo_tables(res.metrics))
            if error is not None:
                print(
                    f"{variant.label}: the step-time model's median prediction error over the last steps: "
                    f"{100 * error:.1f}%"
                )
    return runs


def step_cost_error(base_url: str) -> float | None:
    """The server's kvflow:step_cost_prediction_error gauge (None if it does not export it)."""
    samples = parse_prometheus(scrape(base_url, timeout=5.0))
    return next((v for name, labels, v in samples if name == "kvflow:step_cost_prediction_error" and not labels), None)


# ----------------------------------------------------------------------------------------------
# Tables and plots (pure: they only read the runs)
# ----------------------------------------------------------------------------------------------


@dataclass
class PolicyRow:
    policy: str
    rate: float
    goodput: float | None  # req/s meeting their own SLOs
    attainment: float | None  # shares in [0, 1]
    interactive: float | None
    batch: float | None
    interactive_ttft_p99_ms: float | None
    batch_finished: float | None  # batch requests that succeeded / sent


def policy_row(run: Run) -> PolicyRow:
    m = run.result.metrics
    overall, inter, batch = m.per_request_slo, m.classes.get("interactive"), m.classes.get("batch")

    def attained(g: GroupMetrics | None) -> float | None:
        return g.attainment if g is not None else None

    return PolicyRow(
        policy=run.server,
        rate=run.rate,
        goodput=overall.goodput if overall is not None else None,
        attainment=attained(overall),
        interactive=attained(inter),
        batch=attained(batch),
        interactive_ttft_p99_ms=inter.ttft_ms.get("p99") if inter is not None else None,
        batch_finished=batch.completed / batch.sent if batch is not None and batch.sent else None,
    )


def policy_table(rows: Sequence[PolicyRow]) -> str:
    return format_table(
        [
            "policy",
            "rate",
            "goodput",
            "attain %",
            "interactive %",
            "batch %",
            "interactive TTFT p99 ms",
            "batch finished %",
        ],
        [
            [
                r.policy,
                f"{r.rate:g}",
                r.goodput,
                percent(r.attainment),
                percent(r.interactive),
                percent(r.batch),
                r.interactive_ttft_p99_ms,
                percent(r.batch_finished),
            ]
            for r in rows
        ],
        title="SLO-aware scheduling: mixed workload, each request against its own SLO (goodput in req/s)",
    )


@dataclass
class VtcRow:
    """The light client's TTFT p99 (ms) at one total rate."""

    rate: float
    alone: float | None
    mixed: float | None  # with the heavy client, no VTC
    mixed_vtc: float | None


def light_ttft_p99(run: Run | None, light: str = "light") -> float | None:
    g = run.result.metrics.users.get(light) if run is not None else None
    return g.ttft_ms.get("p99") if g is not None else None


def vtc_rows(runs: Sequence[Run], light: str = "light") -> list[VtcRow]:
    by_key = {(r.server, r.workload, r.rate): r for r in runs}
    rates = list(dict.fromkeys(r.rate for r in runs))
    return [
        VtcRow(
            rate,
            light_ttft_p99(by_key.get(("no VTC", "light only", rate)), light),
            light_ttft_p99(by_key.get(("no VTC", "mixed", rate)), light),
            light_ttft_p99(by_key.get(("VTC", "mixed", rate)), light),
        )
        for rate in rates
    ]


def vtc_table(rows: Sequence[VtcRow]) -> str:
    return format_table(
        ["rate", "light alone", "mixed, no VTC", "mixed, VTC"],
        [[f"{r.rate:g}", r.alone, r.mixed, r.mixed_vtc] for r in rows],
        title="VTC fairness: the light client's TTFT p99 (ms); rate = both clients' req/s",
    )


def plot_policies(rows: Sequence[PolicyRow], out_dir: str) -> str | None:
    series: dict[str, tuple[list[float], list[float | None]]] = {}
    for r in rows:
        xs, ys = series.setdefault(r.policy, ([], []))
        xs.append(r.rate)
        ys.append(r.goodput)
    return line_plot(
        series,
        "request rate (req/s)",
        "goodput (req/s meeting their own SLO)",
        "Goodput by scheduling policy",
        os.path.join(out_dir, "slo_goodput.png"),
    )


def plot_vtc(rows: Sequence[VtcRow], out_dir: str) -> str | None:
    xs = [r.rate for r in rows]
    series = {
        "light alone": (xs, [r.alone for r in rows]),
        "mixed, no VTC": (xs, [r.mixed for r in rows]),
        "mixed, VTC": (xs, [r.mixed_vtc for r in rows]),
    }
    return line_plot(
        series,
        "total request rate (req/s)",
        "light client TTFT p99 (ms)",
        "VTC fairness",
        os.path.join(out_dir, "vtc_light_ttft.png"),
    )


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def report(runs: Sequence[Run], args: argparse.Namespace) -> None:
    from kvflow.bench.report import dump_json
    from kvflow.cli.bench import workload_spec

    if args.scenario == "vtc":
        rows: Sequence[Any] = vtc_rows(runs)
        table, plot = vtc_table(rows), plot_vtc
    else:
        rows = [policy_row(r) for r in runs]
        table, plot = policy_table(rows), plot_policies
    print()
    print(table)
    if args.plot_dir:
        path = plot(rows, args.plot_dir)
        if path:
            print(f"wrote {path}")
    if args.result_json:
        conf = {k: v for k, v in vars(args).items() if k not in ("server_flags", "api_key")}
        conf["workload"] = vars(workload_spec(args))
        dump_json(args.result_json, conf, [r.to_dict() for r in runs])
        print(f"wrote {args.result_json}")


def main(argv: Sequence[str] | None = None) -> int:
    from spec_decode import cpu_line

    from kvflow.cli.bench import build_workload

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # unwinds through ManagedServer.__exit__
    print(cpu_line(flag_value(args.server_flags, "--quantization")))
    tokenizer = harness_tokenizer(args.tokenizer, args.server_flags)
    requests = build_workload(args, tokenizer)
    if args.scenario == "vtc":
        variants = vtc_variants(requests)
    else:
        variants = policy_variants(args.policies, requests)
    runs: list[Run] = []
    try:
        for v in variants:
            runs += run_variant(v, args, tokenizer)
    except ServerError as e:
        print(f"slo_scheduling: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the server is already stopped (ManagedServer.__exit__)
        print("slo_scheduling: interrupted", file=sys.stderr)
        return 130
    finally:
        if runs:
            report(runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
