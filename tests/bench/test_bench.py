"""Benchmark harness building blocks: metrics, arrivals, workloads, roofline, serve client, report."""

import argparse
import asyncio
import json
import math
import socket
import threading
import time

import numpy as np
import pytest

from kvflow.bench import datasets as ds
from kvflow.bench import roofline as rf
from kvflow.bench.metrics import (
    SLO,
    RequestRecord,
    compute_metrics,
    e2el,
    goodput,
    itl,
    percentile,
    summarize,
    tpot,
    ttft,
)
from kvflow.bench.serve_client import ServeConfig, arrival_gaps, arrival_times, parse_rates, run_benchmark

# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def _rec(send, chunks, end, out, ok=True, **kw) -> RequestRecord:
    return RequestRecord(
        arrival_time=send,
        send_time=send,
        first_token_time=chunks[0] if chunks else None,
        chunk_times=list(chunks),
        end_time=end,
        output_tokens=out,
        success=ok,
        **kw,
    )


def test_per_request_metrics():
    r = _rec(10.0, [10.2, 10.25, 10.35, 10.40], 10.41, 5, prompt_len=7)
    assert ttft(r) == pytest.approx(0.2)
    assert itl(r) == pytest.approx([0.05, 0.10, 0.05])  # TTFT excluded
    assert e2el(r) == pytest.approx(0.41)
    assert tpot(r) == pytest.approx((0.41 - 0.2) / 4)


def test_ttft_measured_from_send_not_arrival():
    r = _rec(10.0, [10.5], 10.6, 1)
    r.arrival_time = 9.0  # waited 1 s on the client's concurrency semaphore
    assert ttft(r) == pytest.approx(0.5)


def test_tpot_undefined_and_failed_requests_excluded():
    one = _rec(0.0, [0.1], 0.1, 1)
    failed = _rec(0.0, [], 0.3, 0, ok=False, error="HTTP 500: boom")
    good = _rec(0.0, [0.1, 0.2, 0.3], 0.3, 3)
    assert tpot(one) is None and ttft(failed) is None and itl(failed) == [] and e2el(failed) is None
    m = compute_metrics([one, failed, good], duration=2.0)
    assert m.completed == 2 and m.failed == 1
    assert m.tpot_ms["count"] == 1 and m.tpot_ms["mean"] == pytest.approx(100.0)
    assert m.ttft_ms["count"] == 2
    assert m.itl_ms["count"] == 2  # only the 3-chunk request has gaps


def test_summary_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    vals = rng.lognormal(0, 1, 1001)
    s = summarize(vals, (50, 90, 99, 99.9))
    for q, key in ((50, "p50"), (90, "p90"), (99, "p99"), (99.9, "p99_9")):
        assert s[key] == pytest.approx(np.percentile(vals, q))
    assert s["median"] == pytest.approx(np.median(vals))
    assert s["mean"] == pytest.approx(vals.mean())
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)  # linear interpolation
    assert summarize([])["count"] == 0 and math.isnan(summarize([])["p99"])


def test_throughput_figures():
    recs = [_rec(0, [0.5, 1.0], 1.0, 2, prompt_len=10), _rec(0, [0.5, 1.5, 2.0], 2.0, 3, prompt_len=20)]
    m = compute_metrics(recs, duration=2.0)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.input_throughput == pytest.approx(15.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(17.5)
    assert m.goodput is None
    assert m.max_concurrent_requests == 2


def test_goodput_with_slos():
    recs = [
        _rec(0, [0.10, 0.14, 0.18], 0.18, 3),  # ttft 100, tpot 40        -> meets all
        _rec(0, [0.30, 0.33], 0.33, 2),  # ttft 300                        -> fails ttft
        _rec(0, [0.05, 0.15, 0.25], 0.25, 3),  # tpot 100                 -> fails tpot
        _rec(0, [0.05], 0.05, 1),  # tpot undefined                        -> meets
        _rec(0, [], 0.1, 0, ok=False),  # failed                           -> never counts
    ]
    slo = SLO(ttft_ms=200, tpot_ms=50)
    assert [slo.met_by(r) for r in recs] == [True, False, False, True, False]
    assert goodput(recs, 2.0, slo) == pytest.approx(1.0)
    assert compute_metrics(recs, 2.0, slo).goodput == pytest.approx(1.0)
    assert goodput(recs, 2.0, SLO(e2el_ms=200)) == pytest.approx(1.0)  # requests 0 and 3
    assert goodput(recs, 1.0, SLO(itl_ms=45)) == pytest.approx(3.0)  # every gap <= 45 ms: 0, 1 and 3
    assert goodput(recs, 1.0, SLO()) == pytest.approx(4.0)


def test_poisson_arrivals_rate():
    gaps = arrival_gaps(20000, 4.0, seed=1)
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert np.array_equal(gaps, arrival_gaps(20000, 4.0, seed=1))
    assert not np.array_equal(gaps, arrival_gaps(20000, 4.0, seed=2))
    t = arrival_times(20000, 4.0, seed=1)
    assert len(t) / t[-1] == pytest.approx(4.0, rel=0.03)


def test_gamma_burstiness_keeps_mean_rate():
    for shape in (0.25, 0.5, 4.0):
        gaps = arrival_gaps(40000, 2.0, burstiness=shape, seed=3)
        assert gaps.mean() == pytest.approx(0.5, rel=0.04)
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / shape, rel=0.1)  # gamma: CV^2 = 1/shape


def test_infinite_rate_and_parse_rates():
    assert np.all(arrival_gaps(5, math.inf) == 0)
    assert parse_rates("0.5, 2,inf") == [0.5, 2.0, math.inf]
    with pytest.raises(ValueError):
        parse_rates("1,fast")
    with pytest.raises(ValueError):
        parse_rates("0")


# ----------------------------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------------------------


class GreedyTokenizer:
    """Longest-match tokenizer without spaces: neighbouring pieces merge ("the"+"n" -> "then"),
    so decode -> re-encode changes lengths and the prompt builder must fix them up."""

    def __init__(self):
        words = [
            "th",
            "the",
            "then",
            "he",
            "hen",
            "her",
            "here",
            "there",
            "re",
            "ere",
            "in",
            "ink",
            "king",
            "kin",
            "ing",
            "on",
            "one",
            "ne",
            "nest",
            "est",
            "st",
            "at",
            "ate",
            "te",
        ]
        self.vocab = list("abcdefghijklmnopqrstuvwxyz") + words
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.vocab_size = len(self.vocab)
        self.maxlen = max(map(len, self.vocab))

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            for n in range(min(self.maxlen, len(text) - i), 0, -1):
                if text[i : i + n] in self.ids:
                    out.append(self.ids[text[i : i + n]])
                    i += n
                    break
            else:
                i += 1
        return out

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids)


def _key(reqs):
    return [(r.prompt, r.prompt_len, r.output_len, r.group) for r in reqs]


def test_random_dataset_reproducible_and_exact():
    tok = ds.WordTokenizer()

    def spec(seed: int) -> ds.WorkloadSpec:
        return ds.WorkloadSpec("random", num_prompts=50, seed=seed, input_len="8:64", output_len="4:16")

    a, b, c = (ds.generate_requests(spec(s), tok) for s in (7, 7, 8))
    assert _key(a) == _key(b) and _key(a) != _key(c)
    for r in a:
        assert 8 <= r.prompt_len <= 64 and 4 <= r.output_len <= 16
        assert len(tok.encode(r.prompt)) == r.prompt_len
    fixed = ds.generate_requests(ds.WorkloadSpec("random", num_prompts=5, input_len=32, output_len="20"), tok)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(32, 20)}


def test_exact_length_with_merging_tokenizer():
    tok = GreedyTokenizer()
    reqs = ds.generate_requests(ds.WorkloadSpec("random", num_prompts=30, seed=1, input_len="1:80"), tok)
    for r in reqs:
        assert len(tok.encode(r.prompt)) == r.prompt_len
    spec = ds.WorkloadSpec("random", num_prompts=30, seed=1, input_len="1:80")
    assert [r.prompt_len for r in reqs] == list(np.random.default_rng(1).integers(1, 81, 30))
    ids = ds.generate_requests(ds.WorkloadSpec("random", num_prompts=3, input_len=16, token_ids=True), tok)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 16 for r in ids)
    del spec


def test_sharegpt_like_output_lengths():
    rng = np.random.default_rng(0)
    outs = ds.sharegpt_output_lengths(rng, 40000)
    assert outs.min() >= 5 and outs.max() <= 632
    assert abs(np.median(outs) - 87) <= 2
    assert outs.min() < 20 and outs.max() > 500  # the wide spread of real chat outputs
    reqs = ds.generate_requests(ds.WorkloadSpec("sharegpt-like", num_prompts=200, seed=4), ds.WordTokenizer())
    assert all(5 <= r.output_len <= 632 and r.prompt_len >= 4 for r in reqs)
    capped = ds.generate_requests(
        ds.WorkloadSpec("sharegpt-like", num_prompts=100, seed=4, max_output_len=50, max_input_len=40),
        ds.WordTokenizer(),
    )
    assert max(r.output_len for r in capped) <= 50 and max(r.prompt_len for r in capped) <= 40


def test_profiles_scale_and_caps():
    tok = ds.WordTokenizer()
    reqs = ds.generate_requests(ds.WorkloadSpec("summarisation", num_prompts=20, scale=0.1), tok)
    assert all(90 <= r.prompt_len <= 110 and 9 <= r.output_len <= 11 for r in reqs)
    reqs = ds.generate_requests(ds.WorkloadSpec("reasoning", num_prompts=20, scale=0.1, max_output_len=300), tok)
    assert all(9 <= r.prompt_len <= 11 and 100 <= r.output_len <= 300 for r in reqs)
    reqs = ds.generate_requests(ds.WorkloadSpec("translation", num_prompts=20, scale=0.05), tok)
    assert all(25 <= r.prompt_len <= 100 and abs(r.output_len - r.prompt_len) <= 0.1 * r.prompt_len + 1 for r in reqs)
    gen = ds.generate_requests(ds.WorkloadSpec("generation", num_prompts=5, scale=0.1), tok)
    assert all(r.output_len > 5 * r.prompt_len for r in gen)
    with pytest.raises(ValueError, match="unknown dataset"):
        ds.generate_requests(ds.WorkloadSpec("nope"), tok)
    with pytest.raises(ValueError, match="input length"):
        ds.generate_requests(ds.WorkloadSpec("random", input_len="9:3"), tok)


def test_shared_prefix_groups():
    tok = GreedyTokenizer()
    spec = ds.WorkloadSpec(
        "shared-prefix", num_groups=3, prompts_per_group=4, prefix_len=40, question_len=10, output_len=7, seed=2
    )
    reqs = ds.generate_requests(spec, tok)
    assert len(reqs) == 12 and {r.output_len for r in reqs} == {7}
    prefixes: dict[int, set] = {}
    for r in reqs:
        ids = tok.encode(r.prompt)
        assert len(ids) == r.prompt_len
        assert r.prompt_len >= 40
        prefixes.setdefault(r.group, set()).add(tuple(ids[:38]))
    assert len(prefixes) == 3 and all(len(p) == 1 for p in prefixes.values())
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # each group its own prefix
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled
    spec.shared_prefix_order = "grouped"
    assert [r.group for r in ds.generate_requests(spec, tok)] == sorted(r.group for r in reqs)


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt": "the city of light", "output_len": 5}\n\n{"prompt": [1, 2, 3]}\n')
    reqs = ds.generate_requests(ds.WorkloadSpec("jsonl", path=str(p), output_len="9"), ds.WordTokenizer())
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(4, 5), (3, 9)]
    p.write_text('{"prompt": "ok"}\n{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(ValueError, match=r"line 2: \"output_len\""):
        ds.generate_requests(ds.WorkloadSpec("jsonl", path=str(p)))
    p.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        ds.generate_requests(ds.WorkloadSpec("jsonl", path=str(p)))
    p.write_text('{"text": "ok"}\n')
    with pytest.raises(ValueError, match='line 1: expected an object with a "prompt"'):
        ds.generate_requests(ds.WorkloadSpec("jsonl", path=str(p)))
    with pytest.raises(ValueError, match="not found"):
        ds.generate_requests(ds.WorkloadSpec("jsonl", path=str(tmp_path / "missing.jsonl")))


# ----------------------------------------------------------------------------------------------
# Roofline
# ----------------------------------------------------------------------------------------------


def test_kv_bytes_per_token_paper_figures():
    assert rf.kv_bytes_per_token(rf.MODEL_PRESETS["opt-13b"], "fp16") == 819_200  # 800 KB (vLLM paper)
    assert rf.kv_bytes_per_token(rf.MODEL_PRESETS["llama3-8b"], "bf16") == 131_072  # 128 KiB
    assert rf.kv_bytes_per_token(rf.MODEL_PRESETS["llama3-8b"], "fp8") == 65_536
    opt = rf.MODEL_PRESETS["opt-13b"]
    assert 2048 * rf.kv_bytes_per_token(opt, "fp16") / 1e9 == pytest.approx(1.6777, rel=1e-4)  # "1.6 GB"


def test_step_time_and_cost_hand_computed():
    m, hw = rf.MODEL_PRESETS["llama3-8b"], rf.HARDWARE_PRESETS["h100"]
    row = rf.decode_step(m, hw, batch=8, context=2048, kv_dtype="bf16", price_per_hour=3.0)
    # weights 8.03e9 x 2 B = 16.06e9 B; KV 8 x 2048 x 131072 = 2,147,483,648 B
    # step = 18,207,483,648 B / 3.35e12 B/s = 5.4350697 ms; 8 / step = 1471.92 tok/s
    # cost = 3 / (3600 x 1471.92) x 1e6 = $0.56615 per 1M tokens
    assert row.step_s == pytest.approx(5.4350697e-3, rel=1e-6)
    assert row.compute_floor_s == pytest.approx(2 * 8.03e9 * 8 / 989e12)
    assert row.bound == "memory" and row.fits
    assert row.tokens_per_s == pytest.approx(1471.92, rel=1e-5)
    assert row.cost_per_million == pytest.approx(0.56615, rel=1e-4)
    assert rf.max_sequences(m, hw, 2048) == 238  # (80e9 - 16.06e9) / 268,435,456
    table = rf.roofline_table(m, hw)
    assert [r.batch for r in table] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert [r.fits for r in table] == [True] * 8 + [False] * 2
    slow = rf.Hardware("slow", 80e9, 3.35e12, 1e12)  # 1 TFLOP/s: compute-bound at batch 64
    r64 = rf.decode_step(m, slow, 64, 2048)
    assert r64.bound == "compute" and r64.step_s == pytest.approx(2 * 8.03e9 * 64 / 1e12)


def test_speculative_formulas():
    # alpha 0.8, gamma 4: tokens = (1 - 0.8^5) / 0.2 = 3.3616; speed-up = 3.3616 / (4 x 0.05 + 1) = 2.80133
    assert rf.spec_expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert rf.spec_speedup(0.8, 4, 0.05) == pytest.approx(2.801333, rel=1e-6)
    assert rf.spec_expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert rf.spec_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)
    assert rf.spec_expected_tokens(1.0, 3) == 4.0
    with pytest.raises(ValueError):
        rf.spec_expected_tokens(1.5, 2)


def test_model_from_config_and_gguf(tmp_path):
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = rf.resolve_model(str(tmp_path))
    assert rf.kv_bytes_per_token(m) == 131072 and m.head_dim == 128
    assert m.num_params == pytest.approx(8.03e9, rel=0.005)
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (
        ("block_count", 2),
        ("embedding_length", 64),
        ("feed_forward_length", 128),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
    ):
        w.add_uint32(f"llama.{k}", v)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = rf.resolve_model(str(path))
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (2, 2, 16)
    assert rf.kv_bytes_per_token(g, "fp32") == 2 * 2 * 2 * 16 * 4
    assert g.num_params == 640 and g.weight_bytes == 640 * 4


def _cli(register, argv):
    parser = argparse.ArgumentParser(prog="kvflow")
    sub = parser.add_subparsers(dest="cmd", required=True)
    register(sub)
    return parser.parse_args(argv)


def test_roofline_cli(capsys, tmp_path):
    from kvflow.cli import roofline as cli

    args = _cli(cli.register, ["roofline", "--model", "llama3-8b", "--json", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "131,072 B = 128.0 KiB" in out and "238" in out and "NO" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["results"]["kv_bytes_per_token"] == 131072 and "cpu_model" in doc["machine"]
    args = _cli(cli.register, ["roofline", "--model", "opt-13b", "--kv-dtype", "fp16", "--hardware", "a100-40gb"])
    args.func(args)
    assert "819,200 B = 800.0 KiB" in capsys.readouterr().out
    args = _cli(cli.register, ["roofline", "--hardware", "tpu9"])
    with pytest.raises(ValueError, match="unknown hardware"):
        args.func(args)


# ----------------------------------------------------------------------------------------------
# Serve client against a fake OpenAI-compatible server on 127.0.0.1
# ----------------------------------------------------------------------------------------------

FAIL_LEN = 13  # the fake server answers HTTP 500 to max_tokens == 13


def _fake_app(seen: list):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool, usage: bool):
        n = body["max_tokens"]
        if chat:  # a role-only first chunk: no content, must not count as the first token
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
        await asyncio.sleep(0.02)
        sent = 0
        while sent < n:  # two tokens per chunk: chunk count != token count
            k = min(2, n - sent)
            text = "word " * k
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            sent += k
            await asyncio.sleep(0.005)
        if usage:
            yield (
                "data: "
                + json.dumps(
                    {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n}}
                )
                + "\n\n"
            )
        yield "data: [DONE]\n\n"

    def route(prefix: str, chat: bool, usage: bool, always_fail: bool = False):
        path = prefix + ("/v1/chat/completions" if chat else "/v1/completions")

        @app.post(path)
        async def handler(request: Request):
            body = await request.json()
            seen.append(body)
            if always_fail or body["max_tokens"] == FAIL_LEN:
                return JSONResponse({"error": {"message": "engine exploded"}}, status_code=500)
            return StreamingResponse(stream(body, chat, usage), media_type="text/event-stream")

    route("", False, True)
    route("", True, True)
    route("/nousage", False, False)
    route("/bad", False, True, always_fail=True)
    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    seen: list = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(seen), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(5)
    sock.close()


def _reqs(out_lens):
    return [ds.BenchRequest(prompt="the city of light " * 2, prompt_len=8, output_len=o) for o in out_lens]


def _check_ordered(r: RequestRecord):
    assert r.arrival_time <= r.send_time < r.first_token_time <= r.chunk_times[-1] <= r.end_time
    assert r.chunk_times[0] == r.first_token_time
    assert all(b >= a for a, b in zip(r.chunk_times, r.chunk_times[1:]))


@pytest.mark.server
def test_serve_client_completions(fake_server):
    base, seen = fake_server
    seen.clear()
    out_lens = [3, 5, 4, FAIL_LEN, 1, 6]
    cfg = ServeConfig(base_url=base, max_concurrency=3, disable_tqdm=True, slo=SLO(ttft_ms=5000))
    res = run_benchmark(_reqs(out_lens), cfg)
    assert res.model == "fake-model"  # discovered through /v1/models
    assert len(seen) == len(out_lens)
    for body in seen:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["model"] == "fake-model"
    assert sorted(b["max_tokens"] for b in seen) == sorted(out_lens)
    for r, o in zip(res.records, out_lens):
        if o == FAIL_LEN:
            assert not r.success and r.error.startswith("HTTP 500") and "engine exploded" in r.error
            continue
        assert r.success, r.error
        assert r.output_tokens == o  # the server's usage.completion_tokens
        assert len(r.chunk_times) == math.ceil(o / 2)  # two tokens per chunk
        assert r.prompt_len == 11  # the server's usage.prompt_tokens
        _check_ordered(r)
        assert ttft(r) >= 0.015
    m = res.metrics
    assert m.completed == 5 and m.failed == 1 and m.total_output_tokens == 19
    assert m.max_concurrent_requests <= 3
    assert m.goodput == pytest.approx(5 / res.duration_s)


@pytest.mark.server
def test_serve_client_chat_and_no_usage(fake_server):
    base, seen = fake_server
    seen.clear()
    cfg = ServeConfig(
        base_url=base + "/v1",
        endpoint="chat",
        model="m",
        ignore_eos=False,
        disable_tqdm=True,
        request_rate=50.0,
        seed=1,
    )
    res = run_benchmark(_reqs([4, 7]), cfg)
    assert all(r.success for r in res.records)
    assert [r.output_tokens for r in res.records] == [4, 7]
    for r in res.records:
        _check_ordered(r)
    assert all("ignore_eos" not in b and b["messages"][0]["role"] == "user" for b in seen)
    # without a usage chunk, output tokens are counted with the tokenizer on the streamed text
    cfg = ServeConfig(base_url=base + "/nousage", model="m", disable_tqdm=True)
    res = run_benchmark(_reqs([5, 2]), cfg, tokenizer=ds.WordTokenizer())
    assert [r.output_tokens for r in res.records] == [5, 2]
    assert [r.generated_text.split() for r in res.records] == [["word"] * 5, ["word"] * 2]


@pytest.mark.server
def test_serve_client_failures_never_crash(fake_server):
    base, _ = fake_server
    res = run_benchmark(_reqs([2, 3]), ServeConfig(base_url=base + "/bad", model="m", disable_tqdm=True))
    assert res.metrics.completed == 0 and res.metrics.failed == 2
    assert all(r.error.startswith("HTTP 500") for r in res.records)
    # a port nothing listens on: connection errors are recorded, not raised
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    res = run_benchmark(_reqs([2]), ServeConfig(base_url=dead, model="m", disable_tqdm=True, request_timeout=5))
    assert not res.records[0].success and "Connect" in res.records[0].error


@pytest.mark.server
def test_bench_serve_cli_sweep_report(fake_server, tmp_path, capsys):
    from kvflow.cli import bench

    base, _ = fake_server
    out_json, plots = tmp_path / "res.json", tmp_path / "plots"
    args = _cli(
        bench.register,
        [
            "bench",
            "serve",
            "--base-url",
            base,
            "--num-prompts",
            "6",
            "--input-len",
            "8",
            "--output-len",
            "2:5",
            "--sweep-rates",
            "20,40",
            "--slo-ttft-ms",
            "2000",
            "--slo-tpot-ms",
            "500",
            "--result-json",
            str(out_json),
            "--plot-dir",
            str(plots),
            "--disable-tqdm",
            "--seed",
            "3",
        ],
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Sweep" in out and "Goodput" in out and "TTFT" in out
    doc = json.loads(out_json.read_text())
    assert [r["request_rate"] for r in doc["results"]] == [20.0, 40.0]
    assert len(doc["results"][0]["requests"]) == 6
    req = doc["results"][0]["requests"][0]
    assert {"ttft", "tpot", "itl", "e2el", "chunk_times", "output_tokens", "error"} <= set(req)
    assert {"cpu_model", "cpu_count", "torch", "python", "date"} <= set(doc["machine"])
    assert doc["config"]["slo"]["ttft_ms"] == 2000
    for name in ("ttft_cdf.png", "tpot_cdf.png", "sweep.png"):
        assert (plots / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_cli_parses_throughput():
    from kvflow.cli import bench

    args = _cli(
        bench.register,
        [
            "bench",
            "throughput",
            "--backend",
            "both",
            "--dataset",
            "sharegpt-like",
            "--num-prompts",
            "4",
            "--max-num-seqs",
            "8",
            "--hf-batch-size",
            "2",
        ],
    )
    assert args.func is bench.run_throughput
    kwargs = bench._engine_kwargs(args)
    assert kwargs["max_num_seqs"] == 8 and kwargs["enable_prefix_caching"] is True
    assert "seed" not in kwargs and "tokenizer" not in kwargs  # those flags are the workload's here
    with pytest.raises(SystemExit):
        _cli(bench.register, ["bench", "serve", "--request-rate", "-1"])


# ----------------------------------------------------------------------------------------------
# Mixed workload, per-request SLOs, the SLO-scheduling harness
# ----------------------------------------------------------------------------------------------


def test_mixed_dataset_classes_lengths_and_extras():
    tok = ds.WordTokenizer()
    spec = lambda **kw: ds.WorkloadSpec("mixed", num_prompts=50, seed=3, **kw)  # noqa: E731
    reqs = ds.generate_requests(spec(), tok)
    assert _key(reqs) == _key(ds.generate_requests(spec(), tok))  # seeded
    kinds = [r.request_class for r in reqs]
    assert kinds.count("batch") == 10 and kinds.count("interactive") == 40  # exactly 0.2 x 50
    assert kinds[:10] != ["batch"] * 10 and kinds != sorted(kinds)  # spread over the stream
    for r in reqs:
        assert len(tok.encode(r.prompt)) == r.prompt_len
        if r.request_class == "interactive":
            assert 32 <= r.prompt_len <= 128 and r.output_len == 64
            assert r.extra_body == {"priority": 0, "ttft_slo_ms": 1000.0, "tpot_slo_ms": 150.0}
        else:
            assert 1000 <= r.prompt_len <= 2000 and r.output_len == 256
            assert r.extra_body == {"priority": 1, "ttft_slo_ms": 30000.0, "tpot_slo_ms": 1000.0}
    small = ds.generate_requests(spec(scale=0.1, max_input_len=150, mixed_batch_fraction=0.5), tok)
    assert sum(r.request_class == "batch" for r in small) == 25
    assert all(r.prompt_len <= 150 and r.output_len in (6, 26) for r in small)
    users = ds.generate_requests(spec(mixed_users={"heavy": 10, "light": 1}), tok)
    names = [r.extra_body["user"] for r in users]
    assert names.count("light") == 5 and names.count("heavy") == 45  # 10x the light client's rate
    assert [r.request_class for r in users] == kinds  # classes are drawn first: clients leave them be
    with pytest.raises(ValueError, match="batch fraction"):
        ds.generate_requests(spec(mixed_batch_fraction=1.5), tok)
    plain = ds.generate_requests(ds.WorkloadSpec("random", num_prompts=3), tok)
    assert all(r.request_class is None and r.extra_body == {} for r in plain)  # other datasets unchanged


def test_split_counts_exact():
    assert ds.split_counts(10, [0.8, 0.2]) == [8, 2]
    assert ds.split_counts(7, [1, 1, 1]) == [3, 2, 2] and sum(ds.split_counts(101, [10, 1])) == 101
    assert ds.split_counts(5, [1, 0]) == [5, 0]
    with pytest.raises(ValueError):
        ds.split_counts(5, [0, 0])


@pytest.mark.server
def test_payload_and_record_carry_the_request_extras():
    from kvflow.bench.serve_client import build_payload, new_record

    req = ds.BenchRequest(
        "the city",
        2,
        8,
        request_class="interactive",
        extra_body={"priority": 0, "ttft_slo_ms": 500.0, "tpot_slo_ms": 50.0, "user": "light"},
    )
    body = build_payload(req, ServeConfig(extra_body={"priority": 5, "seed": 1}), "m")
    assert body["priority"] == 0 and body["seed"] == 1 and body["user"] == "light"  # the request's extras win
    assert body["ttft_slo_ms"] == 500.0 and body["tpot_slo_ms"] == 50.0
    rec = new_record(3, req, 2.0)
    assert (rec.request_class, rec.user, rec.slo) == ("interactive", "light", SLO(ttft_ms=500.0, tpot_ms=50.0))
    assert new_record(0, _reqs([4])[0], 1.0).slo is None


def _slo_rec(cls, ttft_s, tpot_s, n, slo, ok=True, user=None):
    """A request of `cls` sent at 0 with the given TTFT and TPOT (s) over n tokens."""
    chunks = [ttft_s + i * tpot_s for i in range(n)]
    return _rec(0.0, chunks if ok else [], chunks[-1], n if ok else 0, ok=ok, request_class=cls, user=user, slo=slo)


def test_per_request_slo_attainment_and_goodput():
    from kvflow.bench.report import group_table, run_goodput, slo_tables

    tight, loose = SLO(ttft_ms=1000, tpot_ms=150), SLO(ttft_ms=30000, tpot_ms=1000)
    recs = [
        _slo_rec("interactive", 0.5, 0.1, 5, tight, user="a"),  # meets
        _slo_rec("interactive", 2.0, 0.1, 5, tight, user="a"),  # TTFT 2000 > 1000
        _slo_rec("interactive", 0.5, 0.2, 5, tight, user="b"),  # TPOT 200 > 150
        _slo_rec("batch", 2.0, 0.2, 5, loose, user="b"),  # the same figures meet the batch SLO
        _slo_rec("batch", 2.0, 0.2, 5, loose, ok=False, user="b"),  # failed: never meets
    ]
    m = compute_metrics(recs, duration=2.0)
    assert m.goodput is None  # no run-wide SLO flags
    overall, inter, batch = m.per_request_slo, m.classes["interactive"], m.classes["batch"]
    assert (overall.sent, overall.completed, overall.met_slo) == (5, 4, 2)
    assert overall.attainment == pytest.approx(0.4) and overall.goodput == pytest.approx(1.0)
    assert run_goodput(m) == pytest.approx(1.0)
    assert inter.met_slo == 1 and inter.attainment == pytest.approx(1 / 3)
    assert batch.met_slo == 1 and batch.attainment == pytest.approx(0.5) and batch.completed == 1
    assert inter.slo["ttft_ms"] == 1000 and overall.slo is None  # the class shares one SLO, the run does not
    assert inter.ttft_ms["p50"] == pytest.approx(500.0) and inter.ttft_ms["p99"] == pytest.approx(1970.0)
    assert batch.tpot_ms["p99"] == pytest.approx(200.0)
    assert m.users["a"].met_slo == 1 and m.users["b"].sent == 3
    assert list(m.classes) == ["batch", "interactive"]
    # a record without its own SLO is judged on the run's flags
    mixed = compute_metrics(recs[:1] + [_rec(0.0, [3.0, 3.1], 3.1, 2)], 1.0, SLO(ttft_ms=2000))
    assert mixed.per_request_slo.met_slo == 1 and mixed.goodput == pytest.approx(1.0)
    text = slo_tables(m)
    assert "attain %" in text and "interactive" in text and "client" in text
    row = next(ln for ln in group_table(m.classes, overall).splitlines() if ln.startswith("all"))
    assert "40.00" in row and "1.00" in row
    assert json.loads(json.dumps(m.to_dict()))["classes"]["batch"]["met_slo"] == 1


@pytest.mark.server
def test_serve_client_sends_mixed_extras(fake_server):
    base, seen = fake_server
    seen.clear()
    reqs = [
        ds.BenchRequest(
            "the city",
            2,
            4,
            request_class="batch",
            extra_body={"priority": 1, "ttft_slo_ms": 30000.0, "tpot_slo_ms": 1000.0},
        )
    ]
    res = run_benchmark(reqs, ServeConfig(base_url=base, model="m", disable_tqdm=True))
    assert seen[0]["priority"] == 1 and seen[0]["ttft_slo_ms"] == 30000.0
    assert res.metrics.classes["batch"].met_slo == 1 and res.metrics.per_request_slo.attainment == 1.0


def test_bench_cli_mixed_flags():
    from kvflow.cli import bench

    args = _cli(
        bench.register,
        [
            "bench",
            "serve",
            "--dataset",
            "mixed",
            "--mixed-batch-fraction",
            "0.5",
            "--interactive-ttft-slo-ms",
            "400",
            "--batch-tpot-slo-ms",
            "2000",
            "--mixed-users",
            "heavy:10,light:1",
        ],
    )
    spec = bench.workload_spec(args)
    inter, batch = spec.mixed_classes
    assert (inter.ttft_slo_ms, inter.tpot_slo_ms, batch.ttft_slo_ms, batch.tpot_slo_ms) == (400, 150, 30000, 2000)
    assert spec.mixed_batch_fraction == 0.5 and spec.mixed_users == {"heavy": 10.0, "light": 1.0}
    assert ds.INTERACTIVE.ttft_slo_ms == 1000  # the defaults are not touched
    for bad in (["--mixed-batch-fraction", "2"], ["--batch-ttft-slo-ms", "0"]):
        with pytest.raises(SystemExit):
            _cli(bench.register, ["bench", "serve", *bad])
    with pytest.raises(ValueError, match="NAME:WEIGHT"):
        bench.parse_weights("heavy,light:1")


@pytest.fixture(scope="module")
def harness():
    import importlib
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        yield importlib.import_module("slo_scheduling")
    finally:
        sys.path.pop(0)


@pytest.mark.server
def test_harness_arguments(harness):
    a = harness.parse_args(["--server-args", "--model /m --max-num-seqs 4", "--num-prompts", "8"])
    assert a.policies == ["fcfs", "priority", "slo"] and a.rates == [0.5, 1.0, 1.5, 2.0]
    assert a.dataset == "mixed" and a.server_flags == ["--model", "/m", "--max-num-seqs", "4"]
    assert harness.flag_value(a.server_flags, "--model") == "/m" and harness.flag_value(["--x=3"], "--x") == "3"
    a = harness.parse_args(["--policies", "slo,fcfs", "--rates", "1,3", "--seed", "7"])
    assert a.policies == ["slo", "fcfs"] and a.rates == [1.0, 3.0] and a.seed == 7
    v = harness.parse_args(["--scenario", "vtc", "--vtc-ratio", "4", "--server-args", "--scheduling-policy slo"])
    assert v.mixed_users == "heavy:4,light:1"
    for bad in (
        ["--policies", "fcfs,lifo"],
        ["--rates", "1,inf"],
        ["--server-args", "--scheduling-policy slo"],
        ["--scenario", "vtc", "--server-args", "--fairness vtc"],
    ):
        with pytest.raises(SystemExit):
            harness.parse_args(bad)


def _fake_run(harness, server, rate, recs, workload="mixed"):
    from kvflow.bench.serve_client import RunResult

    res = RunResult(rate, 1.0, None, "m", 2.0, recs, compute_metrics(recs, 2.0))
    return harness.Run(server, workload, rate, res)


@pytest.mark.server
def test_harness_tables(harness, tmp_path):
    tight, loose = SLO(ttft_ms=1000, tpot_ms=150), SLO(ttft_ms=30000, tpot_ms=1000)
    good = [_slo_rec("interactive", 0.1, 0.01, 4, tight), _slo_rec("batch", 1.0, 0.1, 4, loose)]
    bad = [_slo_rec("interactive", 1.5, 0.01, 4, tight), _slo_rec("batch", 1.0, 0.1, 4, loose, ok=False)]
    runs = [
        _fake_run(harness, "fcfs", 1.0, good),
        _fake_run(harness, "fcfs", 2.0, bad),
        _fake_run(harness, "slo", 1.0, good),
    ]
    rows = [harness.policy_row(r) for r in runs]
    assert (rows[0].goodput, rows[0].attainment, rows[0].batch_finished) == (1.0, 1.0, 1.0)
    r = rows[1]
    assert (r.goodput, r.attainment, r.interactive, r.batch, r.batch_finished) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert r.interactive_ttft_p99_ms == pytest.approx(1500.0)
    table = harness.policy_table(rows)
    lines = table.splitlines()
    assert "batch finished %" in lines[1] and lines[3].split()[:4] == ["fcfs", "1", "1.00", "100.00"]
    assert lines[4].split()[-2:] == ["1,500.00", "0.00"] and lines[5].startswith("slo")
    png = harness.plot_policies(rows, str(tmp_path))
    assert open(png, "rb").read(4) == b"\x89PNG"

    light = lambda t: [_slo_rec("interactive", t, 0.01, 3, tight, user="light")]  # noqa: E731
    heavy = [_slo_rec("interactive", 0.9, 0.01, 3, tight, user="heavy")]
    vruns = [
        _fake_run(harness, "no VTC", 4.0, light(0.1), "light only"),
        _fake_run(harness, "no VTC", 4.0, light(0.8) + heavy),
        _fake_run(harness, "VTC", 4.0, light(0.2) + heavy),
    ]
    (row,) = harness.vtc_rows(vruns)
    assert (row.rate, row.alone, row.mixed, row.mixed_vtc) == pytest.approx((4.0, 100.0, 800.0, 200.0))
    assert harness.vtc_table([row]).splitlines()[-1].split() == ["4", "100.00", "800.00", "200.00"]


@pytest.mark.server
def test_harness_workloads_and_checks(harness):
    reqs = ds.generate_requests(ds.WorkloadSpec("mixed", num_prompts=22, mixed_users={"heavy": 10, "light": 1}))
    no_vtc, vtc = harness.vtc_variants(reqs)
    assert no_vtc.flags == ["--fairness", "none"] and vtc.flags == ["--fairness", "vtc"]
    alone, mixed = no_vtc.workloads
    assert len(alone.requests) == 2 and alone.rate_factor == pytest.approx(1 / 11) and mixed.requests is reqs
    (p,) = harness.policy_variants(["slo"], reqs)
    assert p.flags == ["--scheduling-policy", "slo"] and p.workloads[0].requests is reqs
    harness.check_fits(reqs, None)
    with pytest.raises(harness.ServerError, match="max_model_len is 512"):
        harness.check_fits(reqs, 512)
    msg = harness.start_failure_message(
        "usage: ...\nkvflow serve: error: unrecognized arguments: --scheduling-policy fcfs\n", 2
    )
    assert "has not landed" in msg
    assert "has not landed" in harness.start_failure_message(
        "kvflow serve: error: argument --fairness: invalid choice: 'vtc'", 2
    )
    assert "exited with code 1" in harness.start_failure_message("Traceback\nboom", 1)


@pytest.mark.server
def test_harness_server_never_left_behind(harness):
    import os
    import sys

    # a "server" that ignores SIGTERM and never answers /health: timed out, then killed
    cmd = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('loading', flush=True); time.sleep(60)",
    ]
    server = harness.ManagedServer(cmd, [], startup_timeout=1.5, stop_timeout=0.5)
    with pytest.raises(harness.ServerError, match="did not answer /health") as e:
        with server:
            pass
    assert "loading" in str(e.value) and server.proc.returncode == -9
    with pytest.raises(ProcessLookupError):
        os.killpg(server.proc.pid, 0)  # nothing of its process group is left
    # an unknown flag: the argparse error is turned into the scheduling message
    fail = [
        sys.executable,
        "-c",
        "import argparse; p = argparse.ArgumentParser(prog='kvflow serve'); p.add_argument('--port'); p.parse_args()",
    ]
    server = harness.ManagedServer(fail, ["--scheduling-policy", "fcfs"], startup_timeout=30, stop_timeout=1)
    with pytest.raises(harness.ServerError, match="has not landed"):
        server.__enter__()
    assert server.proc.returncode == 2


@pytest.mark.server
def test_harness_fresh_server_per_run_and_no_warm_up_hit(harness, monkeypatch):
    """Every (workload, rate) gets its own server, so a later run never finds an earlier run's
    prompts in the prefix cache; the warm-up is as long as the longest prompt but not the same."""
    import kvflow.bench.serve_client as client

    started, sent = [], []

    class FakeServer:
        def __init__(self, cmd, flags, *_):
            started.append(list(flags))
            self.url = f"http://127.0.0.1:{len(started)}"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def check_alive(self):
            pass

    def fake_benchmark(requests, cfg, tokenizer=None):
        sent.append((cfg.base_url, cfg.request_rate, [r.prompt for r in requests]))
        recs = [_slo_rec("interactive", 0.1, 0.01, 4, SLO(ttft_ms=1000, tpot_ms=150)) for _ in requests]
        return client.RunResult(cfg.request_rate, 1.0, None, "m", 1.0, recs, compute_metrics(recs, 1.0))

    monkeypatch.setattr(harness, "ManagedServer", FakeServer)
    monkeypatch.setattr(harness, "server_max_model_len", lambda url: None)
    monkeypatch.setattr(harness, "step_cost_error", lambda url: None)
    monkeypatch.setattr(client, "run_benchmark", fake_benchmark)
    args = harness.parse_args(["--rates", "0.5,1", "--num-prompts", "6"])
    reqs = ds.generate_requests(ds.WorkloadSpec("mixed", num_prompts=6))
    (variant,) = harness.policy_variants(["slo"], reqs)
    runs = harness.run_variant(variant, args, None)
    assert [r.rate for r in runs] == [0.5, 1.0] and len(started) == 2
    assert all(flags[:2] == ["--scheduling-policy", "slo"] for flags in started)
    measured = [s for s in sent if len(s[2]) == len(reqs)]
    assert [(url, rate) for url, rate, _ in measured] == [("http://127.0.0.1:1", 0.5), ("http://127.0.0.1:2", 1.0)]
    warm = [p for url, _, prompts in sent if len(prompts) == 1 for p in prompts]
    longest = max(reqs, key=lambda r: r.prompt_len).prompt
    assert len(warm) == 4 and all(p not in [r.prompt for r in reqs] for p in warm)
    assert any(len(p.split()) == len(longest.split()) for p in warm)
