"""GLM-4 (HF `Glm4ForCausalLM`) against HF transformers on the same tiny random weights: its norms
after each sublayer, the fused gate_up_proj, q/k/v biases and rotary on half of each head in
interleaved pairs (q/k rows reordered at load); greedy tokens through chunked prefill, preemption
and a prefix-cache hit on each CPU attention backend, prefill logits, bfloat16 near float32, a
LoRA adapter against peft's merged model, two tensor-parallel ranks, GGUF files (llama.cpp's
`glm4`: F32 against HF, Q8_0 blocks against the dequantized file), and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import (
    TINY_DENSE,
    check_bfloat16_close_to_float32,
    check_blocks_follow_floats,
    check_greedy_matches_hf,
    check_prefill_logits_match_hf,
    save_tiny_model,
    shared_prefix_prompts,
)

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.models.glm4 import Glm4ForCausalLM
from kvflow.models.registry import causal_lm_class

from conftest import assert_no_leaks, hf_greedy
from gguf_files import Q, write_dense_gguf

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_glm4(path, **overrides):
    """A random tiny GLM-4 (head_dim 16: 8 features of each head rotate, in 4 interleaved pairs),
    its q/k/v biases random too (HF starts them at zero: a bias left out would not show)."""
    from transformers import Glm4Config
    from transformers import Glm4ForCausalLM as HFGlm4

    cfg = dict(TINY_DENSE, head_dim=16, partial_rotary_factor=0.5, attention_bias=True)
    cfg.update(overrides)
    torch.manual_seed(0)
    hf = save_tiny_model(path, HFGlm4, Glm4Config(**cfg), seed=1357)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.2)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def glm4(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm4")
    return str(path), make_glm4(path)


def test_config_reads_as_hf(glm4):
    path, hf = glm4
    cfg = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    assert causal_lm_class(cfg) is Glm4ForCausalLM
    rope = hf.config.rope_parameters
    assert cfg.rope.rotary_dim(cfg.head_dim) == int(hf.config.head_dim * rope["partial_rotary_factor"]) == 8
    assert cfg.attention_bias and cfg.rope.theta == rope["rope_theta"]


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(glm4, backend):
    check_greedy_matches_hf(*glm4, backend)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(glm4, chunk):
    check_prefill_logits_match_hf(*glm4, chunk)


def test_bfloat16_close_to_float32(glm4):
    check_bfloat16_close_to_float32(glm4[0])


def test_lora_matches_peft_merged(glm4, tmp_path):
    """An adapter on q/k/v (its q and k rows reordered as the model's), o, the fused gate_up and
    down: HF's greedy tokens with the adapter merged by peft."""
    pytest.importorskip("peft")
    from lora_utils import adapter_with_peft_greedy

    from kvflow import LoRARequest

    path, _ = glm4
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]
    prompts = shared_prefix_prompts(3, 4, 12, seed=3)
    adapter, expected = adapter_with_peft_greedy(path, str(tmp_path / "adapter"), targets, 2, prompts, MAX_TOKENS)
    llm = LLM(path, num_kv_blocks=64, max_model_len=64, enable_lora=True)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, adapter))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_no_leaks(llm.engine)
    llm.shutdown()


@pytest.mark.server  # (worker processes)
def test_tensor_parallel_matches_hf(glm4):
    """Two ranks (heads and feed-forward split; the post-norms read the all-reduced sums): HF's
    greedy tokens."""
    path, hf = glm4
    prompts = shared_prefix_prompts(3, 4, 20, seed=4)
    llm = LLM(path, max_model_len=64, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def test_gguf_greedy_matches_hf(glm4, tmp_path):
    """llama.cpp's `glm4` (rows as HF holds them, `rope.dimension_count` = the rotated features, its
    norms by llama.cpp's names): HF's greedy tokens from the F32 file; a Q8_0 file on its blocks
    follows the same file dequantized."""
    path, hf = glm4
    f32 = tmp_path / "glm4.gguf"
    write_dense_gguf(f32, path, "glm4")
    llm = LLM(str(f32), num_kv_blocks=64, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    mc = llm.engine.model_config
    assert mc.architecture == "Glm4ForCausalLM" and mc.rope.rotary_dim(mc.head_dim) == 8
    prompts = shared_prefix_prompts(3, 4, 20, seed=5)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)
    q8 = tmp_path / "glm4-q8.gguf"
    write_dense_gguf(q8, path, "glm4", Q.Q8_0)
    check_blocks_follow_floats(str(q8), prompts, MAX_TOKENS)


def test_refusals(glm4, tmp_path):
    import shutil

    path, _ = glm4
    with pytest.raises(ValueError, match="SmoothQuant"):
        LLM(path, quantization="int8", num_kv_blocks=64, max_model_len=32)
    # a GPTQ checkpoint's packed q/k rows cannot be reordered: refused by name before any weight is read
    quantized = tmp_path / "gptq"
    shutil.copytree(path, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gptq W4A16, group 32 checkpoints of 'glm4' models are not supported yet"):
        LLM(str(quantized), num_kv_blocks=64, max_model_len=32)
