"""Data parallelism on a small CPU: `kvflow serve --data-parallel-size 2` with each router policy
under a multi-prefix workload, and two 1-thread replicas against one 2-thread engine.

    .venv/bin/python benchmarks/dp_router.py [--parts prefix,throughput] [--cpus 0,1]
        [--groups 8] [--prefix-len 1024] [--per-group 16] [--question-len 32] [--prefix-output-len 32]
        [--prefix-rate inf] [--prefix-concurrency 16] [--policies round_robin,cache_aware,cache_aware_kv_events]
        [--tp-requests 64] [--tp-concurrency 64] [--tp-input-len 256] [--tp-output-len 128]
        [--tp-shared-prefix-len 0] [--tp-endpoint completions|chat] [--dp-policy cache_aware] [--seed 0] [--server-args "--model DIR ..."] [--result-json FILE]

Every server is started fresh, measured and stopped in turn, under `taskset -c CPUS` (--cpus;
default the first two CPUs this process may use). A data-parallel server splits those CPUs
evenly between its replicas itself (2 CPUs / 2 replicas: one each, OMP_NUM_THREADS=1) and runs
its router in the same (pinned) process; the one engine gets them all (OMP_NUM_THREADS = their
number). The client (this script) is not pinned: on a two-core machine it takes some of the same
cores. Without `taskset` (or with fewer than two usable CPUs) nothing is pinned and the output says so.

Part `prefix` (one server per --policies entry, the same requests, same seed, in the same order):
the `shared-prefix` dataset of `kvflow bench serve` (kvflow/bench/datasets.py): --groups system
prompts of --prefix-len tokens, --per-group questions of --question-len tokens each (shuffled,
seeded), --prefix-output-len output tokens, streamed completions (ignore_eos, temperature 0), at
--prefix-rate req/s (Poisson; inf: all at once) with at most --prefix-concurrency in flight. Per
policy: the prefix-cache hit rate summed over the replicas (each replica's /metrics, listed by the
server's GET /replicas: kvflow:prefix_cache_hits_total / kvflow:prefix_cache_queries_total, both
in prompt tokens, after minus before the timed run), the prompt tokens the engines computed, how
the router split the requests (kvflow_router:requests_total by replica), TTFT p50/p99, TPOT p50,
throughput. The engines' KV pools are their defaults (--server-args "--num-kv-blocks N" to shrink
them: when one replica cannot hold every prefix, round robin evicts what cache_aware keeps).
`cache_aware_kv_events` in --policies is cache_aware with `--router-kv-events`: the router routes on
the blocks each replica reports holding, evictions included, instead of on the prompts it sent.

Part `throughput`: --tp-requests requests of the `random` dataset (--tp-input-len prompt tokens,
--tp-output-len output tokens), all sent at once with at most --tp-concurrency in flight, against
one engine (all --cpus, one thread each) and against `--data-parallel-size 2 --router-policy
--dp-policy`: output tokens/s, TTFT p50/p99, TPOT p50/p99, and the largest share of the requests
one replica got. With --tp-shared-prefix-len N every prompt starts with the same N tokens (a short
system prompt; the rest, --tp-input-len - N tokens, differs): does a short shared prefix pull
everything onto one replica? --tp-endpoint chat sends them as chat completions (one user message),
e.g. 32 concurrent chats sharing a 32-token prefix over two replicas against one engine:

    .venv/bin/python benchmarks/dp_router.py --parts throughput --tp-requests 32 --tp-concurrency 32 \
        --tp-endpoint chat --tp-shared-prefix-len 32 --tp-input-len 96

Before each timed run, every engine (each replica directly, not through the router) answers two
untimed requests of random text: a short one and one as long as the part's longest prompt, so
start-up costs are not charged to whichever setup runs first; their text shares no prefix with
the workload. Prompts have exact token lengths under the served model's tokenizer (or --tokenizer).

Printed: the CPU line (lscpu model name; avx2 / avx512f / avx512_vnni / amx), the pinning, one
block per setup, then a table per part. --result-json writes config, machine, every figure and
every request. Server logs go to a temporary folder (printed); a server that fails to start is an
error with its log's last lines. Servers are stopped (SIGTERM, SIGKILL after --stop-timeout) on
every exit path, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.bench.report import cpu_line, percent, ratio
from kvflow.bench.report import fmt_num as _f
from kvflow.bench.servers import (
    add_harness_args,
    harness_tokenizer,
    nonneg_int,
    parse_server_flags,
    pinning_cpus,
    scrape,
    served_model,
    server_max_model_len,
    thread_env,
)
from kvflow.cli.bench import _positive_float, _positive_int
from kvflow.utils.processes import ManagedProcess, ServerError, exit_on_sigterm, free_port, pinned
from kvflow.utils.prometheus import by_label, parse_prometheus, sample_sum

PARTS = ("prefix", "throughput")
DP_POLICIES = ("round_robin", "least_loaded", "cache_aware")
# Part prefix also takes cache_aware following the replicas' KV events (`--router-kv-events`).
KV_EVENTS_POLICY = "cache_aware_kv_events"
# Flags the harness sets itself: they may not come in --server-args.
OWN_FLAGS = ("--port", "--host", "--data-parallel-size", "--router-policy")
PYTHON_CMD = [sys.executable, "-m", "kvflow.cli.main"]
# Independent seeded streams of one --seed.
PREFIX_WORKLOAD, THROUGHPUT_WORKLOAD, WARM_PROMPTS = range(3)

# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def _names(spec: str, allowed: Sequence[str], what: str) -> list[str]:
    names = list(dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()))
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{what} must be among {','.join(allowed)}, got {spec!r}")
    return names


def parse_parts(spec: str) -> list[str]:
    """'prefix,throughput' -> ['prefix', 'throughput'] (order kept, duplicates dropped)."""
    return _names(spec, PARTS, "parts")


def parse_policies(spec: str) -> list[str]:
    return _names(spec, (*DP_POLICIES, KV_EVENTS_POLICY), "policies")


def parse_cpus(spec: str) -> list[int]:
    """'0,1' or '0-3' or '0,2-3' -> sorted distinct CPU numbers."""
    out: set[int] = set()
    try:
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cpus must be like 0,1 or 0-3, got {spec!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"--cpus must name CPUs >= 0, got {spec!r}")
    return sorted(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--parts",
        type=parse_parts,
        default=list(PARTS),
        help="comma-separated, run in this order: prefix (router policies), throughput (DP vs "
        "one engine) (default prefix,throughput)",
    )
    ap.add_argument(
        "--cpus",
        type=parse_cpus,
        default=None,
        help="CPUs every server is pinned to, e.g. 0,1 (default: the first two usable CPUs)",
    )
    ap.add_argument("--data-parallel-size", type=_positive_int, default=2, help="replicas (default 2)")
    g = ap.add_argument_group("part prefix")
    g.add_argument(
        "--policies",
        type=parse_policies,
        default=["round_robin", "cache_aware"],
        help="router policies compared, in this order (default round_robin,cache_aware); "
        f"{KV_EVENTS_POLICY}: cache_aware with --router-kv-events",
    )
    g.add_argument("--groups", type=_positive_int, default=8, help="system prompts (default 8)")
    g.add_argument("--prefix-len", type=_positive_int, default=1024, help="tokens per system prompt (default 1024)")
    g.add_argument("--per-group", type=_positive_int, default=16, help="questions per system prompt (default 16)")
    g.add_argument("--question-len", type=_positive_int, default=32, help="tokens per question (default 32)")
    g.add_argument("--prefix-output-len", type=_positive_int, default=32, help="max_tokens (default 32)")
    g.add_argument(
        "--prefix-rate",
        type=_positive_float,
        default=math.inf,
        help="requests per second, Poisson; inf: all at once (default inf)",
    )
    g.add_argument("--prefix-concurrency", type=_positive_int, default=16, help="most requests in flight (default 16)")
    g = ap.add_argument_group("part throughput")
    g.add_argument("--tp-requests", type=_positive_int, default=64, help="requests (default 64)")
    g.add_argument("--tp-concurrency", type=_positive_int, default=64, help="most in flight (default 64)")
    g.add_argument("--tp-input-len", type=_positive_int, default=256, help="prompt tokens (default 256)")
    g.add_argument("--tp-output-len", type=_positive_int, default=128, help="max_tokens (default 128)")
    g.add_argument(
        "--tp-shared-prefix-len",
        type=nonneg_int,
        default=0,
        help="tokens every prompt starts with (the same for all; 0: random prompts, no shared prefix) (default 0)",
    )
    g.add_argument(
        "--tp-endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="completions, or chat (each prompt as one user message) (default completions)",
    )
    g.add_argument(
        "--dp-policy",
        choices=DP_POLICIES,
        default="cache_aware",
        help="--router-policy of the data-parallel server (default cache_aware, kvflow serve's)",
    )
    add_harness_args(ap, stop_timeout_s=60.0)
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    parse_server_flags(ap, args, OWN_FLAGS, "--data-parallel-size and --dp-policy / --policies are this script's flags")
    if args.data_parallel_size < 2:
        ap.error("--data-parallel-size must be at least 2 (1 is the one-engine baseline)")
    if args.tp_shared_prefix_len >= args.tp_input_len:
        ap.error(
            f"--tp-shared-prefix-len ({args.tp_shared_prefix_len}) must be below --tp-input-len "
            f"({args.tp_input_len}): each prompt needs tokens of its own"
        )
    return args


# ----------------------------------------------------------------------------------------------
# Workloads (seeded)
# ----------------------------------------------------------------------------------------------


def prefix_workload(args: argparse.Namespace, tokenizer: Any, builder: Any = None) -> list[Any]:
    from kvflow.bench.datasets import WorkloadSpec, generate_requests

    spec = WorkloadSpec(
        dataset="shared-prefix",
        num_prompts=args.groups * args.per_group,
        seed=_seed(args.seed, PREFIX_WORKLOAD),
        prefix_len=args.prefix_len,
        question_len=args.question_len,
        num_groups=args.groups,
        prompts_per_group=args.per_group,
        output_len=args.prefix_output_len,
        shared_prefix_order="shuffled",
    )
    return generate_requests(spec, tokenizer, builder)


def throughput_workload(args: argparse.Namespace, tokenizer: Any, builder: Any = None) -> list[Any]:
    from kvflow.bench.datasets import WorkloadSpec, generate_requests

    if args.tp_shared_prefix_len:
        # one group: the same prefix, then a distinct tail, --tp-input-len tokens in all
        spec = WorkloadSpec(
            dataset="shared-prefix",
            num_prompts=args.tp_requests,
            seed=_seed(args.seed, THROUGHPUT_WORKLOAD),
            prefix_len=args.tp_shared_prefix_len,
            question_len=args.tp_input_len - args.tp_shared_prefix_len,
            num_groups=1,
            prompts_per_group=args.tp_requests,
            output_len=args.tp_output_len,
            shared_prefix_order="shuffled",
        )
        return generate_requests(spec, tokenizer, builder)
    spec = WorkloadSpec(
        dataset="random",
        num_prompts=args.tp_requests,
        seed=_seed(args.seed, THROUGHPUT_WORKLOAD),
        input_len=args.tp_input_len,
        output_len=args.tp_output_len,
    )
    return generate_requests(spec, tokenizer, builder)


def warm_requests(builder: Any, longest_prompt: int, seed: int) -> list[Any]:
    """A short request and one as long as the longest prompt, random text (no shared prefix)."""
    import numpy as np

    from kvflow.bench.datasets import BenchRequest

    rng = np.random.default_rng([seed, WARM_PROMPTS])
    out = []
    for n in (min(8, longest_prompt), longest_prompt):
        prompt, plen = builder.build(n, rng)
        out.append(BenchRequest(prompt=prompt, prompt_len=plen, output_len=2))
    return out


def _seed(seed: int, stream: int) -> int:
    """One integer seed per workload stream (the datasets take an int)."""
    return (seed * 1_000_003 + stream) % 2**32


# ----------------------------------------------------------------------------------------------
# Servers
# ----------------------------------------------------------------------------------------------


@dataclass
class ServerSpec:
    """One server to start: its label (and log name), argv, environment, port."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    data_parallel: bool

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def server_spec(
    name: str,
    cpus: Sequence[int] | None,
    server_flags: Sequence[str],
    *,
    data_parallel_size: int = 1,
    policy: str | None = None,
) -> ServerSpec:
    port = free_port()
    argv = [*PYTHON_CMD, "serve", "--port", str(port)]
    if data_parallel_size > 1:
        events = policy == KV_EVENTS_POLICY
        argv += ["--data-parallel-size", str(data_parallel_size)]
        argv += ["--router-policy", "cache_aware" if events else policy or "cache_aware"]
        argv += ["--router-kv-events"] if events else []
    argv += list(server_flags)
    threads = len(cpus) if cpus is not None else (os.cpu_count() or 1)
    env = thread_env(threads if data_parallel_size == 1 else None)  # a DP server sets its replicas' threads
    return ServerSpec(name, pinned(argv, cpus), env, port, data_parallel_size > 1)


def replica_urls(base_url: str) -> list[str]:
    """The replicas of a data-parallel server (GET /replicas)."""
    import httpx

    try:
        data = httpx.get(base_url + "/replicas", timeout=30, trust_env=False).json()
        return [str(r["url"]) for r in data["replicas"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ServerError(
            f"GET {base_url}/replicas failed ({type(e).__name__}: {e}): not a data-parallel kvflow server?"
        ) from None


# ----------------------------------------------------------------------------------------------
# Counters from /metrics (pure)
# ----------------------------------------------------------------------------------------------


@dataclass
class CacheCounters:
    """Prompt tokens looked up in / found in the engines' prefix caches (summed over replicas)."""

    queries: float = 0.0
    hits: float = 0.0
    per_replica: dict[str, tuple[float, float]] = field(default_factory=dict)  # url -> (queries, hits)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    @property
    def computed(self) -> float:
        """Prompt tokens the engines had to compute (looked up and not found)."""
        return self.queries - self.hits

    def to_dict(self) -> dict:
        return {
            "queries": self.queries,
            "hits": self.hits,
            "hit_rate": self.hit_rate,
            "computed": self.computed,
            "per_replica": {u: {"queries": q, "hits": h} for u, (q, h) in self.per_replica.items()},
        }


def cache_counters(texts: dict[str, str]) -> CacheCounters:
    """The prefix-cache counters of each engine's /metrics text (url -> text), summed."""
    out = CacheCounters()
    for url, text in texts.items():
        s = parse_prometheus(text)
        q, h = sample_sum(s, "kvflow:prefix_cache_queries_total"), sample_sum(s, "kvflow:prefix_cache_hits_total")
        out.per_replica[url] = (q, h)
        out.queries += q
        out.hits += h
    return out


def cache_delta(before: CacheCounters, after: CacheCounters) -> CacheCounters:
    out = CacheCounters()
    for url, (q, h) in after.per_replica.items():
        q0, h0 = before.per_replica.get(url, (0.0, 0.0))
        out.per_replica[url] = (q - q0, h - h0)
        out.queries += q - q0
        out.hits += h - h0
    return out


def router_split(text: str) -> dict[str, float]:
    """kvflow_router:requests_total by backend URL."""
    return by_label(parse_prometheus(text), "kvflow_router:requests_total", "backend")


def router_cache_aware(text: str) -> tuple[float, float] | None:
    """(hits, misses) of the cache_aware policy; None when the router does not export them."""
    s = parse_prometheus(text)
    if not any(n == "kvflow_router:cache_aware_hits_total" for n, _, _ in s):
        return None
    return (
        sample_sum(s, "kvflow_router:cache_aware_hits_total"),
        sample_sum(s, "kvflow_router:cache_aware_misses_total"),
    )


def split_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {u: after.get(u, 0.0) - before.get(u, 0.0) for u in after}


# ----------------------------------------------------------------------------------------------
# One setup
# ----------------------------------------------------------------------------------------------


@dataclass
class SetupResult:
    part: str
    name: str
    label: str
    pinned: bool
    run: Any  # kvflow.bench.serve_client.RunResult
    cache: CacheCounters | None = None
    split: dict[str, float] | None = None  # router requests by replica (timed run)
    router_hits_misses: tuple[float, float] | None = None  # cache_aware's own count (timed run)

    @property
    def m(self) -> Any:
        return self.run.metrics

    def to_dict(self) -> dict:
        recs = []
        for r in self.run.records:
            d = r.to_dict()
            d.pop("generated_text", None)
            recs.append(d)
        return {
            "part": self.part,
            "setup": self.name,
            "label": self.label,
            "pinned": self.pinned,
            "metrics": self.m.to_dict(),
            "cache": self.cache.to_dict() if self.cache is not None else None,
            "router_split": self.split,
            "router_cache_aware_hits_misses": self.router_hits_misses,
            "requests": recs,
        }


def _client_config(
    base_url: str,
    model: str,
    args: argparse.Namespace,
    rate: float,
    concurrency: int,
    seed: int,
    endpoint: str = "completions",
) -> Any:
    from kvflow.bench.serve_client import ServeConfig

    return ServeConfig(
        base_url=base_url,
        endpoint=endpoint,
        model=model,
        request_rate=rate,
        max_concurrency=concurrency,
        seed=seed,
        ignore_eos=True,
        temperature=0.0,
        request_timeout=args.request_timeout,
        disable_tqdm=True,
    )


def warm_up(urls: Sequence[str], model: str, warm: Sequence[Any], args: argparse.Namespace, tokenizer: Any) -> None:
    """The untimed requests, to every engine directly, one after the other; a failure stops the setup."""
    from kvflow.bench.serve_client import run_benchmark

    for url in urls:
        res = run_benchmark(list(warm), _client_config(url, model, args, math.inf, 1, 0), tokenizer)
        bad = [r for r in res.records if not r.success]
        if bad:
            raise ServerError(f"a warm-up request to {url} failed: {bad[0].error}")


def run_setup(
    part: str,
    spec: ServerSpec,
    label: str,
    requests: Sequence[Any],
    warm: Sequence[Any],
    args: argparse.Namespace,
    tokenizer: Any,
    log_dir: str,
    pinned: bool,
    rate: float,
    concurrency: int,
) -> SetupResult:
    from kvflow.bench.serve_client import run_benchmark

    print(f"\n=== {part}: {label} ===", flush=True)
    proc = ManagedProcess(
        spec.argv,
        spec.port,
        name=spec.name,
        env=spec.env,
        log_path=os.path.join(log_dir, f"{spec.name}.log"),
        startup_timeout=args.startup_timeout,
        stop_timeout=args.stop_timeout,
    )
    with proc:
        url = spec.url
        model = served_model(url)
        engines = replica_urls(url) if spec.data_parallel else [url]
        max_len = server_max_model_len(url, timeout=30.0)
        need = max(r.prompt_len + r.output_len for r in [*requests, *warm]) + 1  # +1: a BOS
        if max_len is not None and need > max_len:
            raise ServerError(
                f"the longest request needs {need} tokens but max_model_len is {max_len}: shorten "
                "the workload or serve a longer --max-model-len"
            )
        print(f"engines: {', '.join(engines)}; warming up", flush=True)
        warm_up(engines, model, warm, args, tokenizer)
        cache0 = cache_counters({e: scrape(e) for e in engines})
        router0 = scrape(url) if spec.data_parallel else ""
        what = "all at once" if rate == math.inf else f"Poisson {rate:g} req/s"
        print(f"timed run: {len(requests)} requests, {what}, at most {concurrency} in flight", flush=True)
        endpoint = args.tp_endpoint if part == "throughput" else "completions"
        cfg = _client_config(url, model, args, rate, concurrency, _seed(args.seed, WARM_PROMPTS + 1), endpoint)
        run = run_benchmark(list(requests), cfg, tokenizer)
        proc.check_alive()
        time.sleep(0.5)  # the engines publish their counters between steps
        cache = cache_delta(cache0, cache_counters({e: scrape(e) for e in engines}))
        result = SetupResult(part, spec.name, label, pinned, run, cache)
        if spec.data_parallel:
            router1 = scrape(url)
            result.split = split_delta(router_split(router0), router_split(router1))
            hm0, hm1 = router_cache_aware(router0), router_cache_aware(router1)
            if hm0 is not None and hm1 is not None and "cache_aware" in spec.argv:
                result.router_hits_misses = (hm1[0] - hm0[0], hm1[1] - hm0[1])
    return result


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def setup_report(r: SetupResult) -> str:
    from kvflow.bench.report import setup_block

    m = r.m
    pairs: list[tuple[str, Any]] = [
        ("completed / failed", f"{m.completed} / {m.failed}"),
        ("TTFT p50 / p99 (ms)", f"{_f(m.ttft_ms.get('p50'))} / {_f(m.ttft_ms.get('p99'))}"),
        ("TPOT p50 / p99 (ms)", f"{_f(m.tpot_ms.get('p50'))} / {_f(m.tpot_ms.get('p99'))}"),
        ("output tokens", m.total_output_tokens),
        ("duration (s)", m.duration_s),
        ("output throughput (tok/s)", m.output_throughput),
        ("request throughput (req/s)", m.request_throughput),
    ]
    c = r.cache
    if c is not None and r.part == "prefix":
        pairs += [
            ("prefix-cache hit rate (%)", _f(percent(c.hit_rate), 1)),
            ("prompt tokens looked up / hit", f"{c.queries:,.0f} / {c.hits:,.0f}"),
            ("prompt tokens computed", f"{c.computed:,.0f}"),
        ]
    if c is not None and r.split is not None:
        for url, (q, h) in c.per_replica.items():
            hits = f", prefix-cache hit rate {_f(percent(h / q) if q else None, 1)} %" if r.part == "prefix" else ""
            pairs.append((f"  replica {url}", f"{r.split.get(url, 0):,.0f} requests{hits}"))
    if r.router_hits_misses is not None:
        pairs.append(("router cache_aware hits / misses", f"{r.router_hits_misses[0]:g} / {r.router_hits_misses[1]:g}"))
    pin = "" if r.pinned else " (NOT pinned)"
    return setup_block(pairs, f"{r.part}: {r.label}{pin}", r.run.records)


PREFIX_ROWS = (
    ("prefix-cache hit rate (%)", lambda r: percent(r.cache.hit_rate) if r.cache else None),
    ("prompt tokens computed", lambda r: r.cache.computed if r.cache else None),
    ("TTFT p50 (ms)", lambda r: r.m.ttft_ms.get("p50")),
    ("TTFT p99 (ms)", lambda r: r.m.ttft_ms.get("p99")),
    ("TPOT p50 (ms)", lambda r: r.m.tpot_ms.get("p50")),
    ("output throughput (tok/s)", lambda r: r.m.output_throughput),
    ("request throughput (req/s)", lambda r: r.m.request_throughput),
)


def largest_share(split: dict[str, float] | None) -> float | None:
    """The largest share of the requests one replica got, in % (None: no split, or no request)."""
    total = sum(split.values()) if split else 0.0
    return 100.0 * max(split.values()) / total if total > 0 else None


THROUGHPUT_ROWS = (
    ("output throughput (tok/s)", lambda r: r.m.output_throughput),
    ("TTFT p50 (ms)", lambda r: r.m.ttft_ms.get("p50")),
    ("TTFT p99 (ms)", lambda r: r.m.ttft_ms.get("p99")),
    ("TPOT p50 (ms)", lambda r: r.m.tpot_ms.get("p50")),
    ("TPOT p99 (ms)", lambda r: r.m.tpot_ms.get("p99")),
    ("duration (s)", lambda r: r.m.duration_s),
    ("largest replica share (%)", lambda r: largest_share(getattr(r, "split", None))),
)


def comparison(results: Sequence[SetupResult], rows: Sequence[tuple[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows: one column per setup, then the last / first ratio when there are two or more."""
    headers = ["", *(r.label for r in results)]
    with_ratio = len(results) >= 2
    if with_ratio:
        headers.append(f"{results[-1].label} / {results[0].label}")
    table = []
    for label, get in rows:
        vals = [get(r) for r in results]
        table.append([label, *vals, *([ratio(vals[-1], vals[0])] if with_ratio else [])])
    return headers, table


def tables(results: Sequence[SetupResult], args: argparse.Namespace) -> list[str]:
    from kvflow.bench.report import format_table

    out = []
    prefix = [r for r in results if r.part == "prefix"]
    if prefix:
        h, rows = comparison(prefix, PREFIX_ROWS)
        out.append(
            format_table(
                h,
                rows,
                digits=2,
                title=(
                    f"multi-prefix: {args.groups} system prompts x {args.prefix_len} tokens, {args.groups * args.per_group} "
                    f"questions of {args.question_len} -> {args.prefix_output_len} tokens, --data-parallel-size "
                    f"{args.data_parallel_size} by router policy"
                ),
            )
        )
    tp = [r for r in results if r.part == "throughput"]
    if tp:
        h, rows = comparison(tp, THROUGHPUT_ROWS)
        n = args.data_parallel_size
        cpus = getattr(args, "pinned_cpus", None)
        threads = (
            f"one engine {len(cpus)} threads, DP {n}: {max(1, len(cpus) // n)} thread(s) per replica ({args.dp_policy})"
            if cpus
            else f"unpinned, DP {n} ({args.dp_policy})"
        )
        out.append(
            format_table(
                h,
                rows,
                digits=2,
                title=(
                    f"DP throughput: {args.tp_requests} {'chat ' if args.tp_endpoint == 'chat' else ''}requests "
                    f"({args.tp_input_len} -> {args.tp_output_len} tokens"
                    f"{f', the first {args.tp_shared_prefix_len} shared' if args.tp_shared_prefix_len else ''}, "
                    f"{args.tp_concurrency} in flight); {threads}"
                ),
            )
        )
    return out


def write_json(
    path: str, args: argparse.Namespace, results: Sequence[SetupResult], cpu: str, pinning: str, texts: Sequence[str]
) -> None:
    from kvflow.bench.report import dump_json

    conf = {k: v for k, v in vars(args).items() if k != "server_flags"}
    dump_json(path, conf, [r.to_dict() for r in results], extra={"cpu": cpu, "pinning": pinning, "tables": list(texts)})
    print(f"wrote {path}")


def report(results: Sequence[SetupResult], args: argparse.Namespace, cpu: str, pinning: str) -> None:
    for r in results:
        print()
        print(setup_report(r))
    texts = tables(results, args)
    print()
    print(cpu)
    print(pinning)
    for t in texts:
        print()
        print(t)
    if args.result_json:
        write_json(args.result_json, args, results, cpu, pinning, texts)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def plan(args: argparse.Namespace, cpus: Sequence[int] | None) -> list[tuple[str, ServerSpec, str]]:
    """(part, server, label) in run order."""
    n = args.data_parallel_size
    out = []
    if "prefix" in args.parts:
        for policy in args.policies:
            out.append(
                (
                    "prefix",
                    server_spec(f"prefix-dp{n}-{policy}", cpus, args.server_flags, data_parallel_size=n, policy=policy),
                    policy,
                )
            )
    if "throughput" in args.parts:
        out.append(("throughput", server_spec("throughput-one-engine", cpus, args.server_flags), "one engine"))
        out.append(
            (
                "throughput",
                server_spec(f"throughput-dp{n}", cpus, args.server_flags, data_parallel_size=n, policy=args.dp_policy),
                f"DP {n}",
            )
        )
    return out


def pinning_line(cpus: Sequence[int] | None, n: int) -> str:
    if cpus is None:
        return "pinning: NONE (taskset missing or fewer than 2 usable CPUs): servers run unpinned"
    cs = ",".join(map(str, cpus))
    return (
        f"pinning: every server taskset -c {cs}; a data-parallel server splits them over its {n} replicas "
        f"(OMP_NUM_THREADS = each share), its router in the same process; the one engine OMP_NUM_THREADS="
        f"{len(cpus)}; the client unpinned"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # unwinds through the `with` blocks, which stop the servers
    cpu = cpu_line()
    try:
        cpus = pinning_cpus(args.cpus)
    except ValueError as e:
        print(f"dp_router: error: {e}", file=sys.stderr)
        return 2
    args.pinned_cpus = cpus
    pinning = pinning_line(cpus, args.data_parallel_size)
    print(cpu)
    print(pinning)
    log_dir = tempfile.mkdtemp(prefix="dp_router-")
    print(f"server logs: {log_dir}")
    try:
        from kvflow.bench.datasets import PromptBuilder

        tokenizer = harness_tokenizer(args.tokenizer, args.server_flags, required=True)
        builder = PromptBuilder(tokenizer)
        workloads = {}
        if "prefix" in args.parts:
            workloads["prefix"] = prefix_workload(args, tokenizer, builder)
        if "throughput" in args.parts:
            workloads["throughput"] = throughput_workload(args, tokenizer, builder)
        warm = {
            part: warm_requests(builder, max(r.prompt_len for r in reqs), args.seed) for part, reqs in workloads.items()
        }
    except ValueError as e:
        print(f"dp_router: error: {e}", file=sys.stderr)
        return 2
    if "prefix" in workloads:
        print(
            f"prefix workload: {args.groups} system prompts x {args.prefix_len} tokens, {len(workloads['prefix'])} "
            f"requests (+{args.question_len} -> {args.prefix_output_len} tokens), seed {args.seed}"
        )
    if "throughput" in workloads:
        shared = f", the first {args.tp_shared_prefix_len} shared" if args.tp_shared_prefix_len else ""
        print(
            f"throughput workload: {args.tp_requests} random {args.tp_endpoint} prompts ({args.tp_input_len} -> "
            f"{args.tp_output_len} tokens{shared}), at most {args.tp_concurrency} in flight, seed {args.seed}"
        )
    results: list[SetupResult] = []
    try:
        for part, spec, label in plan(args, cpus):
            rate, conc = (
                (args.prefix_rate, args.prefix_concurrency) if part == "prefix" else (math.inf, args.tp_concurrency)
            )
            results.append(
                run_setup(
                    part,
                    spec,
                    label,
                    workloads[part],
                    warm[part],
                    args,
                    tokenizer,
                    log_dir,
                    cpus is not None,
                    rate,
                    conc,
                )
            )
    except ServerError as e:
        print(f"dp_router: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the server is already stopped (its `with` block)
        print("dp_router: interrupted", file=sys.stderr)
        return 130
    finally:
        if results:
            report(results, args, cpu, pinning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
