"""RoPE scaling against HF transformers: the cos / sin tables of every scaling type kvflow computes
(default, linear, llama3, YaRN with each way of giving its attention factor and ramp, LongRoPE's
short and long factors, dynamic NTK) against HF's rotary modules for every position of the context,
read through `ModelConfig` from the config HF writes; and greedy tokens of a Llama with `llama3`
scaling (positions past the original context, frequencies in all three of its regions) and of a
Qwen2 with YaRN, through chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.layers.rotary import RotaryEmbedding, inverse_frequencies

from conftest import VOCAB_SIZE, assert_no_leaks, hf_greedy

MAX_POS = 256
HIDDEN, HEADS = 64, 4  # head_dim 16: 8 frequencies
HEAD_DIM = HIDDEN // HEADS
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

# name -> (HF config class name, rope parameters): each scaling type, and YaRN's variants.
ROPES = {
    "default": ("LlamaConfig", {"rope_type": "default", "rope_theta": 500.0}),
    "linear": ("LlamaConfig", {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0}),
    "llama3": (
        "LlamaConfig",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ),
    "yarn": ("LlamaConfig", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn-qwen2": ("Qwen2Config", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn-attention_factor": (
        "LlamaConfig",
        {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 64, "attention_factor": 0.8},
    ),
    "yarn-mscale": (
        "LlamaConfig",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ),
    "yarn-no_truncate": (
        "LlamaConfig",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": False},
    ),
    "dynamic": ("LlamaConfig", {"rope_type": "dynamic", "factor": 2.0}),
}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.15 * i for i in range(HEAD_DIM // 2)],
    "long_factor": [1.0 + 0.9 * i for i in range(HEAD_DIM // 2)],
}
PHI3_ORIGINAL = 32


def _hf_config(cls_name: str, rope: dict, **extra):
    import transformers

    return getattr(transformers, cls_name)(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(rope) if rope is not None else None,
        **extra,
    )


def _hf_tables(hf_cfg, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos and sin for `positions`, in one forward pass of the model family's rotary module."""
    import transformers

    arch = hf_cfg.model_type
    module = {
        "llama": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
        "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
        "phi3": transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding,
    }[arch](hf_cfg)
    with torch.no_grad():
        cos, sin = module(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


def _ours(hf_cfg, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kvflow's cos and sin (un-signed) for positions 0 .. max_positions - 1, from the config dict
    HF writes."""
    d = hf_cfg.to_dict()
    d["architectures"] = [type(hf_cfg).__name__.replace("Config", "ForCausalLM")]
    d.setdefault("intermediate_size", 128)
    d.setdefault("num_hidden_layers", 2)
    cfg = ModelConfig.from_hf_config(d)
    rot = RotaryEmbedding(HEAD_DIM, max_positions, cfg.rope, torch.float32, torch.device("cpu"))
    sign = torch.cat((-torch.ones(HEAD_DIM // 2), torch.ones(HEAD_DIM // 2)))
    return rot.cos, rot.sin_signed * sign


@pytest.mark.parametrize("name", list(ROPES))
def test_tables_match_hf(name):
    cls_name, rope = ROPES[name]
    hf_cfg = _hf_config(cls_name, rope)
    positions = torch.arange(MAX_POS)
    ref_cos, ref_sin = _hf_tables(hf_cfg, positions)
    cos, sin = _ours(hf_cfg, MAX_POS)
    torch.testing.assert_close(cos, ref_cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=2e-6, rtol=0)
    if name.startswith("yarn"):  # (the attention factor is in the tables: cos^2 + sin^2 = factor^2)
        assert not torch.allclose(cos.square() + sin.square(), torch.ones(()))


@pytest.mark.parametrize("context", [PHI3_ORIGINAL, MAX_POS])
@pytest.mark.parametrize("rope_type", ["longrope", "su"])
def test_longrope_tables_match_hf(context, rope_type):
    """Phi-3's LongRoPE: a context within the original one takes HF's short factors (every forward
    pass there has its positions below it), a longer one the long factors (HF's for any sequence
    past it: a forward pass whose highest position is past it)."""
    hf_cfg = _hf_config(
        "Phi3Config", {**LONGROPE, "rope_type": rope_type}, original_max_position_embeddings=PHI3_ORIGINAL
    )
    ref_cos, ref_sin = _hf_tables(hf_cfg, torch.arange(context))
    cos, sin = _ours(hf_cfg, context)
    torch.testing.assert_close(cos, ref_cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=2e-6, rtol=0)
    # (the two differ: the test would see the wrong set)
    rope = ModelConfig.from_hf_config(
        {**hf_cfg.to_dict(), "architectures": ["Phi3ForCausalLM"], "intermediate_size": 128, "num_hidden_layers": 2}
    ).rope
    assert not torch.equal(inverse_frequencies(HEAD_DIM, rope), inverse_frequencies(HEAD_DIM, rope, long=True))


def test_unknown_type_is_refused():
    d = _hf_config("LlamaConfig", ROPES["default"][1]).to_dict()
    d.update(architectures=["LlamaForCausalLM"], intermediate_size=128, num_hidden_layers=2)
    d["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 10000.0}
    with pytest.raises(
        ValueError,
        match=r"unsupported rope scaling type 'proportional'; supported: default, linear, llama3, yarn, longrope, dynamic",
    ):
        ModelConfig.from_hf_config(d)


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, VOCAB_SIZE) for _ in range(12)]
    return [shared + [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _greedy_matches(path: str, hf, prompts: list[list[int]]) -> None:
    llm = LLM(path, num_kv_blocks=96, max_model_len=128, block_size=4, max_num_batched_tokens=16)
    llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
    assert_no_leaks(llm.engine)


def test_llama3_greedy_matches_hf(model_factory):
    """Llama 3.1 scaling with an original context of 16 and its wavelength bounds 16 / 1 and 16 / 2
    placing the 8 frequencies in all three regions (kept, blended, slowed by `factor`); prompts of
    20-70 tokens (past the original context, and past it times the high-frequency factor)."""
    rope = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 2.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 100.0,
    }
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    wavelen = 2 * math.pi / inv_freq
    assert (wavelen < 16 / 2).any() and ((wavelen >= 16 / 2) & (wavelen <= 16)).any() and (wavelen > 16).any()
    path, hf = model_factory("llama", rope_parameters=rope)
    _greedy_matches(path, hf, _prompts(4, 8, 58, seed=21))


def test_yarn_greedy_matches_hf(model_factory):
    """Qwen2 with YaRN (factor 4 over an original context of 32; its attention factor on cos / sin):
    prompts past the original context."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    path, hf = model_factory("qwen2", rope_parameters=rope)
    _greedy_matches(path, hf, _prompts(4, 24, 60, seed=22))
