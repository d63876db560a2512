"""vLLM's score and rerank APIs (POST /score, /rerank and their /v1, /v2 paths) and `LLM.score`,
from the model's embeddings: each score is the cosine of HF's pooled final hidden states of the
two texts (recomputed here in float64), paired as vLLM pairs them; rerank orders documents by it
and cuts at top_n; bad input is a 400 naming the field; nothing is left in the engine."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM
from kvflow.config import EngineConfig

from conftest import assert_no_leaks, hf_embedding
from server_utils import LiveServer, post

pytestmark = pytest.mark.server

QUERY = "where is the capital of France"
DOCS = [
    "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.",
    "def hello(name): return name",
    "Berlin is the capital of Germany.",
]


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = LiveServer(EngineConfig(model=tiny_llama[0], num_kv_blocks=128, max_model_len=64, max_num_batched_tokens=16))
    s.tok = s.llm.tokenizer
    s.hf = tiny_llama[1]
    yield s
    s.stop()


def ref_score(server, a: str, b: str) -> float:
    ea, eb = (hf_embedding(server.hf, server.tok.encode(t), "last").double() for t in (a, b))
    return torch.nn.functional.cosine_similarity(ea, eb, dim=0).item()


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_one_against_many_and_pairwise(server, path):
    r = post(server, path, {"model": server.model, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "list" and data["model"] == server.model
    assert [d["index"] for d in data["data"]] == list(range(len(DOCS)))
    for d, doc in zip(data["data"], DOCS):
        assert d["object"] == "score"
        assert d["score"] == pytest.approx(ref_score(server, QUERY, doc), abs=1e-5)
    tokens = sum(len(server.tok.encode(t)) for t in [QUERY, *DOCS])
    assert data["usage"]["prompt_tokens"] == tokens == data["usage"]["total_tokens"]

    pairwise = post(server, path, {"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()["data"]
    assert [d["score"] for d in pairwise] == pytest.approx(
        [ref_score(server, DOCS[0], DOCS[2]), ref_score(server, DOCS[1], DOCS[3])], abs=1e-5
    )
    server.wait_engine_idle()
    server.call(assert_no_leaks)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_by_score(server, path):
    refs = [ref_score(server, QUERY, d) for d in DOCS]
    want = sorted(range(len(DOCS)), key=lambda i: -refs[i])
    r = post(server, path, {"model": server.model, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    data = r.json()
    assert [x["index"] for x in data["results"]] == want
    for x in data["results"]:
        assert x["relevance_score"] == pytest.approx(refs[x["index"]], abs=1e-5)
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert data["usage"]["total_tokens"] == sum(len(server.tok.encode(t)) for t in [QUERY, *DOCS])
    # top_n, Jina's {"text": ...} documents, return_documents false (Cohere's v2 default)
    body = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": False}
    top = post(server, path, body).json()["results"]
    assert [x["index"] for x in top] == want[:2] and all("document" not in x for x in top)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/score", {"text_1": [], "text_2": "x"}, "text_1"),
        ("/score", {"text_1": "a"}, "text_2"),
        ("/score", {"text_1": "a", "text_2": [1, 2]}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "word " * 80}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"documents": ["a"]}, "query"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": "word " * 80, "documents": ["b"]}, "query"),
        ("/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 500}, "truncate_prompt_tokens"),
    ],
)
def test_bad_input_is_a_clear_400(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_truncated_texts_are_scored(server):
    long = "word " * 80
    r = post(server, "/score", {"text_1": QUERY, "text_2": long, "truncate_prompt_tokens": 20})
    assert r.status_code == 200, r.text
    kept = server.tok.encode(long)[-20:]
    ref = torch.nn.functional.cosine_similarity(
        hf_embedding(server.hf, server.tok.encode(QUERY), "last").double(),
        hf_embedding(server.hf, kept, "last").double(),
        dim=0,
    ).item()
    assert r.json()["data"][0]["score"] == pytest.approx(ref, abs=1e-5)


def test_offline_score(tiny_llama):
    path, hf = tiny_llama
    with LLM(path, num_kv_blocks=64, max_model_len=64) as llm:
        outs = llm.score(QUERY, DOCS, use_tqdm=False)
        tok = llm.tokenizer
        for out, doc in zip(outs, DOCS, strict=True):
            ref = torch.nn.functional.cosine_similarity(
                hf_embedding(hf, tok.encode(QUERY), "last").double(),
                hf_embedding(hf, tok.encode(doc), "last").double(),
                dim=0,
            ).item()
            assert out.outputs.score == pytest.approx(ref, abs=1e-5)
            assert out.prompt_token_ids == tok.encode(QUERY) + tok.encode(doc)
        pairs = llm.score(DOCS[:2], DOCS[2:], use_tqdm=False)
        assert len(pairs) == 2
        with pytest.raises(ValueError, match="text_1 holds 2 texts and text_2 3"):
            llm.score(DOCS[:2], DOCS[:3], use_tqdm=False)
        assert_no_leaks(llm.engine)
