"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the choices are HF
transformers' `generate(num_beams=n)` beams on the same weights, best first, streamed or not; the
sampling fields beam search cannot honour are 400s naming them; a client that leaves mid-search
leaves no request or KV block behind."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kvflow.config import EngineConfig

from conftest import assert_no_leaks, hf_beams
from server_utils import LiveServer, post

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

NEW = 8


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = LiveServer(EngineConfig(model=tiny_llama[0], num_kv_blocks=256, max_model_len=256))
    s.hf = tiny_llama[1]
    yield s
    s.stop()


def test_completions_are_hf_beams(server):
    prompts = [[5, 17, 33, 4], list(range(40, 61))]
    body = {"prompt": prompts, "n": 3, "max_tokens": NEW, "use_beam_search": True, "return_token_ids": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    tok = server.llm.tokenizer
    assert [c["index"] for c in data["choices"]] == list(range(6))
    for p, prompt in enumerate(prompts):
        choices = data["choices"][3 * p : 3 * p + 3]
        assert [c["token_ids"] for c in choices] == hf_beams(server.hf, prompt, 3, NEW, [1])[0]
        for c in choices:
            assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True)
            assert c["finish_reason"] == ("stop" if c["token_ids"][-1] == 1 else "length")
    n_out = sum(len(c["token_ids"]) for c in data["choices"])
    usage = {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {"prompt_tokens": 25, "completion_tokens": n_out, "total_tokens": 25 + n_out}

    # streamed: each choice whole, the same text
    texts: dict[int, str] = {}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(6)] == [c["text"] for c in data["choices"]]

    # logprobs: each token's, summing to what ranks the beams (length_penalty 0: the sum itself)
    lp = post(server, "/v1/completions", {**body, "prompt": prompts[0], "logprobs": 2, "length_penalty": 0.0})
    choices = lp.json()["choices"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert sums == sorted(sums, reverse=True)
    assert all(len(c["logprobs"]["tokens"]) == len(c["token_ids"]) for c in choices)
    server.wait_engine_idle()
    server.call(assert_no_leaks)


def test_chat_is_hf_beams(server):
    client = server.openai()
    messages = [{"role": "user", "content": "Tell me about engines"}]
    out = client.chat.completions.create(
        model=server.model, messages=messages, n=2, max_tokens=NEW, extra_body={"use_beam_search": True}
    )
    prompt = server.llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    tok = server.llm.tokenizer
    beams = hf_beams(server.hf, prompt, 2, NEW, [1])[0]
    assert [c.message.content for c in out.choices] == [tok.decode(b, skip_special_tokens=True) for b in beams]
    assert out.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"seed": 3}, "seed"),
        ({"stop": ["x"]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"structured_outputs": {"regex": "[ab]+"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 11}, "n"),  # 2 x 11 log-probabilities a step > 20
    ],
)
def test_what_beam_search_cannot_honour_is_refused(server, extra, param):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "use_beam_search": True, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_beam_search_refusals_elsewhere(server):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "length_penalty": 2.0})
    assert r.status_code == 400 and "use_beam_search" in r.json()["error"]["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "use_beam_search": True, "n": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = post(server, "/v1/completions", {"prompt": [5] * 250, "max_tokens": 10, "use_beam_search": True, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # temperature 0 or 1 (clients that always send one) asks for nothing beam search ignores
    ok = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "use_beam_search": True, "temperature": 0})
    assert ok.status_code == 200, ok.text


def _finished_requests(server) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("kvflow:request_success_total"))


def test_a_client_leaving_mid_search_leaves_nothing(server):
    runner = server.engine.runner
    real_execute = runner.execute

    def slow_execute(*args):
        time.sleep(0.02)
        return real_execute(*args)

    # 200 steps of >= 20 ms: the whole search would take >= 4 s and 4 x 200 step requests
    body = {"prompt": "Once upon a time", "n": 4, "max_tokens": 200, "use_beam_search": True, "ignore_eos": True}

    async def leave(c: httpx.AsyncClient, stream: bool):
        with pytest.raises(httpx.ReadTimeout):
            async with c.stream("POST", server.url + "/v1/completions", json={**body, "stream": stream}) as r:
                async for _ in r.aiter_lines():
                    pass

    async def run():
        timeout = httpx.Timeout(0.5, connect=10)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            await asyncio.gather(leave(c, False), leave(c, True))

    before = _finished_requests(server)
    runner.execute = slow_execute
    try:
        asyncio.run(run())
        server.wait_engine_idle(timeout=10)
        time.sleep(0.3)  # (a search that went on would add its next step's requests meanwhile)
        server.wait_engine_idle(timeout=10)
    finally:
        runner.execute = real_execute
    steps = _finished_requests(server) - before
    assert 0 < steps < 2 * 4 * 100, steps  # both searches stopped well before their end
    server.call(assert_no_leaks)
    ok = post(server, "/v1/completions", {**body, "max_tokens": 3})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
