"""IBM Granite against HF transformers on the same tiny random weights, with Granite 3's kind of
scalars (embeddings x12, each sublayer's output x0.22, a softmax scale of its own, logits / 8):
greedy tokens through chunked prefill, preemption and a prefix-cache hit on each CPU attention
backend (the native one through the native decode pass), tied and untied embeddings, prefill
logits, bfloat16 near float32, LoRA adapters against peft's merged model; the refusals of what is
not there."""

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
from kvflow.attention.backends.cpu import native_unsupported
from kvflow.config import ModelConfig
from kvflow.models.granite import GraniteForCausalLM
from kvflow.models.registry import causal_lm_class

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SCALARS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05, logits_scaling=8.0)


def make_granite(path, **overrides):
    from transformers import GraniteConfig
    from transformers import GraniteForCausalLM as HFGranite

    cfg = dict(TINY_DENSE, **SCALARS)
    cfg.update(overrides)
    return save_tiny_model(path, HFGranite, GraniteConfig(**cfg), seed=2468)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def granite(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("granite")
    return str(path), make_granite(path, tie_word_embeddings=request.param)


def test_config_reads_as_hf(granite):
    path, _ = granite
    cfg = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    assert causal_lm_class(cfg) is GraniteForCausalLM
    assert (cfg.granite.embedding_multiplier, cfg.granite.residual_multiplier) == (12.0, 0.22)
    assert (cfg.granite.attention_multiplier, cfg.granite.logits_scaling) == (0.05, 8.0)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_hf(granite, backend):
    check_greedy_matches_hf(*granite, backend)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(granite, chunk):
    check_prefill_logits_match_hf(*granite, chunk)


def test_bfloat16_close_to_float32(granite):
    check_bfloat16_close_to_float32(granite[0])


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_logprobs_of_every_decode_step_are_hfs(granite, backend):
    """Every step's top logprobs (the logits divided by logits_scaling are what the sampler sees)
    against HF's forward over the same tokens; prefill in one step, then decode steps alone (on the
    native backend: the native decode pass, with Granite's softmax scale)."""
    if backend == "native" and native_unsupported(torch.device("cpu"), torch.float32, 4, 2, 16) is not None:
        pytest.skip("the native kernels cannot be built here")
    path, hf = granite
    _check_step_logprobs(LLM(path, num_kv_blocks=64, max_model_len=64, attention_backend=backend), hf)


def _check_step_logprobs(llm, hf, tol: float = 1e-4) -> None:
    """Each step's top-3 logprobs of three 10-token greedy outputs: HF's (float64) over the same tokens."""
    prompts = shared_prefix_prompts(3, 10, 14, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        c = out.outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + c.token_ids])).logits[0].double()
        ref = torch.log_softmax(logits, dim=-1)
        for step, entry in enumerate(c.logprobs):
            for token, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[len(prompt) - 1 + step, token].item(), abs=tol)


def test_lora_matches_peft_merged(tmp_path, monkeypatch):
    """An adapter on every projection (o_proj and down_proj among them, whose base weights carry
    the folded residual multiplier, and so must its update): each row's greedy tokens are HF's
    with the adapter merged by peft, on the per-layer path and through the native decode pass."""
    pytest.importorskip("peft")
    from lora_utils import adapter_with_peft_greedy

    from kvflow import LoRARequest

    path = str(tmp_path / "granite")
    make_granite(path)  # (untied: the tied tiny model's logits barely move under a random adapter)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    prompts = shared_prefix_prompts(3, 4, 12)
    adapter, expected = adapter_with_peft_greedy(path, str(tmp_path / "adapter"), targets, 3, prompts, MAX_TOKENS)
    for backend in ("dense", "native"):
        monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", backend)
        llm = LLM(path, num_kv_blocks=64, max_model_len=128, enable_lora=True, kernel_autotune="off")
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, adapter))
        assert [o.outputs[0].token_ids for o in outs] == expected, backend
        llm.shutdown()


def test_refusals(granite):
    path, _ = granite
    base = json.loads((Path(path) / "config.json").read_text())
    for name in ("attention_bias", "mlp_bias"):
        with pytest.raises(ValueError, match=rf"GraniteForCausalLM with {name}=true is not supported"):
            ModelConfig.from_hf_config({**base, name: True})
    with pytest.raises(ValueError, match=r"logits_scaling must be a finite number > 0"):
        ModelConfig.from_hf_config({**base, "logits_scaling": 0})


def write_granite_gguf(path, hf_dir, qtype=None) -> None:
    """The tiny HF Granite in `hf_dir` as llama.cpp's converter writes it (architecture `granite`:
    llama's tensors with Q/K rows permuted, the four scalars as `granite.embedding_scale`,
    `residual_scale`, `attention.scale`, `logit_scale`), in F32, or with its projections in `qtype`."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from gguf_files import Q, _put, add_folder_header, llama_cpp_permute

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = {k: v.astype("float32") for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), "granite")
    add_folder_header(w, hf_dir, cfg)
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg["num_hidden_layers"]):
        for gguf_name, hf_name in names.items():
            data = t[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in heads:
                data = llama_cpp_permute(data, heads[gguf_name])
            quantized = qtype is not None and data.ndim == 2
            _put(w, f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(data), qtype if quantized else Q.F32)
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    if "lm_head.weight" in t:
        w.add_tensor("output.weight", t["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_greedy_matches_hf(granite, tmp_path):
    """A `granite` GGUF (F32) loads as Granite with its scalars: HF's greedy tokens."""
    from kvflow import LLM, SamplingParams

    from conftest import assert_no_leaks, hf_greedy

    path, hf = granite
    gguf_path = tmp_path / "granite.gguf"
    write_granite_gguf(gguf_path, path)
    llm = LLM(str(gguf_path), num_kv_blocks=32, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    got = llm.engine.model_config.granite  # (the scalars are float32 in the file)
    assert (got.embedding_multiplier, got.residual_multiplier) == pytest.approx((12.0, 0.22))
    assert (got.attention_multiplier, got.logits_scaling) == pytest.approx((0.05, 8.0))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = shared_prefix_prompts(3, 4, 20, seed=5)
    for p, o in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    _check_step_logprobs(llm, hf, tol=1e-3)  # (the file's float32 scalars: 0.22 is 0.2199999988)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_blocks_follow_floats(granite, tmp_path, qtype):
    """Quantized projections run as stored, the residual multiplier folded into o_proj's and
    down_proj's block scales: they follow the same file dequantized to float (where it is folded
    in float32)."""
    from gguf_files import Q

    path, _ = granite
    quantized = tmp_path / f"granite-{qtype}.gguf"
    write_granite_gguf(quantized, path, Q[qtype])
    check_blocks_follow_floats(str(quantized), shared_prefix_prompts(3, 4, 20, seed=5), 12)
