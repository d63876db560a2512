"""Gemma 2 and Gemma 3 (text) from GGUF files written as llama.cpp's convert_hf_to_gguf writes the
architectures `gemma2` and `gemma3` (norm weights stored as 1 + w, no lm_head: tied embeddings,
Q/K rows as HF holds them), against HF transformers on the same tiny random weights: the config
read from the metadata, greedy tokens (F32) through chunked prefill and prompts longer than the
window, Q8_0 blocks run natively against the same file dequantized; and the refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_gemmas

from kvflow import LLM, SamplingParams
from kvflow.models.gguf_loader import load_gguf

from conftest import VOCAB_SIZE, assert_no_leaks, hf_greedy
from gguf_files import add_folder_tokenizer

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
WINDOW = 8  # shorter than the prompts
HEAD_DIM = 16

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
    initializer_range=0.1,
    sliding_window=WINDOW,
    # No GGUF key holds it: llama.cpp takes head_dim (but for the 27B models), so a file can only
    # describe a model whose scalar is head_dim.
    query_pre_attn_scalar=HEAD_DIM,
)
VARIANTS = {
    "gemma2": dict(num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    "gemma3": dict(
        num_hidden_layers=7,  # five local, one global, one local
        final_logit_softcapping=5.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ),
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return tiny_gemmas(tmp_path_factory, lambda family: {**_COMMON, **VARIANTS[family]}, seed=4321)


def write_gemma_gguf(path, hf_dir, family: str, qtype=None, **overrides) -> None:
    """The tiny HF Gemma in `hf_dir` as llama.cpp's converter writes it (Gemma2Model / Gemma3Model
    in convert_hf_to_gguf.py): key/value lengths, soft-caps, sliding window, Gemma 3's global rope
    base (and its linear scaling); every `*norm.weight` stored + 1; lm_head skipped. 2-D weights in
    `qtype` (None: F32), the embedding in F32. `overrides`: metadata keys (without the
    architecture prefix) written instead, None to leave one out."""
    import gguf
    from safetensors.numpy import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = {k: v.astype("float32") for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), family)
    w.add_name(f"Tiny {family}")
    keys = {
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "block_count": cfg["num_hidden_layers"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        "attention.key_length": cfg["head_dim"],
        "attention.value_length": cfg["head_dim"],
        "attention.sliding_window": cfg["sliding_window"],
        "final_logit_softcapping": cfg["final_logit_softcapping"],
    }
    if family == "gemma2":
        keys["attn_logit_softcapping"] = cfg["attn_logit_softcapping"]
    else:
        full = cfg["rope_parameters"]["full_attention"]
        keys["rope.freq_base"] = float(full["rope_theta"])
        if full["rope_type"] == "linear":
            keys["rope.scaling.type"] = "linear"
            keys["rope.scaling.factor"] = float(full["factor"])
    keys.update(overrides)
    for name, value in keys.items():
        if value is None:
            continue
        if isinstance(value, str):
            w.add_string(f"{family}.{name}", value)
        elif isinstance(value, float):
            w.add_float32(f"{family}.{name}", value)
        else:
            w.add_uint32(f"{family}.{name}", int(value))
    add_folder_tokenizer(w, hf_dir, cfg)

    def put(name: str, hf_name: str) -> None:
        data = t[hf_name]
        if hf_name.endswith("norm.weight"):
            data = data + 1  # (the converter's `data_torch + 1`: llama.cpp's norm is x * w)
        if qtype is None or data.ndim != 2:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    if family == "gemma3":
        names.update({"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"})
    for i in range(cfg["num_hidden_layers"]):
        for gguf_name, hf_name in names.items():
            put(f"blk.{i}.{gguf_name}.weight", f"model.layers.{i}.{hf_name}.weight")
    put("output_norm.weight", "model.norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(n)] for n in (11, 19, 26)]


@pytest.mark.parametrize("family", list(VARIANTS))
def test_gguf_config_and_norms(gemma, family, tmp_path):
    """The metadata gives HF's config (windows per layer, scale, caps, both ropes) and the norm
    weights come back as HF holds them (the converter's + 1 taken off)."""
    path, hf = gemma(family)
    gguf_path = tmp_path / f"{family}.gguf"
    write_gemma_gguf(gguf_path, path, family)
    ckpt = load_gguf(gguf_path, with_tokenizer=False)
    from kvflow.config import ModelConfig

    cfg = ModelConfig.from_hf_config(ckpt.hf_config)
    assert cfg.architecture == type(hf).__name__
    assert list(cfg.layer_windows) == [layer.self_attn.sliding_window for layer in hf.model.layers]
    assert cfg.gemma.query_pre_attn_scalar**-0.5 == hf.model.layers[0].self_attn.scaling
    assert cfg.gemma.final_logit_softcapping == hf.config.final_logit_softcapping
    assert ckpt.hf_config["tie_word_embeddings"] and "lm_head.weight" not in ckpt.tensors
    if family == "gemma2":
        assert cfg.gemma.attn_logit_softcapping == hf.config.attn_logit_softcapping and not cfg.qk_norm
        assert cfg.rope.theta == hf.config.rope_parameters["rope_theta"] and cfg.rope_local is None
    else:
        assert cfg.gemma.attn_logit_softcapping is None and cfg.qk_norm
        assert (cfg.rope.theta, cfg.rope.scaling_type, cfg.rope.factor) == (1_000_000.0, "linear", 4.0)
        assert cfg.rope_local.theta == 10_000.0 and cfg.rope_local.scaling_type == "default"
    state = hf.state_dict()
    norms = [k for k in state if k.endswith("norm.weight")]
    assert norms and set(norms) <= set(ckpt.tensors)
    for k in norms:
        torch.testing.assert_close(ckpt.tensors[k], state[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", list(VARIANTS))
def test_gguf_greedy_matches_hf(gemma, family, tmp_path):
    """A `gemma2` / `gemma3` GGUF (F32) loads as the HF model: HF's greedy tokens, through chunked
    prefill, prompts longer than the window."""
    path, hf = gemma(family)
    gguf_path = tmp_path / f"{family}.gguf"
    write_gemma_gguf(gguf_path, path, family)
    # (Every layer keeps its blocks, as in test_gemma.py: the hybrid KV layout has its own tests.)
    llm = LLM(
        str(gguf_path),
        num_kv_blocks=64,
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=8,
        disable_hybrid_kv_cache_manager=True,
    )
    assert llm.engine.model_config.architecture == type(hf).__name__
    prompts = _prompts(seed=3)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)


def test_gguf_q8_0_blocks_match_dequantized(gemma, tmp_path):
    """Q8_0 projections run in their blocks give the tokens of the same file dequantized to float."""
    import gguf

    path, _ = gemma("gemma3")
    gguf_path = tmp_path / "gemma3-q8.gguf"
    write_gemma_gguf(gguf_path, path, "gemma3", qtype=gguf.GGMLQuantizationType.Q8_0)
    prompts = _prompts(seed=4)[:2]
    outs = {}
    for weights in ("native", "dequantize"):
        llm = LLM(
            str(gguf_path),
            num_kv_blocks=64,
            max_model_len=64,
            block_size=4,
            gguf_weights=weights,
            disable_hybrid_kv_cache_manager=True,
        )
        outs[weights] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert outs["native"] == outs["dequantize"]


def test_gguf_refusals(gemma, tmp_path):
    path, _ = gemma("gemma3")
    bad = tmp_path / "no-window.gguf"
    write_gemma_gguf(bad, path, "gemma3", **{"attention.sliding_window": None})
    with pytest.raises(ValueError, match=r"lacks 'gemma3.attention.sliding_window'"):
        load_gguf(bad, with_tokenizer=False)
    bad = tmp_path / "value-length.gguf"
    write_gemma_gguf(bad, path, "gemma3", **{"attention.value_length": 2 * HEAD_DIM})
    with pytest.raises(ValueError, match=r"value_length 32 differs from key_length 16"):
        load_gguf(bad, with_tokenizer=False)


@pytest.mark.parametrize("arch,layers", [("gemma2", 46), ("gemma3", 62)])
def test_gguf_27b_attention_scale(arch, layers):
    """llama.cpp's rule for the scale no GGUF key holds: head_dim, but hidden / heads for the 27B
    layer counts (whose HF configs say query_pre_attn_scalar = hidden / heads); refused where
    hidden / heads is not a whole number."""
    from kvflow.models.gguf_loader import _build_config

    def config(hidden: int, blocks: int) -> dict:
        meta = {
            f"{arch}.embedding_length": hidden,
            f"{arch}.block_count": blocks,
            f"{arch}.feed_forward_length": 128,
            f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": 2,
            f"{arch}.attention.key_length": 32,
            f"{arch}.attention.value_length": 32,
            f"{arch}.attention.sliding_window": WINDOW,
            f"{arch}.vocab_size": VOCAB_SIZE,
        }
        return _build_config("x.gguf", meta, {"token_embd.weight": [hidden, VOCAB_SIZE]}, arch)

    assert config(64, layers)["query_pre_attn_scalar"] == 16.0  # 64 / 4 heads, not head_dim 32
    assert config(64, layers - 1)["query_pre_attn_scalar"] == 32.0
    with pytest.raises(ValueError, match=r"cannot tell query_pre_attn_scalar.*66 is not a multiple of 4 heads"):
        config(66, layers)
