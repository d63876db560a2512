"""Which decoder class serves a checkpoint: `causal_lm_class(cfg)`, by what its config describes."""

from __future__ import annotations

from kvflow.config import ModelConfig
from kvflow.models.llama import LlamaForCausalLM


def causal_lm_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The Mixture-of-Experts decoder for a model with experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
    OLMoE), the Gemma decoder for Gemma 2 / 3, Cohere's, ERNIE 4.5's, GLM-4's, Phi-3's, Granite's and
    OLMo 2 / 3's (and EXAONE 4's), else the Llama decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM3)."""
    if cfg.moe is not None:
        from kvflow.models.moe import MoeForCausalLM

        return MoeForCausalLM
    if cfg.gemma is not None:
        from kvflow.models.gemma import GemmaForCausalLM

        return GemmaForCausalLM
    if cfg.cohere is not None:
        from kvflow.models.cohere import CohereForCausalLM

        return CohereForCausalLM
    if cfg.architecture == "Ernie4_5ForCausalLM":
        from kvflow.models.ernie4_5 import Ernie4_5ForCausalLM

        return Ernie4_5ForCausalLM
    if cfg.architecture == "Glm4ForCausalLM":
        from kvflow.models.glm4 import Glm4ForCausalLM

        return Glm4ForCausalLM
    if cfg.architecture == "Phi3ForCausalLM":
        from kvflow.models.phi3 import Phi3ForCausalLM

        return Phi3ForCausalLM
    if cfg.granite is not None:
        from kvflow.models.granite import GraniteForCausalLM

        return GraniteForCausalLM
    if cfg.architecture in ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "Exaone4ForCausalLM"):
        from kvflow.models.olmo2 import Olmo2ForCausalLM

        return Olmo2ForCausalLM
    return LlamaForCausalLM
