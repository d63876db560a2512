"""Expert telemetry of Mixture-of-Experts models, against HF transformers' own routers on the same
tiny weights and prompts (their top-k, captured by hooks on HF's router modules over each whole
sequence):

* the tokens counted per layer and expert equal a brute-force recount of HF's routing of every
  token the engine computed (greedy, no prefix caching);
* the load-imbalance figures (busiest expert, max / mean per step) equal a hand computation on
  one-step requests, and the exported gauges take the mean over the steps since the last export;
* an expert trace holds HF's top-k per token and MoE layer, and the reuse distances recomputed
  here from the trace itself and from HF's routing, under batching, chunked prefill, prefix hits
  and n-gram speculation; refused (400) beyond its size cap or without experts;
* nothing is recorded with the metrics off; /metrics shows the series during a server run.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.moe import MoeRoutingStats
from kvflow.metrics import EngineMetrics
from kvflow.sampling_params import MAX_EXPERT_TRACE_ENTRIES

from conftest import assert_no_leaks, hf_greedy

# Qwen2-MoE with a dense layer between its routed ones: MoE layers 0 and 2 (decoder layer indices
# are what the series and traces name).
QWEN2 = ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]})
PROMPTS = [[5, 9, 33, 2, 71, 100, 12, 8, 40, 41, 42], [300, 7, 7, 19], [44, 45, 46, 47, 48, 49, 50, 51, 52]]
ENGINE = dict(max_model_len=96, num_kv_blocks=64, block_size=4, kernel_autotune="off")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _hf_routing(hf, ids: list[int]) -> list[torch.Tensor]:
    """HF's chosen experts [tokens, k] of every routed layer, for the whole sequence `ids`."""
    routers = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert len(chosen) == len(routers)
    return chosen


def _distances(experts: list[list[list[int]]]) -> list[list[list[int | None]]]:
    """Brute force: for each token, layer and chosen expert, the tokens back to the last earlier
    token that chose it in that layer."""
    out = []
    for t, per_layer in enumerate(experts):
        row = []
        for layer, chosen in enumerate(per_layer):
            back = [next((t - u for u in range(t - 1, -1, -1) if e in experts[u][layer]), None) for e in chosen]
            row.append(back)
        out.append(row)
    return out


def test_counts_equal_hf_routing(model_factory):
    """Per layer and expert, the tokens counted equal HF's routing of every computed token (each
    prompt token once, each output token but the last once), summed over the prompts."""
    path, hf = model_factory(*QWEN2[:1], **QWEN2[1])
    llm = LLM(path, moe_expert_metrics="per_expert", enable_prefix_caching=False, **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    moe = stats.moe
    assert moe.layers == [0, 2] and moe.num_experts == 4 and moe.top_k == 2
    assert moe.num_steps == stats.num_steps
    expected = torch.zeros(2, 4, dtype=torch.int64)
    for p, o in zip(PROMPTS, outs):
        tokens = o.outputs[0].token_ids
        assert tokens == hf_greedy(hf, p, GREEDY.max_tokens)
        for slot, chosen in enumerate(_hf_routing(hf, p + tokens[:-1])):
            expected[slot] += torch.bincount(chosen.reshape(-1), minlength=4)
    assert moe.expert_tokens == expected.tolist()
    assert moe.tokens == expected.sum(1).tolist()
    computed = sum(len(p) + GREEDY.max_tokens - 1 for p in PROMPTS)
    assert moe.tokens == [computed * 2] * 2


def test_imbalance_by_hand(model_factory):
    """One-step requests (the prompt in one chunk, one output token): the busiest expert's tokens
    and max / mean tokens per expert are HF's counts' for that prompt; the exported gauges take
    the mean over the steps since the previous export, and their max over layers."""
    path, hf = model_factory(*QWEN2[:1], **QWEN2[1])
    llm = LLM(path, enable_prefix_caching=False, **ENGINE)  # per_layer, the default
    metrics = EngineMetrics()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    by_hand = []
    for p in PROMPTS[:2]:
        before = llm.get_stats().moe
        llm.generate([p], one, use_tqdm=False)
        moe = llm.get_stats().moe
        assert moe.expert_tokens is None and moe.num_steps == before.num_steps + 1
        counts = [torch.bincount(c.reshape(-1), minlength=4) for c in _hf_routing(hf, p)]
        imbalance = [c.max().item() / (len(p) * 2 / 4) for c in counts]  # max / (tokens x top-k / experts)
        for slot, c in enumerate(counts):
            assert moe.busiest[slot] - before.busiest[slot] == c.max().item()
            assert moe.imbalance_sum[slot] - before.imbalance_sum[slot] == pytest.approx(imbalance[slot], rel=1e-12)
        metrics.record_moe(moe)
        for slot, layer in enumerate(moe.layers):
            gauge = metrics.registry.get_sample_value("kvflow:moe_load_imbalance", {"layer": str(layer)})
            assert gauge == pytest.approx(imbalance[slot], rel=1e-12)
        assert metrics.registry.get_sample_value("kvflow:moe_load_imbalance_max") == pytest.approx(max(imbalance))
        by_hand.append(imbalance)
    # Both steps exported at once: the gauge is their mean.
    fresh = EngineMetrics()
    fresh.record_moe(llm.get_stats().moe)
    for slot, layer in enumerate([0, 2]):
        gauge = fresh.registry.get_sample_value("kvflow:moe_load_imbalance", {"layer": str(layer)})
        assert gauge == pytest.approx((by_hand[0][slot] + by_hand[1][slot]) / 2, rel=1e-12)
        tokens = fresh.registry.get_sample_value("kvflow:moe_layer_tokens_total", {"layer": str(layer)})
        assert tokens == sum(len(p) * 2 for p in PROMPTS[:2])


def test_exporter_advances_by_deltas():
    """record_moe on hand-made cumulative stats: counters advance by what is new, the gauges are
    (sum now - sum before) / (steps now - steps before), the per-expert series exist only when
    counted per expert."""
    m = EngineMetrics()

    def stats(steps, imb, experts=None):
        tokens = [sum(r) for r in experts] if experts else [10 * steps, 10 * steps]
        return MoeRoutingStats([1, 3], 4, 2, steps, tokens, [3 * steps, 4 * steps], imb, experts)

    m.record_moe(stats(2, [3.0, 5.0]))
    m.record_moe(stats(5, [3.0 + 3 * 1.5, 5.0 + 3 * 2.5], [[14, 13, 12, 11], [0, 0, 0, 70]]))

    def value(name, **labels):
        return m.registry.get_sample_value(name, labels)

    assert value("kvflow:moe_load_imbalance", layer="1") == pytest.approx(1.5)
    assert value("kvflow:moe_load_imbalance", layer="3") == pytest.approx(2.5)
    assert value("kvflow:moe_load_imbalance_max") == pytest.approx(2.5)
    assert value("kvflow:moe_layer_tokens_total", layer="1") == 50  # (20 after the first call)
    assert value("kvflow:moe_layer_tokens_total", layer="3") == 70
    assert value("kvflow:moe_busiest_expert_tokens_total", layer="3") == 20
    assert value("kvflow:moe_expert_tokens_total", layer="3", expert="3") == 70
    assert value("kvflow:moe_expert_tokens_total", layer="3", expert="0") is None  # never routed: no series
    assert value("kvflow:moe_expert_tokens_total", layer="1", expert="0") == 14


def _check_trace(hf, prompt: list[int], tokens: list[int], trace, layers: list[int]) -> None:
    assert trace.layers == layers
    seq = prompt + tokens
    assert len(trace.experts) == len(seq) - 1 - trace.start  # every computed token; never the last
    hf_experts = [c.tolist() for c in _hf_routing(hf, seq[:-1])]  # [layer][token][k]
    hf_per_token = [[hf_experts[layer][t] for layer in range(len(layers))] for t in range(len(seq) - 1)]
    assert trace.experts == hf_per_token[trace.start :]
    assert trace.distances == _distances(trace.experts) == _distances(hf_per_token[trace.start :])


def test_expert_trace_is_hf_routing(model_factory):
    """Three prompts in one batch, chunked prefill (8-token steps), only two asking for a trace;
    then a prompt sharing the first one's first 8 tokens (two cached blocks): its trace starts at
    position 8. Every trace: HF's top-k per token and MoE layer, best first, and the distances
    recomputed from it."""
    path, hf = model_factory(*QWEN2[:1], **QWEN2[1])
    llm = LLM(path, max_num_batched_tokens=8, **ENGINE)
    traced = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, return_expert_trace=True)
    outs = llm.generate(PROMPTS, [traced, GREEDY, traced], use_tqdm=False)
    assert outs[1].outputs[0].expert_trace is None
    for i in (0, 2):
        c = outs[i].outputs[0]
        assert c.expert_trace.start == 0
        _check_trace(hf, PROMPTS[i], c.token_ids, c.expert_trace, [0, 2])
    shared = PROMPTS[0][:8] + [77, 78, 79]
    again = llm.generate([shared], traced, use_tqdm=False)[0]
    assert again.num_cached_tokens == 8 and again.outputs[0].expert_trace.start == 8
    _check_trace(hf, shared, again.outputs[0].token_ids, again.outputs[0].expert_trace, [0, 2])
    assert_no_leaks(llm.engine)


def test_expert_trace_under_speculation(model_factory):
    """n-gram drafts verified by the MoE target: rows of rejected drafts are routed too, but the
    trace keeps only each position's final token's routing."""
    path, hf = model_factory("qwen3_moe")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}  # (drafts not timed away)
    llm = LLM(path, speculative_config=spec, moe_expert_metrics="off", **ENGINE)
    prompt = [141, 141, 30, 147, 147, 31, 147, 147, 32, 147]  # (drafts from it: accepted, and one rejected)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, return_expert_trace=True)
    c = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == hf_greedy(hf, prompt, 24)
    spec = llm.get_stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    _check_trace(hf, prompt, c.token_ids, c.expert_trace, [0, 1])


def test_metrics_off_records_nothing(model_factory):
    """moe_expert_metrics="off": no recorder in the layers (no per-step work), no stats; a traced
    request attaches one for its steps only."""
    path, _ = model_factory(*QWEN2[:1], **QWEN2[1])
    llm = LLM(path, moe_expert_metrics="off", **ENGINE)
    model = llm.engine.runner.model
    assert all(b.recorder is None for b in model.moe_blocks)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.get_stats().moe is None
    traced = SamplingParams(temperature=0.0, max_tokens=4, return_expert_trace=True)
    assert llm.generate([PROMPTS[0]], traced, use_tqdm=False)[0].outputs[0].expert_trace is not None
    assert all(b.recorder is None for b in model.moe_blocks)


def test_expert_trace_refusals(model_factory, monkeypatch):
    """Beyond the cap on (prompt + max_tokens) x MoE layers (lowered here to 40: 11 + 9 tokens x 2
    layers fit, one more does not), and on a model without experts: refused when added."""
    import kvflow.engine.llm_engine as llm_engine

    assert MAX_EXPERT_TRACE_ENTRIES == llm_engine.MAX_EXPERT_TRACE_ENTRIES == 131072
    monkeypatch.setattr(llm_engine, "MAX_EXPERT_TRACE_ENTRIES", 40)
    path, _ = model_factory(*QWEN2[:1], **QWEN2[1])
    llm = LLM(path, **ENGINE)
    fits = SamplingParams(max_tokens=9, return_expert_trace=True)
    assert len(llm.generate([PROMPTS[0]], fits, use_tqdm=False)[0].outputs[0].expert_trace.experts) == 11 + 9 - 1
    too_many = SamplingParams(max_tokens=10, return_expert_trace=True)
    with pytest.raises(ValueError, match=r"21 tokens x 2 MoE layers = 42 trace entries exceeds the limit of 40"):
        llm.generate([PROMPTS[0]], too_many, use_tqdm=False)
    dense, _ = model_factory("llama")
    with pytest.raises(ValueError, match="return_expert_trace needs a Mixture-of-Experts model"):
        LLM(dense, **ENGINE).generate([PROMPTS[0]], SamplingParams(return_expert_trace=True), use_tqdm=False)


@pytest.mark.server
def test_server_metrics_and_trace(model_factory, monkeypatch):
    """A server run: /metrics shows the per-layer series (and no per-expert ones by default);
    completions and chat return the trace on the finished choice; too large a trace is a 400."""
    from kvflow.config import EngineConfig

    from server_utils import LiveServer

    path, _ = model_factory(*QWEN2[:1], **QWEN2[1])
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=64, max_model_len=96, kernel_autotune="off"))
    try:
        body = {"model": s.model, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json={**body, "return_expert_trace": True}, timeout=30)
        assert r.status_code == 200, r.text
        trace = r.json()["choices"][0]["expert_trace"]
        assert trace["layers"] == [0, 2] and trace["start"] == 0
        assert len(trace["experts"]) == len(PROMPTS[0]) + 6 - 1 and len(trace["experts"][0]) == 2
        assert trace["distances"] == _distances(trace["experts"])
        plain = httpx.post(s.url + "/v1/completions", json=body, timeout=30).json()
        assert "expert_trace" not in plain["choices"][0]
        chat = {"model": s.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = httpx.post(s.url + "/v1/chat/completions", json={**chat, "return_expert_trace": True}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["expert_trace"]["layers"] == [0, 2]
        r = httpx.post(s.url + "/v1/completions", json={**body, "return_expert_trace": 1}, timeout=30)
        assert r.status_code == 400  # (strict types: a boolean)
        import kvflow.engine.llm_engine as llm_engine

        monkeypatch.setattr(llm_engine, "MAX_EXPERT_TRACE_ENTRIES", 20)  # (11 + 6) x 2 > 20
        r = httpx.post(s.url + "/v1/completions", json={**body, "return_expert_trace": True}, timeout=30)
        assert r.status_code == 400 and "exceeds the limit of 20" in r.json()["error"]["message"], r.text
        metrics = s.metrics()
        for layer in ("0", "2"):
            assert metrics[f'kvflow:moe_layer_tokens_total{{layer="{layer}"}}'] > 0
            assert metrics[f'kvflow:moe_busiest_expert_tokens_total{{layer="{layer}"}}'] > 0
            assert metrics[f'kvflow:moe_load_imbalance{{layer="{layer}"}}'] >= 1
        assert metrics["kvflow:moe_load_imbalance_max"] >= 1
        assert not any(k.startswith("kvflow:moe_expert_tokens_total") for k in metrics)
        assert 'kvflow:moe_layer_tokens_total{layer="1"}' not in metrics  # a dense layer
    finally:
        s.stop()
