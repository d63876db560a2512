"""benchmarks/pd_disagg.py: its pure helpers (workload, Prometheus parsing, figures) and its use of
kvflow.utils.processes; no servers (one short-lived subprocess)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import pd_disagg as pd

from kvflow.bench.metrics import RequestRecord
from kvflow.utils import processes
from kvflow.utils.prometheus import parse_prometheus, sample_sum


def _rec(cls: str, send: float, chunks: list[float], out: int, prompt_len: int = 64, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        prompt_len=prompt_len,
        arrival_time=send,
        send_time=send,
        first_token_time=chunks[0] if chunks else None,
        chunk_times=list(chunks),
        end_time=chunks[-1] if chunks else send,
        output_tokens=out,
        success=ok,
        request_class=cls,
    )


def test_parse_setups():
    assert pd.parse_setups("agg,pd") == ["agg", "pd"]
    assert pd.parse_setups(" pd , agg,pd") == ["pd", "agg"]
    assert pd.parse_setups("pd_cond,agg") == ["pd_cond", "agg"]
    assert pd.parse_args([]).setups == ["agg", "pd", "pd_cond"]
    for bad in ("", "agg,xpd", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            pd.parse_setups(bad)


def test_parse_args_rejects_flags_the_harness_sets():
    with pytest.raises(SystemExit):
        pd.parse_args(["--server-args", "--max-num-batched-tokens 128"])
    with pytest.raises(SystemExit):
        pd.parse_args(["--server-args", "--port=9000"])
    with pytest.raises(SystemExit):
        pd.parse_args(["--doc-min-len", "300", "--doc-max-len", "200"])
    args = pd.parse_args(["--server-args", "--model /m --max-model-len 512", "--setups", "pd"])
    assert args.server_flags == ["--model", "/m", "--max-model-len", "512"] and args.setups == ["pd"]


def test_poisson_offsets():
    a = pd.poisson_offsets(2.0, 100.0, seed=3)
    assert a == pd.poisson_offsets(2.0, 100.0, seed=3)
    assert a != pd.poisson_offsets(2.0, 100.0, seed=4)
    assert all(0 < t < 100 for t in a) and a == sorted(a)
    assert 140 < len(a) < 260  # mean 200
    assert pd.poisson_offsets(0.0, 100.0, seed=0) == []


def test_uniform_lengths():
    xs = pd.uniform_lengths(500, 10, 20, seed=0)
    assert min(xs) == 10 and max(xs) == 20
    assert xs == pd.uniform_lengths(500, 10, 20, seed=0)


def _args(**kw):
    argv = [
        "--chat-users",
        "2",
        "--chat-prompt-len",
        "12",
        "--chat-output-len",
        "5",
        "--doc-rate",
        "1",
        "--duration-s",
        "10",
        "--doc-min-len",
        "30",
        "--doc-max-len",
        "40",
        "--doc-output-len",
        "3",
    ]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return pd.parse_args(argv)


def test_workload_is_seeded_and_distinct():
    w = pd.build_workload(_args(), tokenizer=None)  # the built-in word tokenizer
    w2 = pd.build_workload(_args(), tokenizer=None)
    assert [d.request.prompt for d in w.docs] == [d.request.prompt for d in w2.docs]
    assert all(30 <= d.request.prompt_len <= 40 and d.request.output_len == 3 for d in w.docs)
    chats = [w.chat_request(u, k) for u in range(2) for k in range(20)]
    assert all(c.prompt_len == 12 and c.output_len == 5 and c.request_class == "chat" for c in chats)
    assert chats[0].prompt == w2.chat_request(0, 0).prompt
    prompts = [c.prompt for c in chats] + [d.request.prompt for d in w.docs] + [r.prompt for r in w.warm_up]
    assert len(set(prompts)) == len(prompts)
    assert [r.request_class for r in w.warm_up] == ["chat", "doc"]
    assert w.longest_request() == max(d.request.prompt_len for d in w.docs) + 3


METRICS = """# HELP kvflow:kv_transfer_bytes_total KV bytes
# TYPE kvflow:kv_transfer_bytes_total counter
kvflow:kv_transfer_bytes_total{direction="sent"} 0.0
kvflow:kv_transfer_bytes_total{direction="received"} 8192.0
kvflow:kv_transfer_blocks_total{direction="received"} 16.0
kvflow:kv_transfer_seconds_bucket{le="0.001"} 1.0
kvflow:kv_transfer_seconds_count 4.0
kvflow:kv_transfer_seconds_sum 0.5
kvflow:kv_transfer_failures_total{reason="timeout"} 1.0
kvflow:kv_transfer_failures_total{reason="checksum"} 2.0
kvflow:kv_transfer_seconds_created 1.7e9
"""


def test_parse_prometheus_and_transfer_delta():
    s = parse_prometheus(METRICS + 'odd{a="x\\"y"} 3\nnot a sample\n')
    assert ("odd", {"a": 'x"y'}, 3.0) in s
    assert sample_sum(s, "kvflow:kv_transfer_bytes_total") == 8192.0
    t = pd.transfer_counters(METRICS)
    assert (t.bytes_received, t.blocks_received, t.fetches, t.seconds) == (8192.0, 16.0, 4.0, 0.5)
    assert t.failures == {"timeout": 1.0, "checksum": 2.0}
    assert t.gb_per_s == pytest.approx(8192 / 0.5 / 1e9) and t.mean_fetch_s == pytest.approx(0.125)
    empty = pd.transfer_counters("")
    assert empty.gb_per_s is None and empty.mean_fetch_s is None
    after = pd.TransferStats(10000.0, 20.0, 6.0, 0.75, {"timeout": 1.0, "refused": 1.0}, prefill_fallbacks=2.0)
    d = pd.transfer_delta(t, after)
    assert (d.bytes_received, d.blocks_received, d.fetches, d.seconds) == (1808.0, 4.0, 2.0, 0.25)
    assert d.failures == {"checksum": -2.0, "refused": 1.0, "timeout": 0.0}
    assert d.prefill_fallbacks == 2.0
    json.dumps(d.to_dict())


def test_router_fallbacks():
    assert pd.router_fallbacks("") is None
    assert pd.router_fallbacks("kvflow_router:prefill_fallbacks_total 3.0\n") == 3.0


def test_router_decisions_and_their_delta():
    text = (
        'kvflow_router:pd_decisions_total{decision="local_prefill"} 7.0\n'
        'kvflow_router:pd_decisions_total{decision="remote_prefill"} 2.0\n'
    )
    assert pd.router_decisions(text) == (7.0, 2.0) and pd.router_decisions("") is None
    before = pd.TransferStats(prefill_fallbacks=1.0, local_prefills=3.0, remote_prefills=1.0)
    after = pd.TransferStats(prefill_fallbacks=1.0, local_prefills=7.0, remote_prefills=2.0)
    d = pd.transfer_delta(before, after)
    assert (d.prefill_fallbacks, d.local_prefills, d.remote_prefills) == (0.0, 4.0, 1.0)
    none = pd.transfer_delta(pd.TransferStats(), pd.TransferStats())
    assert none.local_prefills is None and none.prefill_fallbacks is None


def test_summarize_load():
    recs = [
        _rec("chat", 0.0, [0.1, 0.2, 0.4], 3),  # ITL 0.1, 0.2; TPOT 0.15
        _rec("chat", 1.0, [1.1, 1.2, 1.3], 3),  # ITL 0.1, 0.1; TPOT 0.1
        _rec("chat", 2.0, [], 0, ok=False),
        _rec("doc", 0.0, [2.0, 2.5], 2, prompt_len=1000),
        _rec("doc", 1.0, [5.0, 5.1], 2, prompt_len=1000),
        _rec("doc", 3.0, [], 0, ok=False),
    ]
    s = pd.summarize_load(recs, duration_s=10.0)
    assert (s.chats_finished, s.chats_failed, s.docs_finished, s.docs_failed) == (2, 1, 2, 1)
    assert s.chat_itl_ms_p50 == pytest.approx(100.0)
    assert s.chat_tpot_ms_p50 == pytest.approx(125.0)
    assert s.doc_ttft_s_p50 == pytest.approx(3.0) and s.doc_ttft_s_mean == pytest.approx(3.0)
    assert s.output_tokens == 10 and s.output_throughput == pytest.approx(1.0)
    none = pd.summarize_load([], 0.0)
    assert none.chat_itl_ms_p99 is None and none.doc_ttft_s_mean is None and none.output_throughput is None


def test_doc_transfer_estimate():
    assert [pd.moved_blocks(n, 16) for n in (1, 16, 17, 32, 33)] == [0, 0, 1, 1, 2]
    recs = [
        _rec("chat", 0, [1, 2], 2, prompt_len=33),
        _rec("chat", 0, [1, 2], 2, prompt_len=33),
        _rec("doc", 0, [2, 3], 2, prompt_len=161),
        _rec("doc", 0, [1], 1, prompt_len=999, ok=False),
    ]
    stats = pd.TransferStats(fetches=3.0, seconds=0.7)
    d = pd.doc_transfer(stats, recs, doc_ttft_mean_s=2.0, block_size=16)
    assert d.block_share == pytest.approx(10 / 14)
    assert d.per_doc_s_high == pytest.approx(0.5) and d.share_of_ttft_high == pytest.approx(0.25)
    assert d.per_doc_s_low == pytest.approx(0.7 / 3) and d.share_of_ttft_low == pytest.approx(0.7 / 6)
    assert pd.doc_transfer(pd.TransferStats(), recs, 2.0).per_doc_s_high is None
    assert pd.doc_transfer(stats, recs[:2], 2.0).block_share is None


def test_comparison_rows_and_ratio():
    def summary(itl99, tpot99, ttft50, tput):
        return pd.LoadSummary(1, 0, None, itl99, None, tpot99, 1, 0, ttft50, None, None, 1, 1.0, tput)

    rows = pd.comparison_rows(summary(40.0, 20.0, 2.0, 100.0), summary(20.0, 10.0, 3.0, None))
    assert [r[0] for r in rows] == [label for label, _ in pd.COMPARED]
    assert [r[3] for r in rows] == [0.5, 0.5, 1.5, None]
    # aggregated, 1P1D, 1P1D conditional: both values, then both ratios
    rows = pd.comparison_rows(summary(40.0, 20.0, 2.0, 100.0), summary(20.0, 10.0, 3.0, 50.0), summary(10, 5, 4, 80))
    assert rows[3] == ["output throughput (tok/s)", 100.0, 50.0, 80, 0.5, 0.8]
    assert pd.ratio(1.0, 0.0) is None and pd.ratio(float("nan"), 1.0) is None


def test_cpu_line():
    lscpu = (
        "Architecture: x86_64\nModel name:   Intel(R) Xeon(R) Platinum 8480+\n"
        "Flags: fpu avx2 avx512f avx512_vnni amx_bf16 amx_tile\n"
    )
    assert pd.cpu_line(lscpu) == "CPU: Intel(R) Xeon(R) Platinum 8480+; avx2 yes, avx512f yes, avx512_vnni yes, amx yes"
    assert (
        pd.cpu_line("Model name: AMD EPYC\nFlags: avx avx2\n")
        == "CPU: AMD EPYC; avx2 yes, avx512f no, avx512_vnni no, amx no"
    )
    assert pd.cpu_line("").startswith("CPU: unknown;")


def test_setup_specs():
    args = pd.parse_args(["--server-args", "--model /m", "--connector", "shm", "--chunk-size", "256"])
    (agg,) = pd.setup_specs("agg", args, [0, 1])
    assert agg.argv[:3] == ["taskset", "-c", "0,1"] and agg.env["OMP_NUM_THREADS"] == "2"
    assert agg.argv[agg.argv.index("--max-num-batched-tokens") + 1] == "256" and agg.argv[-2:] == ["--model", "/m"]
    prefill, decode, router = pd.setup_specs("pd", args, [2, 5])
    assert prefill.argv[:3] == ["taskset", "-c", "2"] and decode.argv[:3] == ["taskset", "-c", "5"]
    assert prefill.env["OMP_NUM_THREADS"] == decode.env["OMP_NUM_THREADS"] == "1"
    cfg = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert cfg == {"kv_connector": "shm", "kv_role": "kv_producer"}
    assert json.loads(decode.argv[-1])["kv_role"] == "kv_consumer"
    assert "taskset" not in router.argv and router.argv[-4:] == ["--prefill", prefill.url, "--decode", decode.url]
    unpinned = pd.setup_specs("pd", args, None)
    assert all(s.argv[0] != "taskset" for s in unpinned)
    assert "--max-local-prefill-length" not in router.argv  # plain 1P1D: every prompt through prefill
    cond = pd.parse_args(["--max-local-prefill-length", "300"])
    prefill, decode, router = pd.setup_specs("pd_cond", cond, [2, 5])
    assert router.argv[-2:] == ["--max-local-prefill-length", "300"]
    assert [s.name for s in (prefill, decode, router)] == ["pd-cond-prefill", "pd-cond-decode", "pd-cond-router"]
    assert pd.parse_args([]).max_local_prefill_length == 512
    with pytest.raises(SystemExit):
        pd.parse_args(["--max-local-prefill-length", "-1"])


def test_argument_types_are_finite():
    for bad in (
        ["--duration-s", "inf"],
        ["--doc-rate", "-1"],
        ["--doc-rate", "inf"],
        ["--chat-users", "-1"],
        ["--chunk-size", "0"],
    ):
        with pytest.raises(SystemExit):
            pd.parse_args(bad)
    args = pd.parse_args(["--doc-rate", "0", "--chat-users", "1", "--duration-s", "2.5"])
    assert (args.doc_rate, args.chat_users, args.duration_s) == (0.0, 1, 2.5)


def test_managed_process_failure_names_its_log(tmp_path):
    """A named process with its log in a folder (pd's kind): an early exit is an error naming the log."""
    log = tmp_path / "pd-prefill.log"
    cmd = [sys.executable, "-c", "import sys; print('no model here', flush=True); sys.exit(3)"]
    proc = processes.ManagedProcess(
        cmd, processes.free_port(), name="pd-prefill", log_path=str(log), startup_timeout=30, stop_timeout=1
    )
    with pytest.raises(processes.ServerError) as e:
        with processes.started([proc]):
            pass
    assert str(e.value).startswith(f"pd-prefill exited with code 3; its log is {log}, last lines:\n")
    assert "    no model here" in str(e.value) and log.read_text() == "no model here\n"
