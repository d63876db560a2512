"""POST /v1/embeddings through the real `openai` SDK (float and base64) and raw HTTP: the
vectors equal HF's pooled final hidden states (and LLM.embed's), usage counts the prompt tokens,
bad input is a 400 naming the field, and no KV block is left behind."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from kvflow.config import EngineConfig
from kvflow.entrypoints.openai.protocol import MAX_PROMPTS

from conftest import assert_no_leaks, hf_embedding
from server_utils import LiveServer

pytestmark = pytest.mark.server

TEXTS = ["hello world, embed me", "a second, somewhat longer input to embed here"]


@pytest.fixture(scope="module", params=["last", "mean"])
def server(request, tiny_llama):
    path, _ = tiny_llama
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=128, max_num_batched_tokens=16, pooling=request.param))
    s.pooling = request.param
    yield s
    s.stop()


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)


def test_sdk_float_and_base64_match_hf(server, tiny_llama):
    _, hf = tiny_llama
    client = server.openai(timeout=60)
    tok = server.engine.tokenizer
    ids = [tok(t)["input_ids"] for t in TEXTS]
    refs = [hf_embedding(hf, i, server.pooling).numpy() for i in ids]
    for fmt in ("float", "base64"):
        res = client.embeddings.create(model=server.model, input=TEXTS, encoding_format=fmt)
        assert [d.index for d in res.data] == [0, 1]
        for d, ref in zip(res.data, refs):
            # an explicit base64 comes back as the string (the SDK decodes only its own default)
            got = np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
            assert np.allclose(np.asarray(got, dtype=np.float32), ref, atol=1e-5)
        assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    # the SDK's default (it asks for base64 and decodes it), a single string, token ids, dimensions
    one = client.embeddings.create(model=server.model, input=TEXTS[0], dimensions=hf.config.hidden_size, user="u")
    assert np.allclose(one.data[0].embedding, refs[0], atol=1e-5)
    by_ids = client.embeddings.create(model=server.model, input=ids[1])
    assert np.allclose(by_ids.data[0].embedding, refs[1], atol=1e-5)
    both = client.embeddings.create(model=server.model, input=ids)
    assert all(np.allclose(d.embedding, r, atol=1e-5) for d, r in zip(both.data, refs))
    server.wait_engine_idle()
    server.call(assert_no_leaks)


def test_raw_shape_and_base64(server):
    r = post(server, {"input": ["abc", "defg"], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == server.model
    floats = post(server, {"input": ["abc", "defg"]}).json()
    for b, f in zip(body["data"], floats["data"]):
        assert b["object"] == "embedding"
        assert np.array_equal(np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4"), np.float32(f["embedding"]))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, 10**6]}, "input"),
        ({"input": ["x"] * (MAX_PROMPTS + 1)}, "input"),
        ({"input": 5}, "input"),
        ({"input": "x", "dimensions": 7}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_model_is_a_404(server):
    r = post(server, {"input": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
