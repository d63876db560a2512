"""Requests' default sampling parameters from the model's generation_config.json (vLLM's
`--generation-config auto`) and `--override-generation-config`: a request that leaves a field out
gets the model's value, one that gives it keeps its own, on every endpoint and offline. The model
here recommends top_k 1, so a request that leaves top_k out decodes greedily (HF's greedy tokens),
and one that gives top_k 0 samples."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig

from conftest import hf_greedy
from server_utils import LiveServer, post_ok

pytestmark = pytest.mark.server

PROMPT = [5, 17, 33, 4, 90, 12]
NEW = 12


@pytest.fixture(scope="module")
def recommending_model(tiny_llama, tmp_path_factory):
    """The tiny Llama with a generation_config.json recommending top_k 1 and temperature 0.8 (and
    HF's own default top_p, which recommends nothing)."""
    path = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(tiny_llama[0], path)
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg.update(top_k=1, temperature=0.8, top_p=1.0, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(cfg))
    return str(path), tiny_llama[1]


@pytest.fixture(scope="module")
def server(recommending_model):
    s = LiveServer(EngineConfig(model=recommending_model[0], num_kv_blocks=128, max_model_len=128))
    s.greedy = hf_greedy(recommending_model[1], PROMPT, NEW)
    yield s
    s.stop()


def test_a_request_that_leaves_top_k_out_gets_the_models(server):
    assert server.engine.default_sampling == {"top_k": 1, "temperature": 0.8}
    base = {"prompt": PROMPT, "max_tokens": NEW, "ignore_eos": True, "return_token_ids": True}
    for seed in (None, 1, 2):
        out = post_ok(server, "/v1/completions", {**base, "seed": seed})["choices"][0]
        assert out["token_ids"] == server.greedy  # top_k 1: greedy, whatever the seed
        nulls = post_ok(server, "/v1/completions", {**base, "seed": seed, "top_k": None})["choices"][0]
        assert nulls["token_ids"] == server.greedy  # (null counts as left out)
    sampled = [
        post_ok(server, "/v1/completions", {**base, "seed": seed, "top_k": 0})["choices"][0]["token_ids"]
        for seed in (1, 2, 3)
    ]
    assert any(t != server.greedy for t in sampled)  # its own top_k: sampling over the vocabulary


def test_every_endpoint_takes_the_defaults(server):
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = {"messages": messages, "max_tokens": NEW, "ignore_eos": True}
    greedy = post_ok(server, "/v1/chat/completions", {**chat, "temperature": 0})["choices"][0]["message"]["content"]
    for seed in (1, 2):
        got = post_ok(server, "/v1/chat/completions", {**chat, "seed": seed})["choices"][0]["message"]["content"]
        assert got == greedy
    resp = post_ok(server, "/v1/responses", {"input": "Tell me a story", "max_output_tokens": NEW})
    resp_greedy = post_ok(
        server, "/v1/responses", {"input": "Tell me a story", "max_output_tokens": NEW, "temperature": 0}
    )
    assert resp["output"][-1]["content"][0]["text"] == resp_greedy["output"][-1]["content"][0]["text"]
    anth = {"model": server.model, "messages": messages, "max_tokens": NEW}
    a = post_ok(server, "/v1/messages", anth)["content"][0]["text"]
    b = post_ok(server, "/v1/messages", {**anth, "temperature": 0})["content"][0]["text"]
    assert a == b


def test_offline_defaults_and_the_vllm_source(recommending_model):
    path, hf = recommending_model
    greedy = hf_greedy(hf, PROMPT, 16)  # (SamplingParams' default max_tokens)
    with LLM(path, num_kv_blocks=64, max_model_len=128) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.top_k, defaults.temperature, defaults.top_p) == (1, 0.8, 1.0)
        out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids  # no params: the defaults
        assert out == greedy[: len(out)]
        own = llm.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True, seed=3), use_tqdm=False)
        assert own[0].outputs[0].token_ids != greedy  # given params are used as they are
    with LLM(path, num_kv_blocks=64, max_model_len=128, generation_config="vllm") as llm:
        assert llm.engine.default_sampling == {}
    override = {"top_k": 1, "temperature": 0.5}
    with LLM(path, num_kv_blocks=64, max_model_len=128, override_generation_config=override) as llm:
        assert llm.engine.default_sampling == {"top_k": 1, "temperature": 0.5}


def test_bad_generation_configs_are_clear_errors(recommending_model, tmp_path):
    path, _ = recommending_model
    for kwargs, fragment in (
        ({"override_generation_config": {"temprature": 0.5}}, "unknown key(s) ['temprature']; valid keys"),
        (
            {"override_generation_config": {"temperature": "hot"}},
            "override_generation_config: temperature must be a number",
        ),
        ({"override_generation_config": "{nope"}, "override_generation_config is not valid JSON"),
        ({"generation_config": str(tmp_path)}, "holds none"),
    ):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            EngineConfig(model=path, **kwargs)
    # values out of SamplingParams' ranges: refused when the engine starts, naming where they came from
    with pytest.raises(ValueError, match="override_generation_config: temperature"):
        LLM(path, num_kv_blocks=64, max_model_len=128, override_generation_config={"temperature": -1})
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        LLM(path, num_kv_blocks=64, max_model_len=128, generation_config=str(tmp_path))
