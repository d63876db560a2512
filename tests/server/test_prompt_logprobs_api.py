"""Prompt logprobs on the wire: vLLM's `prompt_logprobs` (completions: on each choice; chat: at the
top) and OpenAI's legacy `echo` with `logprobs` (the prompt's tokens lead the logprobs), checked
against a full forward pass of HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from kvflow.config import EngineConfig

from server_utils import LiveServer, post

pytestmark = pytest.mark.server

PROMPT = [5, 17, 300, 41, 9, 77, 123, 64, 3, 250, 11]


@pytest.fixture(scope="module")
def served(model_factory):
    path, hf = model_factory("llama", max_position_embeddings=2048)
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=256))
    yield s, hf
    s.stop()


def _reference(hf, ids: list[int]) -> list[float]:
    """HF's logprob of each prompt token after the first (float64)."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
    return [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]


def test_completion_prompt_logprobs(served):
    server, hf = served
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    lps = choice["prompt_logprobs"]
    assert len(lps) == len(PROMPT) and lps[0] is None
    for p, ref in enumerate(_reference(hf, PROMPT), start=1):
        entry = lps[p][str(PROMPT[p])]
        assert entry["logprob"] == pytest.approx(ref, abs=2e-4)
        assert {e["rank"] for e in lps[p].values()} >= {1, 2}
    # not asked: not there; with stream: refused as vLLM refuses it
    plain = post(server, "/v1/completions", {**body, "prompt_logprobs": None}).json()["choices"][0]
    assert "prompt_logprobs" not in plain and plain["text"] == choice["text"]
    r = post(server, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 400 and "prompt_logprobs is not available when stream is true" in r.text


def test_echo_with_logprobs_streamed_and_not(served):
    server, hf = served
    client = server.openai(timeout=60)
    args = dict(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    full = client.completions.create(**args).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(PROMPT) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(PROMPT)] == pytest.approx(_reference(hf, PROMPT), abs=2e-4)
    assert lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(**{**args, "echo": False}).choices[0]
    assert lp.token_logprobs[len(PROMPT) :] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert full.text.endswith(plain.text)
    # streamed: the chunks' logprobs, concatenated, are the non-streamed ones
    tokens, logprobs = [], []
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
    assert tokens == lp.tokens
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_chat_prompt_logprobs(served):
    server, hf = served
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 2,
        "temperature": 0,
        "prompt_logprobs": 0,
    }
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    ids = post(server, "/tokenize", {"model": server.model, "messages": body["messages"]}).json()["tokens"]
    lps = out["prompt_logprobs"]
    assert len(lps) == len(ids) == out["usage"]["prompt_tokens"] and lps[0] is None
    got = [lps[p][str(ids[p])]["logprob"] for p in range(1, len(ids))]
    assert got == pytest.approx(_reference(hf, ids), abs=2e-4)
