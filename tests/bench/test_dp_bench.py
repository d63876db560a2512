"""benchmarks/dp_router.py: its pure helpers (arguments, workloads, /metrics counters, tables, server
command lines); no servers."""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import dp_router as dp


def test_parse_lists():
    assert dp.parse_parts("throughput, prefix,throughput") == ["throughput", "prefix"]
    assert dp.parse_policies("cache_aware,round_robin") == ["cache_aware", "round_robin"]
    assert dp.parse_cpus("0,2-3") == [0, 2, 3] and dp.parse_cpus("1") == [1]
    for parse, bad in (
        (dp.parse_parts, "prefix,pd"),
        (dp.parse_policies, "pd"),
        (dp.parse_policies, ""),
        (dp.parse_cpus, "3-1"),
        (dp.parse_cpus, "a"),
        (dp.parse_cpus, ","),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_parse_args():
    args = dp.parse_args(["--server-args", "--model /m --num-kv-blocks 400", "--prefix-rate", "2.5"])
    assert args.server_flags == ["--model", "/m", "--num-kv-blocks", "400"] and args.prefix_rate == 2.5
    assert (args.groups, args.prefix_len, args.per_group, args.prefix_output_len) == (8, 1024, 16, 32)
    assert (args.tp_requests, args.tp_concurrency, args.tp_input_len, args.tp_output_len) == (64, 64, 256, 128)
    assert dp.parse_args([]).prefix_rate == math.inf
    for bad in (
        ["--server-args", "--port 9000"],
        ["--server-args", "--router-policy=round_robin"],
        ["--server-args", "--data-parallel-size 4"],
        ["--data-parallel-size", "1"],
    ):
        with pytest.raises(SystemExit):
            dp.parse_args(bad)


def test_workloads_are_seeded():
    args = dp.parse_args(
        [
            "--groups",
            "3",
            "--per-group",
            "4",
            "--prefix-len",
            "40",
            "--question-len",
            "5",
            "--tp-requests",
            "5",
            "--tp-input-len",
            "20",
            "--tp-output-len",
            "7",
        ]
    )
    a, b = dp.prefix_workload(args, None), dp.prefix_workload(args, None)
    assert [r.prompt for r in a] == [r.prompt for r in b] and len(a) == 12
    assert sorted(r.group for r in a) == [0] * 4 + [1] * 4 + [2] * 4 and {r.output_len for r in a} == {32}
    by_group: dict[int, list[str]] = {}
    for r in a:
        by_group.setdefault(r.group, []).append(r.prompt)
    for prompts in by_group.values():  # one system prompt per group, then a question each
        head = prompts[0].split()[:40]
        assert all(p.split()[:40] == head for p in prompts) and len(set(prompts)) == 4
    t = dp.throughput_workload(args, None)
    assert len(t) == 5 and {r.prompt_len for r in t} == {20} and {r.output_len for r in t} == {7}
    from kvflow.bench.datasets import PromptBuilder

    warm = dp.warm_requests(PromptBuilder(None), 45, 0)
    assert [w.prompt_len for w in warm] == [8, 45] and not any(w.prompt in {r.prompt for r in a} for w in warm)


ENGINE = """# HELP kvflow:prefix_cache_queries_total Prompt tokens looked up
kvflow:prefix_cache_queries_total{model_name="m"} %s
kvflow:prefix_cache_hits_total{model_name="m"} %s
"""
ROUTER = """kvflow_router:requests_total{backend="http://a",role="backend"} %s
kvflow_router:requests_total{backend="http://b",role="backend"} %s
kvflow_router:cache_aware_hits_total 5.0
kvflow_router:cache_aware_misses_total 2.0
"""


def test_counters():
    before = dp.cache_counters({"http://a": ENGINE % (100, 10), "http://b": ENGINE % (50, 0)})
    after = dp.cache_counters({"http://a": ENGINE % (1100, 810), "http://b": ENGINE % (1050, 700)})
    d = dp.cache_delta(before, after)
    assert (d.queries, d.hits, d.computed) == (2000, 1500, 500) and d.hit_rate == 0.75
    assert d.per_replica == {"http://a": (1000, 800), "http://b": (1000, 700)}
    assert dp.CacheCounters().hit_rate is None
    assert dp.split_delta(dp.router_split(ROUTER % (1, 2)), dp.router_split(ROUTER % (5, 2))) == {
        "http://a": 4,
        "http://b": 0,
    }
    assert dp.router_cache_aware(ROUTER % (1, 1)) == (5, 2) and dp.router_cache_aware("") is None


def test_comparison_and_ratio():
    class M:
        def __init__(self, tps):
            self.output_throughput, self.ttft_ms, self.tpot_ms, self.duration_s = tps, {"p50": 1.0}, {}, 2.0

    class R:
        def __init__(self, label, tps):
            self.label, self.m = label, M(tps)

    headers, rows = dp.comparison([R("one engine", 100.0), R("DP 2", 150.0)], dp.THROUGHPUT_ROWS)
    assert headers == ["", "one engine", "DP 2", "DP 2 / one engine"]
    assert rows[0] == ["output throughput (tok/s)", 100.0, 150.0, 1.5]
    assert rows[3] == ["TPOT p50 (ms)", None, None, None]
    assert dp.ratio(1.0, 0.0) is None and dp.ratio(math.nan, 1.0) is None and dp.ratio(3.0, 2.0) == 1.5


def test_server_specs():
    one = dp.server_spec("one", [0, 1], ["--model", "/m"])
    assert one.argv[:3] == ["taskset", "-c", "0,1"] and one.argv[-2:] == ["--model", "/m"]
    assert one.env["OMP_NUM_THREADS"] == "2" and not one.data_parallel
    two = dp.server_spec("two", [0, 1], [], data_parallel_size=2, policy="round_robin")
    i = two.argv.index("--data-parallel-size")
    assert two.argv[i : i + 4] == ["--data-parallel-size", "2", "--router-policy", "round_robin"] and two.data_parallel
    assert two.env.get("OMP_NUM_THREADS") == dp.os.environ.get("OMP_NUM_THREADS")  # the DP server sets its replicas'
    assert dp.server_spec("free", None, []).argv[0] == sys.executable
    args = dp.parse_args(["--policies", "cache_aware"])
    assert [(p, label) for p, _, label in dp.plan(args, [0, 1])] == [
        ("prefix", "cache_aware"),
        ("throughput", "one engine"),
        ("throughput", "DP 2"),
    ]


def test_throughput_part_with_a_short_shared_prefix():
    args = dp.parse_args(
        [
            "--parts",
            "throughput",
            "--tp-requests",
            "6",
            "--tp-input-len",
            "30",
            "--tp-output-len",
            "4",
            "--tp-shared-prefix-len",
            "10",
            "--tp-endpoint",
            "chat",
        ]
    )
    assert (args.tp_shared_prefix_len, args.tp_endpoint) == (10, "chat")
    reqs = dp.throughput_workload(args, None)
    assert len(reqs) == 6 and {r.output_len for r in reqs} == {4} and {r.prompt_len for r in reqs} == {30}
    heads = {" ".join(r.prompt.split()[:10]) for r in reqs}
    assert len(heads) == 1 and len({r.prompt for r in reqs}) == 6  # one prefix, then each its own
    plain = dp.throughput_workload(dp.parse_args(["--tp-requests", "6", "--tp-input-len", "30"]), None)
    assert len({" ".join(r.prompt.split()[:10]) for r in plain}) == 6  # the default: nothing shared
    for bad in (["--tp-shared-prefix-len", "256"], ["--tp-shared-prefix-len", "-1"], ["--tp-endpoint", "x"]):
        with pytest.raises(SystemExit):
            dp.parse_args(bad)


def test_largest_replica_share():
    assert dp.largest_share({"http://a": 24.0, "http://b": 8.0}) == 75.0
    assert dp.largest_share(None) is None and dp.largest_share({"http://a": 0.0}) is None
    assert dp.THROUGHPUT_ROWS[-1][0] == "largest replica share (%)"
