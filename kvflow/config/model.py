"""`ModelConfig`: what a checkpoint dictates (architecture, shapes, rope), read from a HF config dict."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# Mixture-of-Experts families: the Llama-shaped decoder whose feed-forward routes each token to a
# few of many experts (kvflow.models.moe); what differs between them is read into `MoeConfig`.
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
)
# Gemma 1, 2 and 3 (text): their own decoder (kvflow.models.gemma); what differs is `GemmaConfig`.
GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Llama-shaped families with a twist of their own (kvflow.models.phi3, kvflow.models.olmo2): Phi-3's
# fused checkpoint projections and LongRoPE, OLMo 2's norms after attention and MLP (OLMo 3: with
# sliding-window layers; EXAONE 4: with per-head q/k norms and NoPE global layers).
PHI3_OLMO2_ARCHITECTURES = ("Phi3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Exaone4ForCausalLM")
# IBM Granite (3.x): the Llama decoder with four scalars (kvflow.models.granite; `GraniteConfig`).
GRANITE_ARCHITECTURES = ("GraniteForCausalLM",)
# GLM-4 (0414): the Llama decoder with norms after attention and MLP too, fused gate/up, and
# rotary on half of each head in interleaved pairs (kvflow.models.glm4).
GLM4_ARCHITECTURES = ("Glm4ForCausalLM",)
# Cohere's Command R (v1: CohereForCausalLM) and Command R7B / A (Cohere2ForCausalLM): one LayerNorm
# feeding attention and MLP in parallel, interleaved rotary, scaled logits (kvflow.models.cohere).
COHERE_ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM")
# Families whose HF code rotates part of each head (`partial_rotary_factor`; kvflow.layers.rotary).
PARTIAL_ROTARY_ARCHITECTURES = ("Phi3ForCausalLM", *GLM4_ARCHITECTURES)
# SmolLM3: the Llama decoder with no rotary on some layers (NoPE; `ModelConfig.rope_layers`).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
    *GEMMA_ARCHITECTURES,
    *PHI3_OLMO2_ARCHITECTURES,
    *GRANITE_ARCHITECTURES,
    *GLM4_ARCHITECTURES,
    *COHERE_ARCHITECTURES,
    "SmolLM3ForCausalLM",
    "MinistralForCausalLM",  # (Mistral with a window per layer type)
    "SeedOssForCausalLM",  # (Llama with q/k/v biases)
    "Ernie4_5ForCausalLM",  # (interleaved rotary pairs: kvflow.models.ernie4_5)
)
# Families whose configs carry a sliding window they only use when `use_sliding_window` is set.
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


# The rope scaling types kvflow computes (kvflow.layers.rotary), each as HF transformers'
# modeling_rope_utils computes it.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclass
class RopeConfig:
    theta: float = 10000.0
    scaling_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # The model's context (dynamic NTK's reference length).
    max_position_embeddings: int = 2048
    # YaRN and LongRoPE scale cos and sin by this (None: derived from the factors, as HF does).
    attention_factor: float | None = None
    # YaRN: the ramp between the dimensions turning beta_fast and beta_slow times over the original
    # context (truncated to whole dimensions unless `truncate` is false); mscale / mscale_all_dim
    # derive the attention factor.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # LongRoPE: per-frequency divisors below original_max_position_embeddings (short) and from it on (long).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # The share of each head that rotates (Phi-4-mini: 0.75): its first int(head_dim * factor)
    # features, as HF's Phi-3 does; the rest pass through unrotated.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """How many features of each head rotate (HF: int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class GraniteConfig:
    """Granite's scalars over the Llama shape (HF transformers' modeling_granite.py): the
    embeddings times `embedding_multiplier`, each sublayer's output times `residual_multiplier`
    before its residual add, `attention_multiplier` as the attention's softmax scale (not
    head_dim ** -0.5), and the logits divided by `logits_scaling`."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


@dataclass(frozen=True)
class CohereConfig:
    """Cohere's scalar over its layer shape (kvflow.models.cohere): the logits times `logit_scale`."""

    logit_scale: float = 1.0


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
    # Under tensor parallelism with expert parallelism, the ranks the experts are partitioned over
    # (each holds a contiguous range: kvflow.distributed.parallel.expert_range); 1: every rank has
    # every expert (split inside, the widths above being this rank's share). Set by `local_config`.
    expert_parallel_size: int = 1

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (HF Qwen2/3-MoE's rule; Mixtral and
        OLMoE route in every layer)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class GemmaConfig:
    """What Gemma (1, 2, 3) changes in the Llama shape (HF transformers' modeling_gemma.py,
    modeling_gemma2.py and modeling_gemma3.py): GeGLU, the attention scale, soft-capping (Gemma 2).
    Norms are x * (1 + w), Gemma 2 / 3 with post-attention and pre/post feed-forward norms;
    embeddings are scaled by sqrt(hidden_size)."""

    hidden_act: str  # the feed-forward's gate activation: gelu_pytorch_tanh (or silu)
    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> tanh(scores / cap) * cap before the softmax
    final_logit_softcapping: float | None = None  # the same on the logits
    post_norms: bool = True  # Gemma 2 / 3's norms after the attention and the feed-forward (Gemma 1: none)


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
    # Per decoder layer, its attention window in tokens (None: full attention). Empty: every layer
    # takes `sliding_window`. Gemma 2 / 3 mix local (windowed) and global layers (HF `layer_types`).
    layer_windows: tuple[int | None, ...] = ()
    gemma: GemmaConfig | None = None  # Gemma 1 / 2 / 3 (kvflow.models.gemma); None: another family
    granite: GraniteConfig | None = None  # Granite (kvflow.models.granite); None: another family
    cohere: CohereConfig | None = None  # Command R / R7B (kvflow.models.cohere); None: another family
    # Per decoder layer, whether it rotates q and k (SmolLM3's NoPE layers do not). Empty: all do.
    rope_layers: tuple[bool, ...] = ()
    # The rope of the sliding-window layers where it is not `rope` (Gemma 3: base 10k; OLMo 3: no
    # YaRN); None: every layer rotates by `rope`.
    rope_local: RopeConfig | None = None

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def window_of(self, layer: int) -> int | None:
        """The attention window of decoder layer `layer` (None: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def uses_rope(self, layer: int) -> bool:
        """Whether decoder layer `layer` applies the rotary embedding to q and k."""
        return self.rope_layers[layer] if self.rope_layers else True

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers attend within a window and others to the whole context."""
        windows = {self.window_of(i) for i in range(self.num_layers)}
        return None in windows and len(windows) > 1

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"kvflow supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch in GEMMA_ARCHITECTURES  # (its activation is read by _with_gemma)
        if not gemma and cfg.get("hidden_act", "silu") != "silu":
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
        if arch == "SeedOssForCausalLM":
            for name in ("attention_out_bias", "mlp_bias"):
                if cfg.get(name, False):
                    raise ValueError(
                        f"SeedOssForCausalLM with {name}=true (biases on o_proj or the MLP) is not supported; "
                        "kvflow's attention takes q/k/v biases only"
                    )
        if arch == "Ernie4_5ForCausalLM" and cfg.get("use_bias", False):
            raise ValueError(
                "Ernie4_5ForCausalLM with use_bias=true (biases on every projection, o_proj and the MLP "
                "among them) is not supported; kvflow's attention takes q/k/v biases only"
            )
        if arch in ("Qwen3MoeForCausalLM", "OlmoeForCausalLM") and cfg.get("attention_bias", False):
            raise ValueError(
                f"{arch} with attention_bias=true (biases on q/k/v and o_proj) is not supported; "
                "kvflow's attention takes q/k/v biases only"
            )
        if arch == "Qwen2MoeForCausalLM":
            qkv_bias = bool(cfg.get("qkv_bias", True))  # Qwen2-MoE names its q/k/v bias qkv_bias
        else:
            # (Seed-OSS's config class defaults attention_bias to true)
            qkv_bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", arch == "SeedOssForCausalLM"))
        config = cls(
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
            rope=_rope_from_hf(
                _gemma_global_rope(cfg, arch) if gemma else cfg,
                phi3=arch == "Phi3ForCausalLM",
                partial=arch in PARTIAL_ROTARY_ARCHITECTURES,
            ),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm_per_head=arch != "OlmoeForCausalLM",
            clip_qkv=_clip_qkv(cfg) if arch == "OlmoeForCausalLM" else None,
            moe=_moe_from_hf(arch, cfg) if arch in MOE_ARCHITECTURES else None,
        )
        rotary = config.rope.rotary_dim(head_dim)
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"partial_rotary_factor {config.rope.partial_rotary_factor} rotates {rotary} of head_dim "
                f"{head_dim} features; it must rotate an even number of them, at least 2"
            )
        if arch in PHI3_OLMO2_ARCHITECTURES:
            return _with_phi3_olmo2(config, cfg)
        if arch in GRANITE_ARCHITECTURES:
            return replace(config, granite=_granite_from_hf(cfg))
        if arch == "SmolLM3ForCausalLM":
            return _with_smollm3(config, cfg)
        if arch in COHERE_ARCHITECTURES:
            return _with_cohere(config, cfg)
        if arch == "MinistralForCausalLM":
            return _with_ministral(config, cfg)
        return _with_gemma(config, cfg) if gemma else config


def _granite_from_hf(cfg: dict[str, Any]) -> GraniteConfig:
    for name in ("attention_bias", "mlp_bias"):
        if cfg.get(name, False):
            raise ValueError(
                f"GraniteForCausalLM with {name}=true is not supported (biases on o_proj or the MLP); "
                "kvflow's attention takes q/k/v biases only"
            )
    values = {}
    for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        value = float(cfg.get(name, 1.0))
        if not value > 0 or value == float("inf"):
            raise ValueError(f"GraniteForCausalLM: {name} must be a finite number > 0, got {cfg.get(name)!r}")
        values[name] = value
    return GraniteConfig(**values)


def _with_smollm3(config: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    """SmolLM3 (HF modeling_smollm3.py): `no_rope_layers[i]` 1 where layer i rotates q and k, 0
    where it does not (NoPE; by default every fourth layer); the window only with
    `use_sliding_window`, on the `layer_types` "sliding_attention" layers."""
    if cfg.get("mlp_bias", False):
        raise ValueError("SmolLM3ForCausalLM with mlp_bias=true is not supported")
    n = config.num_layers
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n or any(f not in (0, 1) for f in flags):
        raise ValueError(f"SmolLM3ForCausalLM: no_rope_layers must hold a 0 or 1 for each of the {n} layers")
    windows: tuple[int | None, ...] = ()
    if cfg.get("use_sliding_window", False) and cfg.get("sliding_window"):
        types = cfg.get("layer_types") or ["sliding_attention"] * n
        windows = tuple(int(cfg["sliding_window"]) if t == "sliding_attention" else None for t in types)
    return replace(config, rope_layers=tuple(bool(f) for f in flags), sliding_window=None, layer_windows=windows)


def _with_cohere(config: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    """Command R (HF modeling_cohere.py) and R7B / A (modeling_cohere2.py): the LayerNorm's eps
    (`layer_norm_eps`), `logit_scale`; Cohere 2's `layer_types`: its sliding layers attend within
    `sliding_window` and rotate q and k, its full-attention layers do neither (NoPE)."""
    arch = config.architecture
    if cfg.get("use_qk_norm", False):
        raise ValueError(f"{arch} with use_qk_norm=true (Command R+'s q/k LayerNorms) is not supported")
    if cfg.get("attention_bias", False):
        raise ValueError(
            f"{arch} with attention_bias=true (biases on q/k/v and o_proj) is not supported; "
            "kvflow's attention takes q/k/v biases only"
        )
    scale = float(cfg.get("logit_scale", 1.0))
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{arch}: logit_scale must be a finite number > 0, got {cfg.get('logit_scale')!r}")
    config = replace(
        config,
        rms_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),  # (the LayerNorm's)
        cohere=CohereConfig(logit_scale=scale),
    )
    if arch == "CohereForCausalLM":
        return replace(config, sliding_window=None, layer_windows=())
    # (older configs: every `sliding_window_pattern`-th layer global)
    types = _layer_types(arch, cfg, config.num_layers, int(cfg.get("sliding_window_pattern", 4)))
    windows = _windows(types, cfg.get("sliding_window"))
    # (HF: a layer rotates q and k exactly when it has a window)
    return replace(
        config, sliding_window=None, layer_windows=windows, rope_layers=tuple(w is not None for w in windows)
    )


def _with_exaone4(config: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    """EXAONE 4 (HF modeling_exaone4.py): OLMo 2's layer with q/k norms per head; with a
    `sliding_window`, `layer_types` (else `sliding_window_pattern`: every n-th layer global, or a
    string of L / G) put the local layers in the window, and only they rotate q and k."""
    config = replace(config, qk_norm_per_head=True)
    if not cfg.get("sliding_window"):
        return config
    types = _layer_types(config.architecture, cfg, config.num_layers, cfg.get("sliding_window_pattern", 4))
    windows = _windows(types, cfg["sliding_window"])
    return replace(config, layer_windows=windows, rope_layers=tuple(w is not None for w in windows))


def _with_ministral(config: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    """Ministral (HF modeling_ministral.py): Mistral whose `layer_types` say which layers attend
    within `sliding_window` (the others to the whole context)."""
    types = _layer_types(config.architecture, cfg, config.num_layers, "L")  # (default: every layer sliding)
    return replace(config, sliding_window=None, layer_windows=_windows(types, cfg.get("sliding_window")))


def _layer_types(arch: str, cfg: dict[str, Any], n: int, pattern: int | str) -> list[str]:
    """A config's `layer_types` ("sliding_attention" / "full_attention" for each of its `n` layers),
    checked; absent, from `pattern`: every pattern-th layer global (an int), or a string of L
    (local) and G (global) repeated over the layers (EXAONE 4's form)."""
    types = cfg.get("layer_types")
    if types is None:
        if isinstance(pattern, str):
            types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n)]
        else:
            types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(n)]
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(
            f"{arch}: layer_types must name sliding_attention or full_attention for each of the {n} layers"
        )
    return types


def _windows(types: list[str], window: Any) -> tuple[int | None, ...]:
    """Per layer its attention window: `window` on the sliding layers (none without a window)."""
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


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


# HF's gate activations kvflow's Gemma decoder runs (ACT2FN names).
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "silu")


def _gemma_global_rope(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The rope of a Gemma config's full-attention layers, as a config dict `_rope_from_hf` reads.
    Gemma 3 keeps one rope per layer type: transformers 5 writes `rope_parameters` as
    {"full_attention": ..., "sliding_attention": ...}; older configs have `rope_theta` (global,
    default 1M) with `rope_scaling` for the global layers and `rope_local_base_freq` for the local ones."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        return {"rope_parameters": params["full_attention"]}
    if arch == "Gemma3ForCausalLM":
        return {**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
    return cfg


def _gemma_local_rope(cfg: dict[str, Any], arch: str) -> RopeConfig:
    """The rope of a Gemma config's sliding-window layers (Gemma 2: the same as the global one;
    Gemma 3: base `rope_local_base_freq` (10k), unscaled, unless `rope_parameters` says otherwise)."""
    params = cfg.get("rope_parameters") or {}
    if "sliding_attention" in params:
        return _rope_from_hf({"rope_parameters": params["sliding_attention"]})
    if arch == "Gemma3ForCausalLM":
        return RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10_000.0)))
    return _rope_from_hf(cfg)


def _with_gemma(config: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    """`config` with what Gemma 2 / 3 read besides the Llama fields: per-layer windows from
    `layer_types` (or HF's defaults: Gemma 2 alternates sliding / full from layer 0, Gemma 3 has
    `sliding_window_pattern` - 1 sliding layers to one full), q/k norms (Gemma 3) and `GemmaConfig`."""
    arch = config.architecture
    if arch == "GemmaForCausalLM":
        return _with_gemma1(config, cfg)
    # HF reads `hidden_activation` (default gelu_pytorch_tanh) and ignores `hidden_act`.
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {act!r} for {arch}; supported: {', '.join(GEMMA_ACTIVATIONS)}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention=true (an encoder) is not supported")
    if cfg.get("attention_bias", False):
        raise ValueError(f"{arch} with attention_bias=true (a bias on o_proj too) is not supported")
    n = config.num_layers
    types = cfg.get("layer_types")
    if types is None:
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"{arch}: layer_types must list 'sliding_attention' / 'full_attention' for each of the {n} layers, got {types!r}"
        )
    window = cfg.get("sliding_window", 4096)
    if "sliding_attention" in types and (window is None or int(window) < 1):
        raise ValueError(f"{arch}: sliding_window must be a positive number of tokens, got {window!r}")
    windows = tuple(int(window) if t == "sliding_attention" and window is not None else None for t in types)

    def _cap(key: str, default: float | None) -> float | None:
        cap = cfg.get(key, default)
        if cap is not None and not float(cap) > 0:
            raise ValueError(f"{arch}: {key} must be positive or null, got {cap!r}")
        return None if cap is None else float(cap)

    gemma2 = arch == "Gemma2ForCausalLM"
    local = _gemma_local_rope(cfg, arch)
    return replace(
        config,
        sliding_window=None if window is None else int(window),
        layer_windows=windows,
        rope_local=None if local == config.rope else local,
        qk_norm=not gemma2,  # Gemma 3: RMSNorm (1 + w) on each head of q and k
        qk_norm_per_head=True,
        gemma=GemmaConfig(
            hidden_act=act,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            # Gemma 3's config carries attn_logit_softcapping, but HF's Gemma3Attention never passes
            # it to the attention: it is not applied there, so it is not here.
            attn_logit_softcapping=_cap("attn_logit_softcapping", 50.0) if gemma2 else None,
            final_logit_softcapping=_cap("final_logit_softcapping", 30.0 if gemma2 else None),
        ),
    )


def _with_gemma1(config: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    """Gemma (1; HF modeling_gemma.py): the Llama layer with Gemma's (1 + w) norms, GeGLU and scaled
    embeddings -- no post-norms, window, soft-caps or q/k norms; the attention scaled by head_dim.
    HF reads `hidden_act`, its legacy "gelu" meaning the tanh approximation."""
    act = cfg.get("hidden_act") or "gelu_pytorch_tanh"
    act = "gelu_pytorch_tanh" if act == "gelu" else act
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(
            f"unsupported hidden_act {act!r} for GemmaForCausalLM; supported: {', '.join(GEMMA_ACTIVATIONS)}"
        )
    if cfg.get("attention_bias", False):
        raise ValueError("GemmaForCausalLM with attention_bias=true (a bias on o_proj too) is not supported")
    return replace(
        config,
        sliding_window=None,
        layer_windows=(),
        gemma=GemmaConfig(hidden_act=act, query_pre_attn_scalar=float(config.head_dim), post_norms=False),
    )


def _with_phi3_olmo2(config: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    """`config` with what Phi-3 and OLMo 2 read besides the Llama fields (HF transformers'
    configuration_phi3.py / configuration_olmo2.py / configuration_olmo3.py): nothing more for Phi-3
    (its rope, where `su` and `yarn` are LongRoPE, is `_rope_from_hf`'s); OLMo 2's and 3's q/k norms
    over the whole q and k projections; OLMo 3's windows and ropes per layer type."""
    arch = config.architecture
    if arch == "Phi3ForCausalLM":
        return config
    if cfg.get("attention_bias", False):
        raise ValueError(f"{arch} with attention_bias=true (biases on q/k/v and o_proj) is not supported")
    config = replace(config, qk_norm=True, qk_norm_per_head=False, sliding_window=None, layer_windows=())
    if arch == "Olmo2ForCausalLM":  # (HF's OLMo 2 attends to the whole context: a `sliding_window` is not used)
        return config
    if arch == "Exaone4ForCausalLM":
        return _with_exaone4(config, cfg)
    # OLMo 3: `layer_types` (default: three sliding layers to one full), the sliding ones within
    # `sliding_window`; a rope per layer type, HF putting an old config's `rope_scaling` (YaRN) on the
    # full-attention layers only, `rope_theta` on both.
    types = _layer_types(arch, cfg, config.num_layers, 4)
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full = {**cfg, "rope_scaling": None, "rope_parameters": params["full_attention"]}
        local = {**cfg, "rope_scaling": None, "rope_parameters": params.get("sliding_attention")}
    else:
        full, local = cfg, {**cfg, "rope_scaling": None, "rope_parameters": None}
    rope, rope_local = _rope_from_hf(full), _rope_from_hf(local)
    return replace(
        config,
        layer_windows=_windows(types, cfg.get("sliding_window")),
        rope=rope,
        rope_local=None if rope_local == rope else rope_local,
    )


def _rope_from_hf(cfg: dict[str, Any], phi3: bool = False, partial: bool = False) -> RopeConfig:
    """The rope of a HF config, with the defaults HF transformers' `standardize_rope_params` fills
    in. `phi3`: Phi-3's names, where `su` and `yarn` mean LongRoPE; `partial`: a family whose HF code
    honours `partial_rotary_factor` (refused for the others)."""
    # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if phi3 and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    share = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    share = 1.0 if share is None else share
    if not isinstance(share, (int, float)) or not 0 < float(share) <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {share!r}")
    if float(share) != 1.0 and not partial:
        raise ValueError(
            f"partial_rotary_factor={share} (rotary on part of each head) is supported for "
            f"{' and '.join(PARTIAL_ROTARY_ARCHITECTURES)} only (HF's other families here rotate whole heads)"
        )
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    original = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn", "longrope"):
        # HF: a top-level original_max_position_embeddings (Phi-3's) wins; absent, the model's context.
        original = cfg.get("original_max_position_embeddings", original if original is not None else max_pos)
    factor = params.get("factor")
    if factor is None:
        # YaRN and LongRoPE without a factor: the context's growth over the original one.
        factor = max_pos / int(original) if rope_type in ("yarn", "longrope") else 1.0
    if rope_type == "longrope":
        _check_longrope(params, cfg, float(share))
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=float(theta),
        scaling_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original if original is not None else 8192),
        max_position_embeddings=max_pos,
        attention_factor=None if attention_factor is None else float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        partial_rotary_factor=float(share),
    )


def _check_longrope(params: dict[str, Any], cfg: dict[str, Any], partial: float) -> None:
    """LongRoPE needs one short and one long factor per rotary frequency (half the rotated features
    of a head: head_dim / 2, or int(head_dim x partial_rotary_factor) / 2)."""
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not isinstance(factors, list) or not all(isinstance(f, (int, float)) for f in factors):
            raise ValueError(f"longrope rope scaling needs {key} as a list of numbers, got {factors!r}")
        if head_dim is None:
            continue
        need = int(head_dim * partial) // 2
        if len(factors) != need:
            what = "head_dim / 2" if partial == 1.0 else f"int(head_dim x partial_rotary_factor {partial}) / 2"
            raise ValueError(f"longrope {key} has {len(factors)} entries; it needs {what} = {need} (one per frequency)")
