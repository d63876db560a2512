"""LoRA adapters over HTTP: the `model` field selects an adapter, /v1/models lists adapters with
their base as `parent`, /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key,
refused without KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=1) change them under traffic with no request
failing and no KV block leaking; a wrong-shape adapter is a 400 naming the module."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest
import torch
from lora_utils import base_model, make_adapters

from kvflow.config import EngineConfig, ServerConfig
from kvflow.entrypoints.openai.serving_lora import RUNTIME_UPDATING_ENV

from conftest import assert_no_leaks, hf_greedy
from server_utils import LiveServer, wait_for

pytestmark = pytest.mark.server
pytest.importorskip("peft")

KEY = {"Authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    return make_adapters(tiny_llama[0], tmp_path_factory.mktemp("adapters"))


@pytest.fixture
def server(tiny_llama, adapters, monkeypatch):
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "1")
    s = LiveServer(
        EngineConfig(
            model=tiny_llama[0],
            num_kv_blocks=64,
            max_model_len=128,
            kernel_autotune="off",
            enable_lora=True,
            lora_modules=[f"qv4={adapters['qv4']}"],
            max_loras=2,
        ),
        ServerConfig(api_key="sekret"),
    )
    yield s
    s.stop()


def merged(base_path: str, adapter: str):
    import peft

    return peft.PeftModel.from_pretrained(base_model(base_path), adapter).merge_and_unload().eval()


def _complete(server, model: str, prompt: list[int], max_tokens: int = 6) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return httpx.post(server.url + "/v1/completions", json=body, headers=KEY, timeout=60)


def test_models_and_selection(server, adapters, tiny_llama):
    models = httpx.get(server.url + "/v1/models", headers=KEY).json()["data"]
    by_id = {m["id"]: m for m in models}
    assert by_id["qv4"]["parent"] == server.model and by_id["qv4"]["root"] == adapters["qv4"]
    assert by_id[server.model]["parent"] is None
    assert httpx.get(server.url + "/v1/models/qv4", headers=KEY).json()["parent"] == server.model
    prompt = [5, 9, 23, 41, 7]
    base, lora = _complete(server, server.model, prompt), _complete(server, "qv4", prompt)
    assert base.status_code == 200 and lora.status_code == 200, (base.text, lora.text)
    assert lora.json()["model"] == "qv4"
    # The adapter's answer is peft's merged model's (as tests/lora checks offline, token by token).
    expected = hf_greedy(merged(tiny_llama[0], adapters["qv4"]), prompt, 6)
    assert lora.json()["choices"][0]["text"] == server.llm.tokenizer.decode(expected)
    assert lora.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    missing = _complete(server, "nope", prompt)
    assert missing.status_code == 404 and "qv4" in missing.json()["error"]["message"]


def test_runtime_loading_is_guarded(server, adapters, monkeypatch):
    body = {"lora_name": "x", "lora_path": adapters["all8"]}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body).status_code == 401
    monkeypatch.delenv(RUNTIME_UPDATING_ENV)
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=KEY)
    assert r.status_code == 403 and RUNTIME_UPDATING_ENV in r.json()["error"]["message"]


def test_wrong_shape_adapter_is_a_400_naming_the_module(server, adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    src, dst = adapters["qv4"], tmp_path / "bad"
    dst.mkdir()
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    key = next(k for k in tensors if "layers.0.self_attn.v_proj.lora_B" in k)
    tensors[key] = torch.zeros(7, tensors[key].shape[1])
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    with open(os.path.join(src, "adapter_config.json")) as f:
        (dst / "adapter_config.json").write_text(json.dumps(json.load(f)))
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(dst)}, headers=KEY)
    assert r.status_code == 400, r.text
    assert "layers.0.self_attn.v_proj" in r.json()["error"]["message"]
    assert "bad" not in {m["id"] for m in httpx.get(server.url + "/v1/models", headers=KEY).json()["data"]}


def test_load_unload_reload_under_traffic(server, adapters):
    failures: list[str] = []
    done = threading.Event()
    counts = {"ok": 0}
    prompt = [3, 14, 15, 92, 65, 35]

    def traffic(model: str) -> None:
        while not done.is_set():
            r = _complete(server, model, prompt, max_tokens=8)
            if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 8:
                failures.append(f"{model}: {r.status_code} {r.text[:200]}")
            counts["ok"] += 1

    threads = [threading.Thread(target=traffic, args=(m,)) for m in (server.model, "qv4", server.model, "qv4")]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            for name in ("all8", "mlp16"):
                r = httpx.post(
                    server.url + "/v1/load_lora_adapter",
                    json={"lora_name": name, "lora_path": adapters[name]},
                    headers=KEY,
                    timeout=60,
                )
                assert r.status_code == 200, r.text
                # A request under the new adapter, in flight while it is unloaded: it still finishes.
                inflight: list[httpx.Response] = []
                t = threading.Thread(target=lambda n=name, out=inflight: out.append(_complete(server, n, prompt, 12)))
                t.start()
                r = httpx.post(
                    server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=KEY, timeout=60
                )
                assert r.status_code == 200, r.text
                t.join(60)
                # (sent before the unload: 200; after it: 404, the name is gone -- never a failure mid-way)
                assert inflight[0].status_code in (200, 404), inflight[0].text
                if inflight[0].status_code == 200:
                    assert inflight[0].json()["usage"]["completion_tokens"] == 12
        r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "all8"}, headers=KEY)
        assert r.status_code == 404
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:3]
    assert counts["ok"] >= 4
    wait_for(lambda: not server.call(lambda e: e.has_unfinished_requests()), 30, "requests did not finish")
    server.call(assert_no_leaks)
    # Loads: qv4 at start, all8 and mlp16 three times each (in-flight requests may read one again).
    wait_for(lambda: server.metrics().get("kvflow:lora_adapter_loads_total", 0) >= 7, 10, "loads not counted")
    info = [k for k in server.metrics() if k.startswith("kvflow:lora_requests_info")]
    assert info == ['kvflow:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}']


def test_lora_requests_info_while_running(server):
    """The gauge's labels name the adapters of the running requests while they run."""
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(k for k in server.metrics() if 'running_lora_adapters="qv4"' in k)

    w = threading.Thread(target=watch)
    w.start()
    try:
        assert _complete(server, "qv4", [7, 8, 9], max_tokens=60).status_code == 200
    finally:
        stop.set()
        w.join(10)
    assert seen
