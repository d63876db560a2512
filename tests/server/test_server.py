"""The OpenAI-compatible server against a tiny random Llama, in-process on a free loopback port.

One shared server for the API tests; small dedicated servers for admission control/preemption,
fault injection and graceful shutdown (whose state they change for good)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from kvflow.config import EngineConfig, ServerConfig

from conftest import assert_no_leaks
from server_utils import LiveServer, wait_for

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama):
    path, _ = tiny_llama
    s = LiveServer(
        EngineConfig(model=path, num_kv_blocks=512, max_num_seqs=64),
        ServerConfig(max_request_body_bytes=20_000, log_interval_s=0.5),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def post(server, path, body=None, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kwargs)


def assert_error(resp: httpx.Response, status: int, *, param=..., code=..., contains: tuple[str, ...] = ()) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    for s in contains:
        assert s in err["message"], err
    return err


# ---- the openai client ------------------------------------------------------------------------------
def test_models_health_metrics(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert client.models.retrieve(server.model).id == server.model
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and "kvflow:num_requests_running" in r.text


def test_completion_usage_and_defaults(server, client):
    r = client.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=5, extra_body=IGNORE_EOS)
    n_prompt = post(server, "/tokenize", {"prompt": "The quick brown fox"}).json()["count"]
    assert r.object == "text_completion" and r.model == server.model and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == n_prompt + 5
    assert r.choices[0].finish_reason == "length"
    # OpenAI's default max_tokens for completions is 16
    r = client.completions.create(model=server.model, prompt="hello", extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 16
    # chat's default is "up to the context" (None: the engine fills in max_model_len - prompt)
    from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.to_sampling_params().max_tokens is None
    assert CompletionRequest(prompt="x").to_sampling_params().max_tokens == 16
    assert (
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=7)
        .to_sampling_params()
        .max_tokens
        == 7
    )


def test_completion_stream_equals_nonstream(server, client):
    kw = dict(
        model=server.model, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=1234, extra_body=IGNORE_EOS
    )
    full = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert again.choices[0].text == full.choices[0].text  # the seed makes it reproducible
    text, usage, finish = "", None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            assert chunk.usage is None
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert text == full.choices[0].text
    assert finish == "length"
    assert usage.completion_tokens == 12 and usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_and_stream(server, client):
    kw = dict(
        model=server.model,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "Paris is the capital of"}],
        max_tokens=10,
        temperature=0.7,
        seed=99,
        extra_body=IGNORE_EOS,
    )
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and full.id.startswith("chatcmpl-")
    assert full.usage.completion_tokens == 10
    # the prompt is the chat template's text, tokenized without extra special tokens
    tok = post(server, "/tokenize", {"messages": kw["messages"]}).json()
    assert full.usage.prompt_tokens == tok["count"]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_n_and_batched_prompts(server, client):
    r = client.completions.create(
        model=server.model, prompt="Berlin is", n=3, max_tokens=6, temperature=1.0, seed=5, extra_body=IGNORE_EOS
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    assert len({c.text for c in r.choices}) > 1  # each choice has its own seed stream
    ids = post(server, "/tokenize", {"prompt": "hello world"}).json()["tokens"]
    r = client.completions.create(
        model=server.model, prompt=["Berlin is", "Paris is"], n=2, max_tokens=3, extra_body=IGNORE_EOS, **GREEDY
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    single = client.completions.create(
        model=server.model, prompt="Paris is", max_tokens=3, extra_body=IGNORE_EOS, **GREEDY
    )
    assert {c.index: c.text for c in r.choices}[2] == single.choices[0].text
    # token-id prompts: one list, and a list of lists
    a = client.completions.create(model=server.model, prompt=ids, max_tokens=4, extra_body=IGNORE_EOS, **GREEDY)
    b = client.completions.create(
        model=server.model, prompt="hello world", max_tokens=4, extra_body=IGNORE_EOS, **GREEDY
    )
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(ids)
    c = client.completions.create(
        model=server.model, prompt=[ids, ids[:2]], max_tokens=2, extra_body=IGNORE_EOS, **GREEDY
    )
    assert len(c.choices) == 2 and c.usage.prompt_tokens == len(ids) + 2
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=3, extra_body=IGNORE_EOS
    )
    assert sorted(ch.index for ch in chat.choices) == [0, 1]
    # streamed n: every choice gets its role chunk and its finish
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "x"}],
            n=2,
            max_tokens=3,
            stream=True,
            extra_body=IGNORE_EOS,
        )
    )
    assert {c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"} == {0, 1}
    assert {c.choices[0].index for c in chunks if c.choices[0].finish_reason} == {0, 1}


def test_stop_strings(server, client):
    kw = dict(model=server.model, prompt="The quick brown fox jumps", max_tokens=24, extra_body=IGNORE_EOS, **GREEDY)
    text = client.completions.create(**kw).choices[0].text
    stop = next(
        (
            text[i : i + 2]
            for i in range(3, len(text) - 2)
            if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i
        ),
        None,
    )
    assert stop, text
    r = client.completions.create(stop=[stop, "zzzz-never"], **kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and text.startswith(c.text) and c.text == text[: text.find(stop)]
    assert c.model_extra["stop_reason"] == stop
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == c.text
    # stop_token_ids (vLLM extra) and chat stop
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=24,
        stop=[stop],
        extra_body=IGNORE_EOS,
        **GREEDY,
    )
    assert stop not in chat.choices[0].message.content


def test_logprobs(server, client):
    r = client.completions.create(
        model=server.model, prompt="Emoji test", max_tokens=6, logprobs=3, extra_body=IGNORE_EOS, **GREEDY
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for val, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 1 <= len(top) <= 4  # top 3 + the sampled one (keys are strings: may collide)
        assert max(top.values()) == pytest.approx(val, abs=1e-4)  # greedy: the sampled token is the top one
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # streamed logprobs add up to the same
    toks = []
    for ch in client.completions.create(
        model=server.model, prompt="Emoji test", max_tokens=6, logprobs=3, stream=True, extra_body=IGNORE_EOS, **GREEDY
    ):
        if ch.choices[0].logprobs:
            toks += ch.choices[0].logprobs.tokens
    assert toks == lp.tokens
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        extra_body=IGNORE_EOS,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        raw = bytes(entry.bytes)
        assert entry.token == (raw.decode() if _utf8(raw) else "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
    plain = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert plain.choices[0].logprobs is None


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_echo_and_tokenize_roundtrip(server, client):
    r = client.completions.create(
        model=server.model, prompt="Paris is the", max_tokens=3, echo=True, extra_body=IGNORE_EOS, **GREEDY
    )
    plain = client.completions.create(
        model=server.model, prompt="Paris is the", max_tokens=3, extra_body=IGNORE_EOS, **GREEDY
    )
    assert r.choices[0].text == "Paris is the" + plain.choices[0].text
    tok = post(server, "/tokenize", {"prompt": "Paris is the", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 512
    assert post(server, "/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": "Paris is the"}


# ---- errors (raw HTTP) ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("temperature", -1, ">= 0"),
        ("top_p", 1.5, "(0, 1]"),
        ("logprobs", 25, "exceeds max_logprobs 20"),
        ("n", 0, "greater than or equal to 1"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", "many", "valid integer"),
        ("presence_penalty", 3, "[-2, 2]"),
        ("top_k", -5, "positive integer"),
    ],
)
def test_completion_validation_errors(server, field, value, fragment):
    r = post(server, "/v1/completions", {"model": server.model, "prompt": "hi", field: value})
    assert_error(r, 400, param=field, contains=(field, fragment))


def test_request_errors(server):
    m = server.model
    assert_error(post(server, "/v1/completions", {"model": m}), 400, param="prompt", contains=("prompt",))
    assert_error(post(server, "/v1/completions", {"model": m, "prompt": []}), 400, param="prompt")
    assert_error(post(server, "/v1/completions", {"model": m, "prompt": [1, "a"]}), 400, param="prompt")
    assert_error(
        post(server, "/v1/completions", {"model": m, "prompt": [100000]}),
        400,
        param="prompt",
        contains=("100000", "out of range"),
    )
    assert_error(post(server, "/v1/chat/completions", {"model": m, "messages": []}), 400, param="messages")
    assert_error(
        post(server, "/v1/chat/completions", {"model": m, "messages": [{"role": "robot", "content": "x"}]}),
        400,
        param="messages.0.role",
    )
    assert_error(
        post(
            server,
            "/v1/chat/completions",
            {"model": m, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 30, "logprobs": True},
        ),
        400,
        param="top_logprobs",
        contains=("20",),
    )
    # context length: both lengths in the message
    err = assert_error(
        post(server, "/v1/completions", {"model": m, "prompt": [5] * 600}),
        400,
        param="prompt",
        code="context_length_exceeded",
    )
    assert "600" in err["message"] and "512" in err["message"]
    err = assert_error(
        post(server, "/v1/completions", {"model": m, "prompt": [5] * 10, "max_tokens": 510}),
        400,
        param="max_tokens",
        code="context_length_exceeded",
    )
    assert "510" in err["message"] and "512" in err["message"]
    err = assert_error(
        post(server, "/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "hello " * 600}]}),
        400,
        param="messages",
        code="context_length_exceeded",
    )
    assert "512" in err["message"]
    # unknown model
    assert_error(
        post(server, "/v1/completions", {"model": "gpt-17", "prompt": "hi"}),
        404,
        param="model",
        code="model_not_found",
        contains=("gpt-17",),
    )
    assert_error(httpx.get(server.url + "/v1/models/gpt-17"), 404, code="model_not_found")
    # malformed JSON, not an object
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert_error(r, 400, code="invalid_json")
    # unknown route, wrong method: same error shape
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)
    # detokenize out of range
    assert_error(post(server, "/detokenize", {"tokens": [1, 99999]}), 400, param="tokens")
    assert_error(post(server, "/tokenize", {}), 400)


def test_body_too_large(server):
    big = {"model": server.model, "prompt": "x" * 30_000}
    err = assert_error(post(server, "/v1/completions", big), 413, code="request_too_large")
    assert "20000" in err["message"]

    def chunks():  # no Content-Length: the streamed size is checked too
        for _ in range(30):
            yield b" " * 1000

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(r, 413, code="request_too_large")
    assert post(server, "/v1/completions", {"model": server.model, "prompt": "ok", "max_tokens": 1}).status_code == 200


def test_api_key(tiny_llama):
    s = LiveServer(EngineConfig(model=tiny_llama[0], num_kv_blocks=64), ServerConfig(api_key="sekret"))
    try:
        body = {"model": s.model, "prompt": "hi", "max_tokens": 2}
        assert_error(post(s, "/v1/completions", body), 401, code="invalid_api_key", contains=("missing",))
        assert_error(
            post(s, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key"
        )
        assert_error(httpx.get(s.url + "/v1/models"), 401)
        assert post(s, "/v1/completions", body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # probes stay open
        assert httpx.get(s.url + "/metrics").status_code == 200
        import openai as oa

        with pytest.raises(oa.AuthenticationError):
            oa.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()
        ok = oa.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=s.model, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        s.stop()


# ---- concurrency, disconnects -----------------------------------------------------------------------
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "def hello(name):",
    "Paris is the capital",
    "Berlin is",
    "Emoji test:",
    "a little engine",
    "served many requests",
]


def test_128_concurrent_streams(server, client):
    kw = dict(model=server.model, max_tokens=8, extra_body=IGNORE_EOS, **GREEDY)
    reference = {p: client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS}
    before = server.metrics()
    seen = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
    stop_polling = threading.Event()

    def poll():  # the gauges move while the load runs
        while not stop_polling.is_set():
            m = server.metrics()
            seen["running"] = max(seen["running"], m["kvflow:num_requests_running"])
            seen["waiting"] = max(seen["waiting"], m["kvflow:num_requests_waiting"])
            seen["kv"] = max(seen["kv"], m["kvflow:kv_cache_usage_perc"])
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()

    async def one(aclient, prompt):
        text, finish = "", None
        async for chunk in await aclient.completions.create(prompt=prompt, stream=True, **kw):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return prompt, text, finish

    async def run_all():
        async with server.async_openai(timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % len(PROMPTS)]) for i in range(128)))

    try:
        results = asyncio.run(run_all())
    finally:
        stop_polling.set()
        poller.join()
    assert len(results) == 128
    for prompt, text, finish in results:
        assert finish == "length"
        assert text == reference[prompt], prompt
    m = server.metrics()
    assert m["kvflow:kv_cache_usage_perc"] == 0.0 and m["kvflow:num_requests_running"] == 0.0
    assert m["kvflow:num_requests_waiting"] == 0.0
    assert seen["running"] > 0 and seen["kv"] > 0, seen
    assert m["kvflow:generation_tokens_total"] - before["kvflow:generation_tokens_total"] == 128 * 8
    assert (
        m['kvflow:request_success_total{finished_reason="length"}']
        - before['kvflow:request_success_total{finished_reason="length"}']
        == 128
    )
    server.call(assert_no_leaks)


def test_disconnects_free_everything(server):
    before = server.metrics()['kvflow:request_success_total{finished_reason="abort"}']
    body = {
        "model": server.model,
        "prompt": "The quick brown fox",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }

    async def stream_and_close(aclient: httpx.AsyncClient, i: int):
        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
        b = (
            dict(body)
            if i % 2
            else {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
        )
        async with aclient.stream("POST", server.url + path, json=b) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n >= 3:
                        break  # leaving the block closes the connection mid-stream

    async def non_stream_timeout(aclient: httpx.AsyncClient):
        with pytest.raises(httpx.ReadTimeout):
            await aclient.post(
                server.url + "/v1/completions",
                json={**body, "stream": False},
                timeout=httpx.Timeout(0.5, connect=10),  # (the read gives up, not a slow connect)
            )

    async def run():
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=30, limits=limits) as aclient:
            await asyncio.gather(
                *(stream_and_close(aclient, i) for i in range(20)), *(non_stream_timeout(aclient) for _ in range(3))
            )

    runner = server.engine.runner
    real_execute = runner.execute

    def slow_execute(sched, *rest):  # >= 5 ms a step: 480 tokens take >= 2.4 s, far beyond the clients
        time.sleep(0.005)
        return real_execute(sched, *rest)

    runner.execute = slow_execute
    try:
        asyncio.run(run())
    finally:
        runner.execute = real_execute
    t0 = time.monotonic()
    server.wait_engine_idle(timeout=10)
    assert time.monotonic() - t0 < 5
    server.call(assert_no_leaks)
    wait_for(
        lambda: server.metrics()['kvflow:request_success_total{finished_reason="abort"}'] - before >= 23,
        5,
        "aborts not counted",
    )
    m = server.metrics()
    assert m["kvflow:num_requests_running"] == 0 and m["kvflow:kv_cache_usage_perc"] == 0
    assert server.llm.num_in_flight == 0


def test_latency_metrics_moved(server, client):
    client.completions.create(model=server.model, prompt="hi", max_tokens=3, extra_body=IGNORE_EOS)
    m = server.metrics()
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert m[f"kvflow:{name}_count"] > 0 and m[f"kvflow:{name}_sum"] > 0, name
    assert m["kvflow:prompt_tokens_total"] > 0 and m["kvflow:generation_tokens_total"] > 0
    assert m['kvflow:request_success_total{finished_reason="length"}'] > 0


def test_stats_log_line(server, client, caplog):
    import logging

    stat_logger = server.llm._stat_logger
    interval, stat_logger.interval_s = stat_logger.interval_s, 0.02  # a step of the tiny model takes ms
    try:
        with caplog.at_level(logging.INFO, logger="kvflow"):
            client.completions.create(model=server.model, prompt="hi", max_tokens=40, extra_body=IGNORE_EOS)
    finally:
        stat_logger.interval_s = interval
    lines = [r.getMessage() for r in caplog.records if "generation throughput" in r.getMessage()]
    assert lines, "no stats line while busy"
    assert "running:" in lines[0] and "KV cache usage" in lines[0] and "preemptions" in lines[0]


# ---- admission control and preemption (a small server) ----------------------------------------------
@pytest.fixture(scope="module")
def small_server(tiny_llama):
    # 8 blocks of 16 tokens: four 50-token sequences need 16 blocks, so they preempt each other.
    s = LiveServer(
        EngineConfig(model=tiny_llama[0], num_kv_blocks=8, max_model_len=64, max_num_seqs=4),
        ServerConfig(max_waiting_requests=4),
    )
    yield s
    s.stop()


def test_preemption_metric(small_server):
    s = small_server
    body = {"model": s.model, "max_tokens": 40, "ignore_eos": True, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(
                *(c.post(s.url + "/v1/completions", json={**body, "prompt": p}) for p in PROMPTS[:4])
            )

    results = asyncio.run(run())
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in results)
    assert s.metrics()["kvflow:num_preemptions_total"] > 0
    s.call(assert_no_leaks)


def test_admission_control(small_server):
    s = small_server
    body = {"model": s.model, "max_tokens": 60, "ignore_eos": True, "prompt": "hi"}

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(s.url + "/v1/completions", json=body) for _ in range(16)))

    # Steps of the tiny model take well under a millisecond: slow them down so that the gauges are
    # seen mid-burst by the polling below whatever the machine's speed (the engine is not changed).
    runner = s.engine.runner
    real_execute = runner.execute

    def slow_execute(sched, *rest):
        time.sleep(0.005)
        return real_execute(sched, *rest)

    out: list = []
    burst = threading.Thread(target=lambda: out.extend(asyncio.run(run())))
    runner.execute = slow_execute
    burst.start()
    try:  # 8 blocks hold two 62-token sequences: some run, the rest wait (the gauges move)
        wait_for(
            lambda: (
                (m := s.metrics())["kvflow:num_requests_waiting"] > 0
                and m["kvflow:num_requests_running"] > 0
                and m["kvflow:kv_cache_usage_perc"] > 0
            ),
            20,
            "the gauges did not move",
        )
    finally:
        burst.join(60)
        runner.execute = real_execute
    results = out
    codes = [r.status_code for r in results]
    # at most 4 running + 4 waiting at a time, and each request takes 60 steps
    assert set(codes) <= {200, 503} and codes.count(503) >= 4 and codes.count(200) >= 4, codes
    rejected = [r for r in results if r.status_code == 503]
    assert rejected[0].headers["Retry-After"] == "1"
    assert_error(rejected[0], 503, code="overloaded", contains=("max_waiting_requests",))
    assert s.metrics()['kvflow:request_rejected_total{reason="queue_full"}'] == len(rejected)
    s.wait_engine_idle()
    # n larger than the queue can ever hold is a 400, not a retryable 503
    assert_error(post(s, "/v1/completions", {**body, "n": 5}), 400, param="n")
    assert s.metrics()['kvflow:request_rejected_total{reason="queue_full"}'] == len(rejected)


# ---- fault injection --------------------------------------------------------------------------------
def test_engine_fault(tiny_llama):
    s = LiveServer(EngineConfig(model=tiny_llama[0], num_kv_blocks=64))
    try:
        runner = s.engine.runner
        real_execute = runner.execute
        broken = threading.Event()

        def execute(sched, *rest):
            if broken.is_set():
                raise RuntimeError("injected fault")
            return real_execute(sched, *rest)

        runner.execute = execute
        body = {"model": s.model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
        results: dict[str, object] = {}

        async def streamer(c: httpx.AsyncClient, i: int):
            events = []
            async with c.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:  # break the model once all four requests are in flight
                            deadline = time.monotonic() + 10
                            while s.llm.num_in_flight < 4 and not broken.is_set() and time.monotonic() < deadline:
                                await asyncio.sleep(0.005)
                            broken.set()
            results[f"stream{i}"] = events

        async def non_streamer(c: httpx.AsyncClient, i: int):
            results[f"plain{i}"] = await c.post(
                s.url + "/v1/chat/completions",
                json={
                    **{k: v for k, v in body.items() if k != "prompt"},
                    "messages": [{"role": "user", "content": "x"}],
                },
            )

        async def run():
            async with httpx.AsyncClient(timeout=30) as c:
                await asyncio.gather(*(streamer(c, i) for i in range(2)), *(non_streamer(c, i) for i in range(2)))

        asyncio.run(run())
        for i in range(2):
            events = results[f"stream{i}"]
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert "injected fault" in err["message"] and err["type"] == "server_error"
            r = results[f"plain{i}"]
            assert_error(r, 500, code="engine_error", contains=("injected fault",))
        assert_error(httpx.get(s.url + "/health"), 503, code="engine_dead")
        assert s.exit_codes == [1]
        # the dead engine refuses new work instead of hanging
        assert_error(post(s, "/v1/completions", {**body, "max_tokens": 2}), 503, code="engine_dead")
        m = s.metrics()
        assert m['kvflow:request_success_total{finished_reason="error"}'] == 4
        assert s.llm.num_in_flight == 0
        # the openai client sees a clean error too
        with pytest.raises(openai.APIStatusError):
            s.openai().completions.create(model=s.model, prompt="hi", max_tokens=2)
    finally:
        s.stop()


# ---- graceful shutdown --------------------------------------------------------------------------------
def test_drain_in_process(tiny_llama):
    s = LiveServer(EngineConfig(model=tiny_llama[0], num_kv_blocks=64))
    real_execute = s.engine.runner.execute

    def slow_execute(sched, *rest):  # 20 ms a step: "short" takes ~0.4 s, "long" ~8 s, the grace is 2 s
        time.sleep(0.02)
        return real_execute(sched, *rest)

    s.engine.runner.execute = slow_execute
    try:
        results: dict[str, list] = {}
        first_chunk = {"short": threading.Event(), "long": threading.Event()}

        def stream(name: str, max_tokens: int):
            body = {"model": s.model, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            events = []
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk[name].set()
            results[name] = events

        threads = [
            threading.Thread(target=stream, args=("short", 20)),
            threading.Thread(target=stream, args=("long", 400)),
        ]
        for t in threads:
            t.start()
        for e in first_chunk.values():
            assert e.wait(10)
        fut = asyncio.run_coroutine_threadsafe(s.state.shutdown(grace_s=2.0), s.llm._loop)
        wait_for(lambda: s.state.draining, 5, "not draining")
        r = post(s, "/v1/completions", {"model": s.model, "prompt": "late", "max_tokens": 2})
        assert_error(r, 503, code="shutting_down")
        assert r.headers["Retry-After"]
        assert httpx.get(s.url + "/health").status_code == 503
        fut.result(15)
        for t in threads:
            t.join(10)
        assert s.exit_codes == [0]
        finishes = {
            name: [json.loads(e)["choices"][0]["finish_reason"] for e in ev[:-1] if json.loads(e)["choices"]]
            for name, ev in results.items()
        }
        assert results["short"][-1] == "[DONE]" and finishes["short"][-1] == "length"  # finished in the grace
        assert results["long"][-1] == "[DONE]" and finishes["long"][-1] == "abort"  # aborted at its end
        s.wait_engine_idle()
        s.call(assert_no_leaks)
    finally:
        s.stop()


def test_sigterm_subprocess(tiny_llama, tmp_path):
    """`kvflow serve` for real: prints its URL, drains on SIGTERM (the in-flight stream completes)
    and exits 0."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvflow.cli.main",
            "serve",
            tiny_llama[0],  # (positional, as `vllm serve MODEL`)
            "--port",
            str(port),
            "--num-kv-blocks",
            "64",
            "--shutdown-grace-s",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in line, (line, proc.poll())
        url = f"http://127.0.0.1:{port}"
        events = []
        started = threading.Event()

        def stream():
            body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        events.append(ln[6:])
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(15)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert proc.wait(30) == 0, proc.stderr.read()
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_FAULTY_SERVER = """
import sys
from kvflow.config import EngineConfig, ServerConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.entrypoints.openai.api_server import serve

engine = LLMEngine(EngineConfig(model=sys.argv[1], num_kv_blocks=64))
real = engine.runner.execute
calls = [0]

def execute(sched, *rest):
    calls[0] += 1
    if calls[0] > 3:
        raise RuntimeError("injected fault")
    return real(sched, *rest)

engine.runner.execute = execute
sys.exit(serve(engine, ServerConfig(port=int(sys.argv[2])), on_ready=lambda url: print("ready", url, flush=True)))
"""


def test_engine_fault_exits_process(tiny_llama):
    """The real exit action: after the in-flight request got its 500, the process exits 1."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", _FAULTY_SERVER, tiny_llama[0], str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), (line, proc.poll())
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 20}, timeout=30)
        assert_error(r, 500, code="engine_error", contains=("injected fault",))
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_model_given_twice_is_refused(tiny_llama):
    from kvflow.cli.main import main

    with pytest.raises(SystemExit, match="the model is given twice"):
        main(["serve", tiny_llama[0], "--model", tiny_llama[0] + "-other"])


def test_several_served_model_names(tiny_llama):
    """vLLM's --served-model-name a b: a request may name either; responses name the first."""
    from server_utils import post, post_ok

    s = LiveServer(
        EngineConfig(model=tiny_llama[0], num_kv_blocks=32, max_model_len=64),
        ServerConfig(served_model_name=["main", "alias"]),
    )
    try:
        body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
        assert post_ok(s, "/v1/completions", {**body, "model": "alias"})["model"] == "main"
        chat = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert post_ok(s, "/v1/chat/completions", chat)["model"] == "main"
        listed = httpx.get(s.url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["main", "alias"]
        assert httpx.get(s.url + "/v1/models/alias").json()["id"] == "alias"
        missing = post(s, "/v1/completions", {**body, "model": "other"})
        assert missing.status_code == 404 and "`main`, `alias`" in missing.json()["error"]["message"]
    finally:
        s.stop()
    with pytest.raises(ValueError, match="served_model_name must be one or more non-empty names"):
        ServerConfig(served_model_name=[""])


def test_x_request_id(server):
    """vLLM's X-Request-Id: the response's id carries the client's, /debug/requests finds the
    request under it, the header comes back; one id twice in flight is a 400; a malformed one too."""
    from server_utils import post

    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-42.a:b"}, timeout=30)
    assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-42.a:b"
    assert r.headers["x-request-id"] == "trace-42.a:b"
    steps = httpx.get(server.url + "/debug/requests/cmpl-trace-42.a:b", timeout=30)
    assert steps.status_code == 200, steps.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "c1"}, timeout=30)
    assert r.json()["id"] == "chatcmpl-c1" and r.headers["x-request-id"] == "c1"
    assert "x-request-id" not in post(server, "/v1/completions", body).headers
    bad = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "a b"}, timeout=30)
    assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]

    async def twice():
        long = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream(
                "POST", server.url + "/v1/completions", json=long, headers={"X-Request-Id": "dup"}
            ) as s:
                first = None
                async for line in s.aiter_lines():
                    if line.startswith("data: {"):
                        break  # the first request is in flight
                second = await c.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "dup"})
                first = s.status_code
        return first, second

    first, second = asyncio.run(twice())
    assert first == 200 and second.status_code == 400 and "already in use" in second.json()["error"]["message"]
    server.wait_engine_idle()
    again = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "dup"}, timeout=30)
    assert again.status_code == 200  # (free again once the first ended)
