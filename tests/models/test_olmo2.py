"""OLMo 2 against HF transformers on the same tiny random weights: no input norms, RMSNorm on the
attention and MLP outputs before each residual add, q/k RMSNorm over the whole projections. Greedy
tokens through chunked prefill, preemption and a prefix-cache hit on each CPU attention backend;
prefill logits; bfloat16 near float32; the refusals of what is not there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import (
    TINY_DENSE,
    check_bfloat16_close_to_float32,
    check_greedy_matches_hf,
    check_prefill_logits_match_hf,
    save_tiny_model,
    shared_prefix_prompts,
)

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.layers.linear_kernels import int8_available
from kvflow.models.olmo2 import Olmo2ForCausalLM
from kvflow.models.registry import causal_lm_class

from conftest import assert_no_leaks, hf_greedy
from gguf_files import add_folder_header

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_olmo2(path, **overrides):
    """A random tiny OLMo 2 (with a tokenizer) saved to `path`, its norms random too (HF initialises
    them to ones, which would hide a norm applied in the wrong place)."""
    from transformers import Olmo2Config
    from transformers import Olmo2ForCausalLM as HFOlmo2

    cfg = dict(TINY_DENSE)
    cfg.update(overrides)
    return save_tiny_model(path, HFOlmo2, Olmo2Config(**cfg), seed=4321)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmo2")
    return str(path), make_olmo2(path)


def test_config_reads_as_hf(olmo2):
    path, hf = olmo2
    cfg = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    assert causal_lm_class(cfg) is Olmo2ForCausalLM
    assert cfg.qk_norm and not cfg.qk_norm_per_head
    attn = hf.model.layers[0].self_attn
    assert attn.q_norm.weight.shape[0] == cfg.num_heads * cfg.head_dim
    assert attn.k_norm.weight.shape[0] == cfg.num_kv_heads * cfg.head_dim
    # (HF's OLMo 2 attends to the whole context, whatever sliding_window a config carries)
    windowed = ModelConfig.from_hf_config({**json.loads((Path(path) / "config.json").read_text()), "sliding_window": 8})
    assert windowed.sliding_window is None and windowed.window_of(0) is None


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(olmo2, backend):
    check_greedy_matches_hf(*olmo2, backend, MAX_TOKENS)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(olmo2, chunk):
    check_prefill_logits_match_hf(*olmo2, chunk)


def test_bfloat16_close_to_float32(olmo2):
    check_bfloat16_close_to_float32(olmo2[0])


def test_refusals(olmo2):
    path, _ = olmo2
    base = json.loads((Path(path) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM with attention_bias=true .* not supported"):
        ModelConfig.from_hf_config({**base, "attention_bias": True})
    with pytest.raises(ValueError, match=r"runs on one rank so far .*tensor_parallel_size=1"):
        from kvflow.distributed.parallel import TPGroup, local_config

        cfg = local_config(ModelConfig.from_hf_config(base), 2)
        Olmo2ForCausalLM(cfg, None, 16, torch.float32, torch.device("cpu"), TPGroup(0, 2, None))
    if int8_available():
        with pytest.raises(ValueError, match=r"int8 quantization does not reach Olmo2ForCausalLM"):
            LLM(path, max_model_len=32, quantization="int8")


def write_olmo2_gguf(path, hf_dir) -> None:
    """The tiny HF OLMo 2 in `hf_dir` as llama.cpp's convert_hf_to_gguf writes it (architecture
    `olmo2`: no `attn_norm`, `post_attention_norm` / `post_ffw_norm` on the sublayers' outputs,
    whole-projection `attn_q_norm` / `attn_k_norm`, Q/K rows as HF holds them: NEOX rotary), in F32,
    with the folder's byte-level BPE tokenizer padded to the vocabulary."""
    import gguf
    from safetensors.numpy import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = {k: v.astype("float32") for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), "olmo2")
    w.add_name("Tiny OLMo 2")
    add_folder_header(w, hf_dir, cfg)
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    names = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    for i in range(cfg["num_hidden_layers"]):
        for gguf_name, hf_name in names.items():
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", t[f"model.layers.{i}.{hf_name}.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_greedy_matches_hf(olmo2, tmp_path):
    """An `olmo2` GGUF (F32) loads as OLMo 2: HF's greedy tokens, through chunked prefill."""
    path, hf = olmo2
    gguf_path = tmp_path / "olmo2.gguf"
    write_olmo2_gguf(gguf_path, path)
    llm = LLM(str(gguf_path), num_kv_blocks=32, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    assert llm.engine.model_config.architecture == "Olmo2ForCausalLM"
    prompts = shared_prefix_prompts(3, 4, 20, seed=5)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)
