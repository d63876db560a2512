"""Which decoder class serves a checkpoint: `causal_lm_class(cfg)`, by what its config describes."""

from __future__ import annotations

from kvflow.config import ModelConfig
from kvflow.models.llama import LlamaForCausalLM


def causal_lm_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The Mixture-of-Experts decoder for a model with experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
    OLMoE), else the Llama decoder (Llama, Mistral, Qwen2, Qwen3)."""
    if cfg.moe is not None:
        from kvflow.models.moe import MoeForCausalLM

        return MoeForCausalLM
    return LlamaForCausalLM
