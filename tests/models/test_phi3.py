"""Phi-3 against HF transformers on the same tiny random weights: its fused checkpoint projections
(`qkv_proj`, `gate_up_proj`), LongRoPE with its short factors (a context within
`original_max_position_embeddings`) and its long ones (prompts past it), a sliding window, and
Phi-4-mini's partial rotary (`partial_rotary_factor` 0.75); greedy tokens through chunked prefill
and a prefix-cache hit, prefill logits, the native decode pass, GGUF files, tensor parallelism,
and the refusals of what is not there."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import TINY_DENSE, check_blocks_follow_floats, save_tiny_model

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.models.phi3 import Phi3ForCausalLM
from kvflow.models.registry import causal_lm_class

from conftest import VOCAB_SIZE, assert_no_leaks, hf_greedy, kvflow_prefill_logits
from gguf_files import add_folder_tokenizer

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
HEAD_DIM = 16  # hidden 64 / 4 heads: 8 rotary frequencies
ORIGINAL = 32  # LongRoPE's original context
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
    "long_factor": [1.0 + 0.7 * i for i in range(HEAD_DIM // 2)],
}
PARTIAL = 0.75  # (Phi-4-mini's): 12 of each head's 16 features rotate, 6 frequencies
ROTARY = int(HEAD_DIM * PARTIAL)
PARTIAL_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.2 * i for i in range(ROTARY // 2)],
    "long_factor": [1.0 + 0.9 * i for i in range(ROTARY // 2)],
    "partial_rotary_factor": PARTIAL,
}
VARIANTS = {
    "plain": {},
    "longrope": dict(original_max_position_embeddings=ORIGINAL, rope_scaling=LONGROPE),
    "su": dict(original_max_position_embeddings=ORIGINAL, rope_scaling={**LONGROPE, "rope_type": "su"}),
    "sliding_window": dict(sliding_window=8),
    "partial": dict(partial_rotary_factor=PARTIAL),
    "partial-longrope": dict(original_max_position_embeddings=ORIGINAL, rope_scaling=PARTIAL_LONGROPE),
}


def make_phi3(path, **overrides):
    """A random tiny Phi-3 (with a tokenizer) saved to `path`; its norms random too, so a norm
    loaded into the wrong place would show."""
    from transformers import Phi3Config
    from transformers import Phi3ForCausalLM as HFPhi3

    cfg = dict(TINY_DENSE)
    cfg.update(overrides)
    return save_tiny_model(path, HFPhi3, Phi3Config(**cfg), seed=1234)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    cache: dict[str, tuple[str, object]] = {}

    def get(variant: str):
        if variant not in cache:
            path = tmp_path_factory.mktemp(f"phi3-{variant}")
            cache[variant] = (str(path), make_phi3(path, **VARIANTS[variant]))
        return cache[variant]

    return get


def _config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _prompts(n: int, lo: int, hi: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_config_reads_as_hf(phi3):
    """The checkpoint's fused projections and (su ->) longrope scaling, as HF's config reads them."""
    for variant in VARIANTS:
        path, hf = phi3(variant)
        cfg = ModelConfig.from_hf_config(_config(path))
        assert causal_lm_class(cfg) is Phi3ForCausalLM
        assert cfg.sliding_window == hf.config.sliding_window
        rope = hf.config.rope_parameters
        assert cfg.rope.scaling_type == rope["rope_type"], variant
        if rope["rope_type"] == "longrope":
            assert cfg.rope.original_max_position_embeddings == ORIGINAL
            assert list(cfg.rope.short_factor) == pytest.approx(rope["short_factor"])
            assert list(cfg.rope.long_factor) == pytest.approx(rope["long_factor"])
            # (HF's default factor: the context's growth over the original one)
            assert cfg.rope.factor == pytest.approx(hf.config.max_position_embeddings / ORIGINAL)
        assert cfg.rope.partial_rotary_factor == rope.get("partial_rotary_factor", 1.0)


# (variant, prompt lengths, max_model_len): LongRoPE within its original context (HF's short
# factors throughout), and with prompts past it (HF's long factors throughout).
CASES = {
    "plain": ("plain", (12, 22), 64),
    "sliding_window": ("sliding_window", (12, 22), 64),
    "longrope-short": ("longrope", (10, ORIGINAL - MAX_TOKENS), ORIGINAL),
    "longrope-long": ("longrope", (ORIGINAL + 1, ORIGINAL + 12), 64),
    "su-long": ("su", (ORIGINAL + 1, ORIGINAL + 12), 64),
    "partial": ("partial", (12, 22), 64),
    "partial-longrope-long": ("partial-longrope", (ORIGINAL + 1, ORIGINAL + 12), 64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf(phi3, case):
    """Four prompts through 4-token blocks and 8-token steps (prefill in chunks, across the window),
    16 tokens each, after the first prompt alone (a prefix-cache hit): HF's greedy tokens."""
    variant, (lo, hi), max_model_len = CASES[case]
    path, hf = phi3(variant)
    prompts = _prompts(4, lo, hi)
    llm = LLM(path, num_kv_blocks=96, max_model_len=max_model_len, block_size=4, max_num_batched_tokens=8)
    first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits > 0
    assert first[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("variant", ["plain", "longrope", "sliding_window", "partial-longrope"])
@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(phi3, variant, chunk):
    """Prompt logits, whole or 5 tokens at a time through the paged cache of a 128-token context (a
    prompt of 40 tokens: past LongRoPE's original context, where HF takes the long factors)."""
    path, hf = phi3(variant)
    prompt = _prompts(1, 40, 40, seed=3)[0]
    ours = kvflow_prefill_logits(path, prompt, chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_refusals(phi3):
    path, _ = phi3("plain")
    base = _config(path)
    llama = {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.75 .*Phi3ForCausalLM and Glm4ForCausalLM only"):
        ModelConfig.from_hf_config(
            {**llama, "rope_parameters": {**base["rope_parameters"], "partial_rotary_factor": 0.75}}
        )
    with pytest.raises(
        ValueError, match=r"partial_rotary_factor=0\.5 .*Phi3ForCausalLM and Glm4ForCausalLM only"
    ):  # (older configs: top level)
        ModelConfig.from_hf_config({**llama, "rope_parameters": None, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"rotates 9 of head_dim 16 features; it must rotate an even number"):
        ModelConfig.from_hf_config({**base, "rope_parameters": None, "partial_rotary_factor": 0.5625})
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be a number in \(0, 1\], got 1\.5"):
        ModelConfig.from_hf_config({**base, "rope_parameters": None, "partial_rotary_factor": 1.5})
    base = {**base, "rope_parameters": None}
    short = {**LONGROPE, "short_factor": [1.0, 1.0]}
    with pytest.raises(ValueError, match=r"short_factor has 2 entries; it needs head_dim / 2 = 8"):
        ModelConfig.from_hf_config({**base, "rope_scaling": short})
    with pytest.raises(
        ValueError, match=r"long_factor has 8 entries; it needs int\(head_dim x partial_rotary_factor 0\.75\) / 2 = 6"
    ):
        ModelConfig.from_hf_config(
            {**base, "rope_scaling": {**LONGROPE, "short_factor": [1.0] * 6, "partial_rotary_factor": 0.75}}
        )
    with pytest.raises(ValueError, match=r"long_factor as a list of numbers"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}})
    with pytest.raises(
        ValueError, match=r"unsupported rope scaling type 'ntk'; supported: default, linear, llama3, yarn"
    ):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "ntk", "factor": 2.0}})


def test_partial_rotary_order_is_hfs_rotation():
    """HF's partial rotary (rotate-half over the first rotary_dim features, the rest passed
    through) of random q at random positions, against kvflow's tables with the features reordered
    by `partial_rotary_order`: the same vectors, reordered, up to rounding; q . k unchanged."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from kvflow.config import RopeConfig
    from kvflow.layers.rotary import apply_rotary_, inverse_frequencies, partial_rotary_order, rope_tables

    d, rotary, positions = 16, 12, torch.tensor([0, 3, 17, 40])
    rope = RopeConfig(theta=500.0, partial_rotary_factor=rotary / d)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(len(positions), 3, d, generator=g, dtype=torch.float64).unbind(1)[:2]
    freqs = torch.outer(positions.double(), inverse_frequencies(rotary, rope).double())
    emb = torch.cat((freqs, freqs), dim=-1)
    hf_q, hf_k = apply_rotary_pos_emb(q.unsqueeze(1), k.unsqueeze(1), emb.cos(), emb.sin())
    order = partial_rotary_order(d, rotary)
    assert sorted(order.tolist()) == list(range(d))
    cos, sin = (t.double()[positions] for t in rope_tables(d, 64, rope))
    sin_signed = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1)
    ours_q = apply_rotary_(q[:, order].unsqueeze(1).clone(), cos.unsqueeze(1), sin_signed.unsqueeze(1))
    ours_k = apply_rotary_(k[:, order].unsqueeze(1).clone(), cos.unsqueeze(1), sin_signed.unsqueeze(1))
    torch.testing.assert_close(ours_q, hf_q[..., order], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close((ours_q * ours_k).sum(-1), (hf_q * hf_k).sum(-1), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(hf_q[..., :rotary], q.unsqueeze(1)[..., :rotary])  # (it did rotate)


def test_partial_rotary_through_the_native_decode_pass(phi3, monkeypatch):
    """With the native kernels every decode step runs in the fused decode pass, whose rotary reads
    the same tables: HF's greedy tokens."""
    monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", "native")
    path, hf = phi3("partial-longrope")
    llm = LLM(path, num_kv_blocks=64, max_model_len=64, block_size=4, kernel_autotune="off")
    if llm.engine.runner.model.native_decode is None:
        pytest.fail("the native decode pass is unavailable here (the native library could not be built)")
    prompts = _prompts(3, ORIGINAL + 1, ORIGINAL + 8, seed=21)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("backend", ["dense", "native"])
def test_lora_matches_peft_merged(phi3, tmp_path, monkeypatch, backend):
    """A PEFT adapter as PEFT makes them for Phi-3 (on the fused `qkv_proj` and `gate_up_proj`, and
    `o_proj`, `down_proj`) over Phi-4-mini's partial rotary (the adapter's q/k rows reordered as the
    model's): HF's greedy tokens with the adapter merged by peft, on the per-layer path and
    through the native decode pass."""
    pytest.importorskip("peft")
    from lora_utils import adapter_with_peft_greedy

    from kvflow import LoRARequest

    path, _ = phi3("partial-longrope")
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    prompts = _prompts(3, ORIGINAL + 1, ORIGINAL + 8, seed=17)
    adapter, expected = adapter_with_peft_greedy(path, str(tmp_path / "adapter"), targets, 5, prompts, MAX_TOKENS)
    monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", backend)
    llm = LLM(path, num_kv_blocks=64, max_model_len=64, enable_lora=True, kernel_autotune="off")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, adapter))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_no_leaks(llm.engine)
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.server  # worker processes
def test_tp2_matches_hf(phi3):
    """Two ranks, each with its share of the fused q/k/v and gate/up rows (q/k in the partial
    rotary's order): HF's greedy tokens, with LongRoPE's long factors, chunked prefill and a
    prefix-cache hit."""
    path, hf = phi3("partial-longrope")
    prompts = _prompts(3, ORIGINAL + 1, ORIGINAL + 12, seed=11)
    llm = LLM(path, max_model_len=64, block_size=4, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        llm.generate([prompts[0]], GREEDY, use_tqdm=False)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.get_stats().prefix_cache_hits > 0
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def write_phi3_gguf(path, hf_dir, qtype=None) -> None:
    """The tiny HF Phi-3 in `hf_dir` as llama.cpp's convert_hf_to_gguf writes it (architecture `phi3`:
    the fused `attn_qkv`, `ffn_up` holding gate and up, LongRoPE's factors as the tensors
    `rope_factors_short` / `rope_factors_long` with `phi3.rope.scaling.original_context_length`
    and `.attn_factor`, `phi3.attention.sliding_window`, Q/K rows as HF holds them), the projections
    in `qtype` (default F32), with the folder's byte-level BPE tokenizer padded to the vocabulary."""
    import math

    import gguf
    from safetensors.numpy import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = {k: v.astype("float32") for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_name("Tiny Phi-3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg["rope_parameters"]
    w.add_rope_dimension_count(int(HEAD_DIM * rope.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(float(cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope["rope_type"] == "longrope":
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    add_folder_tokenizer(w, hf_dir, cfg)

    def put(name: str, data) -> None:
        if qtype is None or data.ndim != 2:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    if rope["rope_type"] == "longrope":
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    names = {
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg["num_hidden_layers"]):
        for gguf_name, hf_name in names.items():
            put(f"blk.{i}.{gguf_name}.weight", t[f"model.layers.{i}.{hf_name}.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", ["longrope-long", "sliding_window", "partial-longrope-long"])
def test_gguf_greedy_matches_hf(phi3, tmp_path, case):
    """A `phi3` GGUF (F32) loads as Phi-3, its LongRoPE factors, window and rotary dimensions
    (`rope.dimension_count` below the head size: partial rotary) read from the file: HF's greedy
    tokens, through chunked prefill."""
    variant, (lo, hi), max_model_len = CASES[case]
    path, hf = phi3(variant)
    gguf_path = tmp_path / "phi3.gguf"
    write_phi3_gguf(gguf_path, path)
    llm = LLM(str(gguf_path), num_kv_blocks=64, max_model_len=max_model_len, block_size=4, max_num_batched_tokens=8)
    mc = llm.engine.model_config
    assert mc.architecture == "Phi3ForCausalLM" and mc.sliding_window == hf.config.sliding_window
    assert mc.rope.scaling_type == hf.config.rope_parameters["rope_type"]
    assert mc.rope.rotary_dim(mc.head_dim) == int(HEAD_DIM * hf.config.rope_parameters["partial_rotary_factor"])
    prompts = _prompts(3, lo, hi, seed=13)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("variant", ["longrope", "partial-longrope"])
def test_gguf_blocks_match_float_load(phi3, tmp_path, variant):
    """Q8_0 fused projections run in their blocks (the fused weights kept as stored, a partial
    rotary's q/k rows reordered as whole rows of blocks) and follow the same file's weights
    dequantized to float."""
    import gguf

    path, _ = phi3(variant)
    gguf_path = tmp_path / "phi3-q8.gguf"
    write_phi3_gguf(gguf_path, path, qtype=gguf.GGMLQuantizationType.Q8_0)
    check_blocks_follow_floats(str(gguf_path), _prompts(2, ORIGINAL + 1, ORIGINAL + 8, seed=14), MAX_TOKENS)
