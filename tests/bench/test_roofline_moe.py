"""`kvflow roofline` on Mixture-of-Experts configs: total vs active parameters, the expected number of
distinct experts a batch touches, and the weight bytes a decode step reads."""

import argparse
import itertools
import json
from fractions import Fraction

import numpy as np
import pytest

from kvflow.bench import roofline as rf

# ----------------------------------------------------------------------------------------------
# Expected distinct experts per MoE layer: E x (1 - ((E - k) / E)^B)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts", [1, 2, 3, 4, 5])
def test_expected_experts_touched_matches_exact_enumeration(num_experts):
    """Every routing of B tokens (each a k-subset of E, all equally likely) enumerated: the mean
    distinct count, as an exact fraction, equals the formula."""
    for k in range(1, num_experts + 1):
        subsets = list(itertools.combinations(range(num_experts), k))
        for batch in range(4):
            total = Fraction(0)
            count = 0
            for routing in itertools.product(subsets, repeat=batch):
                total += len(set().union(*routing)) if routing else 0
                count += 1
            exact = total / count
            assert rf.expected_experts_touched(num_experts, k, batch) == pytest.approx(float(exact), abs=1e-12)


@pytest.mark.parametrize(("num_experts", "k", "batch"), [(8, 2, 1), (8, 2, 4), (64, 8, 16), (128, 8, 32), (60, 4, 7)])
def test_expected_experts_touched_matches_simulation(num_experts, k, batch):
    rng = np.random.default_rng(1234 + num_experts + k + batch)
    trials = 20_000
    # each token's top-k: the k smallest of E iid uniforms, a uniform k-subset of the experts
    picks = np.argpartition(rng.random((trials, batch, num_experts)), k - 1, axis=-1)[..., :k]
    touched = np.zeros((trials, num_experts), dtype=bool)
    np.put_along_axis(touched, picks.reshape(trials, batch * k), True, axis=1)
    distinct = touched.sum(axis=1)
    mean, sem = distinct.mean(), distinct.std() / np.sqrt(trials)
    expected = rf.expected_experts_touched(num_experts, k, batch)
    assert abs(mean - expected) <= max(5 * sem, 1e-9), (mean, expected, sem)


def test_expected_experts_touched_limits_and_errors():
    assert rf.expected_experts_touched(8, 2, 0) == 0
    assert rf.expected_experts_touched(8, 2, 1) == pytest.approx(2)
    assert rf.expected_experts_touched(8, 8, 3) == pytest.approx(8)
    assert rf.expected_experts_touched(128, 8, 10_000) == pytest.approx(128)
    for e, k in ((8, 9), (8, 0), (0, 0)):
        with pytest.raises(ValueError, match="top_k"):
            rf.expected_experts_touched(e, k, 4)


# ----------------------------------------------------------------------------------------------
# Parameter counts
# ----------------------------------------------------------------------------------------------

# (total, active) as published: model cards / papers
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "olmoe-1b-7b": (6.9e9, 1.3e9),
}

# by hand from the config shapes (biases and norms ignored, both embedding matrices counted):
#   attention per layer = hidden x heads x head_dim x 2 + hidden x kv_heads x head_dim x 2
#   one expert = 3 x hidden x expert_intermediate; router = hidden x E
HAND = {
    # 32 x (41,943,040 attn + 8 x 176,160,768 + 32,768 router) + 2 x 32000 x 4096
    "mixtral-8x7b": (
        32 * (41_943_040 + 8 * 176_160_768 + 32_768) + 262_144_000,
        32 * (41_943_040 + 2 * 176_160_768 + 32_768) + 262_144_000,
    ),
    # 48 x (18,874,368 attn + 128 x 4,718,592 + 262,144 router) + 2 x 151936 x 2048
    "qwen3-30b-a3b": (
        48 * (18_874_368 + 128 * 4_718_592 + 262_144) + 622_329_856,
        48 * (18_874_368 + 8 * 4_718_592 + 262_144) + 622_329_856,
    ),
    # 16 x (16,777,216 attn + 64 x 6,291,456 + 131,072 router) + 2 x 50304 x 2048
    "olmoe-1b-7b": (
        16 * (16_777_216 + 64 * 6_291_456 + 131_072) + 206_045_184,
        16 * (16_777_216 + 8 * 6_291_456 + 131_072) + 206_045_184,
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameters_match_published_figures(name):
    m = rf.MODEL_PRESETS[name]
    total, active = PUBLISHED[name]
    assert m.num_params == HAND[name][0] and m.active_params == HAND[name][1]
    assert m.num_params == pytest.approx(total, rel=0.01)
    # the published active figures carry two significant digits (3.3B is 3.35B, 1.3B is 1.28B)
    assert m.active_params == pytest.approx(active, rel=0.02)
    # the preset is its HF config.json read by the config path
    cfg_model = rf.model_from_hf_config(rf.MOE_PRESET_CONFIGS[name], name)
    assert cfg_model.num_params == m.num_params and cfg_model.moe == m.moe


def test_resolve_moe_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(rf.MOE_PRESET_CONFIGS["mixtral-8x7b"]))
    m = rf.resolve_model(str(tmp_path))
    assert m.moe is not None and (m.moe.num_experts, m.moe.top_k, m.moe.num_moe_layers) == (8, 2, 32)
    assert m.num_params == HAND["mixtral-8x7b"][0]


QWEN2_MOE_TINY = {
    "model_type": "qwen2_moe",
    "num_hidden_layers": 6,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [5],
    "vocab_size": 100,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def test_qwen2_moe_shared_expert_and_sparse_step_by_hand():
    m = rf.model_from_hf_config(QWEN2_MOE_TINY, "tiny")
    # MoE layers: (i + 1) % 2 == 0 -> 1, 3, 5; 5 is in mlp_only_layers -> layers 1 and 3
    # head_dim 64 / 4 = 16; attention per layer: 64x4x16x2 + 64x2x16x2 = 12,288; x 6 = 73,728
    # embeddings: 2 x 100 x 64 = 12,800
    # MoE layer: 8 experts x 3x64x32 (6,144) = 49,152; router 64x8 = 512; shared expert 3x64x128
    #   + its sigmoid gate 64 = 24,640; per layer 74,304; x 2 = 148,608
    # dense layers 0, 2, 4, 5: 3x64x256 = 49,152 each; x 4 = 196,608
    total = 73_728 + 12_800 + 148_608 + 196_608
    assert total == 431_744
    assert m.moe is not None
    assert (m.moe.num_moe_layers, m.moe.expert_params, m.moe.shared_expert_params) == (2, 6144, 24_640)
    assert m.num_params == total
    # active: each MoE layer computes 2 of its 8 experts
    assert m.active_params == total - 2 * 6 * 6144 == 358_016
    # fp32 bytes read at batch 1: everything but the 16 routed experts, plus 2 layers x 2 experts
    dense_bytes = (total - 2 * 8 * 6144) * 4
    assert m.dense_weight_bytes == dense_bytes == 1_333_760
    hw = rf.Hardware("x", 1e12, 1e9, 1e12)
    row = rf.decode_step(m, hw, batch=1, context=16, kv_dtype="fp32")
    assert row.experts_touched == pytest.approx(2)
    assert row.weight_bytes_read == pytest.approx(dense_bytes + 2 * 2 * 6144 * 4)
    kv = 16 * 2 * 6 * 2 * 16 * 4
    assert row.memory_floor_s == pytest.approx((dense_bytes + 2 * 2 * 6144 * 4 + kv) / 1e9)
    assert row.compute_floor_s == pytest.approx(2 * 358_016 / 1e12)


def test_qwen3_moe_without_shared_expert_and_all_moe_layers():
    cfg = {**QWEN2_MOE_TINY, "model_type": "qwen3_moe", "decoder_sparse_step": 1, "mlp_only_layers": []}
    del cfg["shared_expert_intermediate_size"]
    m = rf.model_from_hf_config(cfg, "tiny3")
    assert m.moe.num_moe_layers == 6 and m.moe.shared_expert_params == 0
    assert m.num_params == 73_728 + 12_800 + 6 * (49_152 + 512)


# ----------------------------------------------------------------------------------------------
# Bytes per decode step
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_bytes_per_step_batch_one_and_large(name):
    m, hw = rf.MODEL_PRESETS[name], rf.HARDWARE_PRESETS["h200"]
    e, k, layers = m.moe.num_experts, m.moe.top_k, m.moe.num_moe_layers
    expert_bytes = m.moe.expert_params * 2  # bf16
    dense_bytes = (m.num_params - layers * e * m.moe.expert_params) * 2
    r1 = rf.decode_step(m, hw, 1, 2048)
    assert r1.experts_touched == pytest.approx(k)
    assert r1.weight_bytes_read == pytest.approx(dense_bytes + layers * k * expert_bytes)
    assert r1.weight_bytes_read == pytest.approx(m.active_params * 2)  # batch 1 reads the active weights
    big = rf.decode_step(m, hw, 4096, 16)
    assert big.experts_touched == pytest.approx(e)
    assert big.weight_bytes_read == pytest.approx(m.weight_bytes)
    # memory fit counts every expert, whatever the routing
    assert r1.memory_needed_bytes == pytest.approx(m.weight_bytes + r1.kv_bytes)
    assert r1.compute_floor_s == pytest.approx(2 * m.active_params / hw.flops)
    reads = [r.weight_bytes_read for r in rf.roofline_table(m, hw, batches=[1, 2, 4, 8, 16, 32, 64])]
    assert reads == sorted(reads) and reads[0] < reads[-1] <= m.weight_bytes * (1 + 1e-12)


def test_given_experts_touched():
    m, hw = rf.MODEL_PRESETS["qwen3-30b-a3b"], rf.HARDWARE_PRESETS["h100"]
    rows = rf.roofline_table(m, hw, batches=[1, 8, 32], experts_touched=[8, 20, 40.5])
    assert [r.experts_touched for r in rows] == [8, 20, 40.5]
    per_expert = m.moe.expert_params * 2
    assert rows[2].weight_bytes_read == pytest.approx(m.dense_weight_bytes + 48 * 40.5 * per_expert)
    same = rf.roofline_table(m, hw, batches=[8, 32], experts_touched=30)
    assert [r.experts_touched for r in same] == [30, 30]
    with pytest.raises(ValueError, match="one per batch size"):
        rf.roofline_table(m, hw, batches=[1, 8, 32], experts_touched=[8, 20])
    with pytest.raises(ValueError, match="exactly 8"):
        rf.roofline_table(m, hw, batches=[1], experts_touched=[9])
    with pytest.raises(ValueError, match="between 8 and 128"):
        rf.roofline_table(m, hw, batches=[64], experts_touched=[129])
    with pytest.raises(ValueError, match="dense"):
        rf.roofline_table(rf.MODEL_PRESETS["llama3-8b"], hw, batches=[1], experts_touched=1)


def test_dense_figures_unchanged():
    m, hw = rf.MODEL_PRESETS["llama3-8b"], rf.HARDWARE_PRESETS["h100"]
    assert m.moe is None and m.active_params == m.num_params == 8.03e9
    row = rf.decode_step(m, hw, batch=8, context=2048, kv_dtype="bf16", price_per_hour=3.0)
    assert row.step_s == pytest.approx(5.4350697e-3, rel=1e-6)  # as tests/bench/test_bench.py
    assert row.weight_bytes_read == m.weight_bytes and row.experts_touched is None
    cfg = {k: v for k, v in rf.MOE_PRESET_CONFIGS["mixtral-8x7b"].items() if "expert" not in k}
    d = rf.model_from_hf_config(cfg)
    assert d.moe is None and d.num_params == rf.estimate_params(32, 4096, 32, 8, 128, 14336, 32000)
    assert rf.model_from_hf_config({**cfg, "num_experts": 0}).moe is None  # Qwen2-MoE's all-dense form


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "drop", "match"),
    [
        ({"num_experts_per_tok": 9}, (), "num_experts_per_tok = 9 exceeds num_experts = 8"),
        ({"num_experts_per_tok": 0}, (), "num_experts_per_tok must be an integer >= 1"),
        ({}, ("num_experts_per_tok",), "lacks num_experts_per_tok"),
        ({}, ("moe_intermediate_size",), "lacks moe_intermediate_size"),
        ({"num_experts": 2.5}, (), "num_experts must be an integer"),
        ({"decoder_sparse_step": 0}, (), "decoder_sparse_step must be an integer >= 1"),
        ({}, ("intermediate_size",), "dense MLP layers lacks intermediate_size"),
        ({"mlp_only_layers": 5}, (), "mlp_only_layers must be a list"),
    ],
)
def test_config_errors_name_the_key(change, drop, match):
    cfg = {k: v for k, v in {**QWEN2_MOE_TINY, **change}.items() if k not in drop}
    with pytest.raises(ValueError, match=match):
        rf.model_from_hf_config(cfg, "bad")


def test_mixtral_config_errors_name_the_key():
    cfg = dict(rf.MOE_PRESET_CONFIGS["mixtral-8x7b"])
    with pytest.raises(ValueError, match="num_experts_per_tok = 3 exceeds num_local_experts = 2"):
        rf.model_from_hf_config({**cfg, "num_local_experts": 2, "num_experts_per_tok": 3})
    del cfg["intermediate_size"]
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        rf.model_from_hf_config(cfg)


# ----------------------------------------------------------------------------------------------
# GGUF MoE: experts counted from the stored 3-D tensors, bytes as stored
# ----------------------------------------------------------------------------------------------


def test_moe_from_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "moe.gguf"
    e, k, hidden, ffn, layers = 4, 2, 32, 16, 2
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, v in (
        ("block_count", layers),
        ("embedding_length", hidden),
        ("feed_forward_length", 64),
        ("expert_feed_forward_length", ffn),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
        ("expert_count", e),
        ("expert_used_count", k),
    ):
        w.add_uint32(f"qwen3moe.{key}", v)
    w.add_tensor("token_embd.weight", np.zeros((10, hidden), dtype=np.float32))
    for b in range(layers):
        w.add_tensor(f"blk.{b}.attn_q.weight", np.zeros((hidden, hidden), dtype=np.float32))
        w.add_tensor(f"blk.{b}.ffn_gate_inp.weight", np.zeros((e, hidden), dtype=np.float32))
        for t in ("gate", "up"):
            w.add_tensor(f"blk.{b}.ffn_{t}_exps.weight", np.zeros((e, ffn, hidden), dtype=np.float16))
        w.add_tensor(f"blk.{b}.ffn_down_exps.weight", np.zeros((e, hidden, ffn), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = rf.resolve_model(str(path))
    assert m.moe is not None and (m.moe.num_experts, m.moe.top_k, m.moe.num_moe_layers) == (e, k, layers)
    assert m.moe.expert_params == 3 * hidden * ffn and m.moe.router_params == e * hidden
    assert m.expert_weight_bytes == 3 * hidden * ffn * 2  # fp16 experts as stored
    dense_params = 10 * hidden + layers * (hidden * hidden + e * hidden)
    assert m.num_params == dense_params + layers * e * 3 * hidden * ffn
    assert m.dense_weight_bytes == dense_params * 4
    assert m.step_weight_bytes(k) == dense_params * 4 + layers * k * 3 * hidden * ffn * 2
    with pytest.raises(ValueError):
        rf.decode_step(m, rf.HARDWARE_PRESETS["h100"], 1, 16, experts_touched=3)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def _cli(argv):
    from kvflow.cli import roofline as cli

    parser = argparse.ArgumentParser(prog="kvflow")
    sub = parser.add_subparsers(dest="cmd", required=True)
    cli.register(sub)
    return parser.parse_args(argv)


def test_roofline_cli_moe(capsys, tmp_path):
    out_json = tmp_path / "r.json"
    args = _cli(["roofline", "--model", "mixtral-8x7b", "--batches", "1,8,64", "--json", str(out_json)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "46.703 B total, 12.880 B active per token" in out
    assert "8 experts, top-2, 32 of 32 layers MoE" in out
    assert "experts/layer" in out and "expected, uniform routing" in out
    doc = json.loads(out_json.read_text())["results"]
    assert doc["active_params"] == HAND["mixtral-8x7b"][1]
    assert [r["experts_touched"] for r in doc["rows"]] == pytest.approx([2, 8 * (1 - 0.75**8), 8])
    args = _cli(["roofline", "--model", "olmoe-1b-7b", "--batches", "1,8", "--experts-touched", "8,30"])
    args.func(args)
    out = capsys.readouterr().out
    assert "(given)" in out and "30.000" in out
    args = _cli(["roofline", "--model", "llama3-8b", "--batches", "1"])
    args.func(args)
    assert "experts/layer" not in capsys.readouterr().out
    args = _cli(["roofline", "--model", "qwen3-30b-a3b", "--batches", "1", "--experts-touched", "7"])
    with pytest.raises(ValueError, match="exactly 8"):
        args.func(args)
