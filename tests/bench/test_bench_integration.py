"""The benchmark harness against kvflow itself: the serve client on a live kvflow server, and the
offline runner with both backends on the same workload."""

from __future__ import annotations

import argparse

import pytest

from kvflow.bench.datasets import WorkloadSpec, generate_requests

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`


@pytest.fixture(scope="module")
def live_server(tiny_llama):
    from kvflow.config import EngineConfig

    from server_utils import LiveServer

    server = LiveServer(EngineConfig(model=tiny_llama[0], max_model_len=128, num_kv_blocks=128))
    yield server
    server.stop()


def test_serve_client_token_counts_match_server_usage(live_server):
    from kvflow.bench.serve_client import ServeConfig, run_benchmark

    tok = live_server.engine.tokenizer
    requests = generate_requests(
        WorkloadSpec(dataset="random", num_prompts=12, seed=1, input_len="8:24", output_len="3:12"), tok
    )
    for endpoint in ("completions", "chat"):
        cfg = ServeConfig(
            base_url=live_server.url, endpoint=endpoint, request_rate=50.0, max_concurrency=6, disable_tqdm=True
        )
        result = run_benchmark(requests, cfg, tok)
        recs = result.records
        assert all(r.success for r in recs), [r.error for r in recs if not r.success]
        # ignore_eos: the server produced exactly what was asked, and the client counted it from usage
        assert [r.output_tokens for r in recs] == [q.output_len for q in requests]
        timed = [r for r in recs if r.first_token_time is not None]  # all-special-token outputs stream no text
        assert len(timed) >= len(recs) // 2
        for r in timed:
            assert r.send_time <= r.first_token_time <= r.end_time
        assert result.metrics.completed == len(requests)
        assert result.metrics.ttft_ms["p99"] >= result.metrics.ttft_ms["median"] > 0
    live_server.wait_engine_idle()


def test_throughput_backends_agree_on_greedy_tokens(tiny_llama):
    from kvflow.cli.bench import run_hf_throughput, run_kvflow_throughput

    path = tiny_llama[0]
    args = argparse.Namespace(
        model=path,
        max_model_len=128,
        num_kv_blocks=128,
        hf_batch_size=4,
        warmup=False,
        disable_tqdm=True,
        tokenizer=None,
    )
    spec = WorkloadSpec(dataset="random", num_prompts=8, seed=2, input_len="4:20", output_len="2:10")
    ours = run_kvflow_throughput(args, spec)
    hf = run_hf_throughput(args, ours["requests"], ours["tokenizer"])
    assert ours["token_ids"] == hf["token_ids"]
    assert [len(t) for t in ours["token_ids"]] == [r.output_len for r in ours["requests"]]
    assert hf["generated_tokens_incl_padding"] >= hf["useful_output_tokens"]
