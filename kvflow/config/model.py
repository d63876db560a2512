"""`ModelConfig`: what a checkpoint dictates (architecture, shapes, rope), read from a HF config dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Mixture-of-Experts families: the Llama-shaped decoder whose feed-forward routes each token to a
# few of many experts (kvflow.models.moe); what differs between them is read into `MoeConfig`.
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
)
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)
# Families whose configs carry a sliding window they only use when `use_sliding_window` is set.
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass
class RopeConfig:
    theta: float = 10000.0
    scaling_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoeConfig:
    """The routed experts of a Mixture-of-Experts model, as its HF config describes them. The
    families differ only in these values (HF transformers' routers, read side by side):

    * Mixtral: softmax, top-k, the top-k renormalised to sum to 1, weights kept in float32;
    * Qwen2-MoE: softmax, top-k, renormalised only if `norm_topk_prob`, weights rounded to the
      model dtype; plus a shared expert every token takes, scaled by sigmoid(shared_expert_gate(x));
    * Qwen3-MoE, OLMoE: as Qwen2-MoE without the shared expert.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # one expert's FFN width
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    # Mixtral scales the experts' outputs by float32 weights; the others round the weights to the
    # model dtype first (the same in a float32 model, one rounding apart in bfloat16).
    routing_weights_float32: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    decoder_sparse_step: int = 1  # every n-th layer routes (Qwen2/3-MoE); the others are dense
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP whatever the step

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (HF Qwen2/3-MoE's rule; Mixtral and
        OLMoE route in every layer)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass
class ModelConfig:
    """Architecture facts read from a HF-style config dict."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k (Qwen3, Qwen3-MoE, OLMoE)
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # q/k norms per head (Qwen3), or over the whole q and k projections (OLMoE).
    qk_norm_per_head: bool = True
    clip_qkv: float | None = None  # OLMoE: q, k (after their norms) and v clamped to +-clip_qkv
    moe: MoeConfig | None = None  # the routed experts of a Mixture-of-Experts model; None: dense

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"kvflow supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu' is supported")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding = cfg.get("sliding_window")
        if arch in _QWEN and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window they only use when this flag is set
        if arch == "Qwen2MoeForCausalLM" and cfg.get("use_sliding_window", False):
            raise ValueError(
                "Qwen2MoeForCausalLM with use_sliding_window=true (a window on some layers only, by "
                "max_window_layers) is not supported; kvflow runs one attention window for all layers"
            )
        if arch in ("Qwen3MoeForCausalLM", "OlmoeForCausalLM") and cfg.get("attention_bias", False):
            raise ValueError(
                f"{arch} with attention_bias=true (biases on q/k/v and o_proj) is not supported; "
                "kvflow's attention takes q/k/v biases only"
            )
        if arch == "Qwen2MoeForCausalLM":
            qkv_bias = bool(cfg.get("qkv_bias", True))  # Qwen2-MoE names its q/k/v bias qkv_bias
        else:
            qkv_bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
            rope=_rope_from_hf(cfg),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm_per_head=arch != "OlmoeForCausalLM",
            clip_qkv=_clip_qkv(cfg) if arch == "OlmoeForCausalLM" else None,
            moe=_moe_from_hf(arch, cfg) if arch in MOE_ARCHITECTURES else None,
        )


def _clip_qkv(cfg: dict[str, Any]) -> float | None:
    clip = cfg.get("clip_qkv")
    if clip is not None and not float(clip) > 0:
        raise ValueError(f"clip_qkv must be positive or null, got {clip!r}")
    return None if clip is None else float(clip)


def _moe_from_hf(arch: str, cfg: dict[str, Any]) -> MoeConfig:
    """The experts of a MoE family's config, with each family's own key names: Mixtral's
    `num_local_experts` (also what transformers 5 writes for Qwen3-MoE), the others'
    `num_experts`; Qwen2/3-MoE size experts by `moe_intermediate_size`, Mixtral and OLMoE by
    `intermediate_size`."""
    qwen = arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    num_experts = cfg.get("num_experts")
    if num_experts is None:
        num_experts = cfg.get("num_local_experts")
    size_key = "moe_intermediate_size" if qwen else "intermediate_size"
    for name, value in (("num_experts", num_experts), ("num_experts_per_tok", cfg.get("num_experts_per_tok"))):
        if value is None:
            raise ValueError(f"{arch} config lacks {name}")
    if cfg.get(size_key) is None:
        raise ValueError(f"{arch} config lacks {size_key} (the width of one expert)")
    moe = MoeConfig(
        num_experts=int(num_experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg[size_key]),
        # Mixtral always renormalises; the others only when asked (transformers 5's default: no).
        norm_topk_prob=arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
        routing_weights_float32=arch == "MixtralForCausalLM",
        shared_expert_intermediate_size=(
            int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        ),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1) if qwen else 1,
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()) if qwen else (),
    )
    if moe.num_experts > 0 and not 1 <= moe.num_experts_per_tok <= moe.num_experts:
        raise ValueError(
            f"{arch}: num_experts_per_tok={moe.num_experts_per_tok} must be between 1 and num_experts={moe.num_experts}"
        )
    if moe.decoder_sparse_step < 1:
        raise ValueError(f"{arch}: decoder_sparse_step must be >= 1, got {moe.decoder_sparse_step}")
    return moe


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3")
    return RopeConfig(
        theta=float(theta),
        scaling_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
