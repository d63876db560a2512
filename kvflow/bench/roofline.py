"""Back-of-the-envelope decode roofline: KV size, memory fit, step-time floors, cost, spec-decode gains.

All pure functions (no torch) except `measure_local_hardware`. Units: bytes, seconds, FLOP/s,
bytes/s; GB = 1e9 bytes.

Decode step of `batch` sequences, each holding `context` tokens of KV:
    memory floor  = (weight bytes + batch × context × KV bytes/token) / bandwidth
    compute floor = 2 × params × batch / FLOP/s          (matmul FLOPs only, attention ignored)
    step time     = max(memory floor, compute floor)
    tokens/s      = batch / step time           (per device)
    $ per 1M tok  = price per hour / (3600 × tokens/s) × 1e6

Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): every weight stays resident
(memory fit counts the total parameters), but a decode step reads only the experts its batch routes
to. Each MoE layer holds E experts of which each token picks k distinct ones; under uniform,
independent routing a batch of B tokens touches on average
    E × (1 − ((E − k) / E)^B)
distinct experts per layer (an expert is missed by one token with probability (E − k)/E). Then
    weight bytes read = dense bytes + MoE layers × experts touched × bytes of one expert
    compute floor     = 2 × active params × batch      (active: the top-k experts, not all E)
where the dense bytes are everything but the routed experts (attention, embeddings, routers,
shared experts, dense MLP layers). A measured distinct-expert count can replace the expectation.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvflow.utils.memory import meminfo_bytes

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "q8_0": 34 / 32,
    "int4": 0.5,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
}


def dtype_bytes(name: str) -> float:
    key = str(name).lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


@dataclass
class MoESpec:
    """The routed experts of a MoE model. Parameter counts are per layer (`expert_params`: one
    expert); `expert_bytes` (one expert, one layer) is used with `ModelSpec.weight_bytes_override`
    (a GGUF file's real bytes), else bytes follow the weight dtype."""

    num_experts: int
    top_k: int
    num_moe_layers: int
    expert_params: float
    router_params: float = 0.0
    shared_expert_params: float = 0.0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    expert_bytes: float | None = None


@dataclass
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: float
    weight_dtype: str = "bf16"
    weight_bytes_override: float | None = None  # e.g. a GGUF file's real tensor bytes
    moe: MoESpec | None = None  # None: a dense model
    # Per layer its attention window in tokens (None: full attention); empty: every layer full.
    # A windowed layer stores and reads at most its window's KV (Mistral, Gemma 2/3's local layers).
    layer_windows: tuple[int | None, ...] = ()

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights (all experts of a MoE model): what must fit in memory."""
        if self.weight_bytes_override is not None:
            return self.weight_bytes_override
        return self.num_params * dtype_bytes(self.weight_dtype)

    @property
    def active_params(self) -> float:
        """Parameters one token computes with: all but the experts it is not routed to."""
        if self.moe is None:
            return self.num_params
        m = self.moe
        return self.num_params - m.num_moe_layers * (m.num_experts - m.top_k) * m.expert_params

    @property
    def expert_weight_bytes(self) -> float:
        """Bytes of one routed expert in one layer (0 for a dense model)."""
        if self.moe is None:
            return 0.0
        if self.weight_bytes_override is not None and self.moe.expert_bytes is not None:
            return self.moe.expert_bytes
        return self.moe.expert_params * dtype_bytes(self.weight_dtype)

    @property
    def dense_weight_bytes(self) -> float:
        """Bytes every decode step reads whatever the routing: all but the routed experts."""
        if self.moe is None:
            return self.weight_bytes
        return self.weight_bytes - self.moe.num_moe_layers * self.moe.num_experts * self.expert_weight_bytes

    def step_weight_bytes(self, experts_touched: float | None = None) -> float:
        """Weight bytes one decode step reads when each MoE layer touches `experts_touched`
        distinct experts (a dense model: all its weights)."""
        if self.moe is None:
            return self.weight_bytes
        touched = self.moe.num_experts if experts_touched is None else experts_touched
        return self.dense_weight_bytes + self.moe.num_moe_layers * touched * self.expert_weight_bytes


@dataclass
class Hardware:
    name: str
    memory_bytes: float
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s
    note: str = ""


MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8.03e9, "bf16"),
    "opt-13b": ModelSpec("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, 12.9e9, "fp16"),
}

HARDWARE_PRESETS: dict[str, Hardware] = {
    "h100": Hardware("h100", 80e9, 3.35e12, 989e12, "H100 SXM, dense BF16"),
    "h200": Hardware("h200", 141e9, 4.8e12, 989e12, "H200 SXM, dense BF16"),
    "a100-40gb": Hardware("a100-40gb", 40e9, 1.555e12, 312e12, "A100 40GB, dense BF16"),
}


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


# KV dtypes kvflow stores with one float32 scale per token, K/V and kv head (--kv-cache-dtype;
# kvflow.attention.kv_formats): `kv_bytes_per_token(..., scales=True)` counts those 4 bytes too.
SCALED_KV_DTYPES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int4")


def kv_bytes_per_token(
    model: ModelSpec, kv_dtype: str = "bf16", context: int | None = None, scales: bool = False
) -> float:
    """2 (K and V) × layers × kv_heads × head_dim × bytes per element. With `context` and sliding
    windows (`layer_windows`): the average over a sequence of `context` tokens, a windowed layer
    holding (and a decode step reading) only min(context, window) tokens of it. `scales`: a
    quantized KV dtype (SCALED_KV_DTYPES) as kvflow stores it, a 4-byte scale per head vector added."""
    per_head = model.head_dim * dtype_bytes(kv_dtype)
    if scales and str(kv_dtype).lower() in SCALED_KV_DTYPES:
        per_head += 4
    per_layer = 2 * model.num_kv_heads * per_head
    if context is None or not model.layer_windows:
        return model.num_layers * per_layer
    held = sum(context if w is None else min(context, w) for w in model.layer_windows)
    return per_layer * held / context


def estimate_params(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    vocab: int,
    gated_mlp: bool = True,
    tied: bool = False,
) -> float:
    """Parameter count of a decoder-only transformer (biases and norms ignored)."""
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = (3 if gated_mlp else 2) * hidden * ffn
    emb = vocab * hidden * (1 if tied else 2)
    return float(layers * (attn + mlp) + emb)


def _first(cfg: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def model_from_hf_config(cfg: dict, name: str = "model") -> ModelSpec:
    """ModelSpec from a HF config.json dict (Llama/Mistral/Qwen/OPT/GPT-2 style keys)."""
    cfg = {**cfg.get("text_config", {}), **cfg} if "text_config" in cfg else cfg
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    if not (layers and hidden and heads):
        raise ValueError(f"{name}: config lacks num_hidden_layers / hidden_size / num_attention_heads")
    kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads)
    head_dim = _first(cfg, "head_dim", default=hidden // heads)
    ffn = _first(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)
    vocab = _first(cfg, "vocab_size", default=32000)
    model_type = str(cfg.get("model_type", "")).lower()
    act = str(_first(cfg, "hidden_act", "activation_function", default="silu")).lower()
    gated = model_type not in ("opt", "gpt2", "gpt_neox", "gptj", "bloom", "falcon") and act in (
        "silu",
        "swiglu",
        "gelu_pytorch_tanh",
        "geglu",
    )
    tied = bool(cfg.get("tie_word_embeddings", model_type in ("opt", "gpt2")))
    moe = _experts_from_hf_config(cfg, int(layers), int(hidden), gated, name)
    if moe is None:
        params = cfg.get("num_parameters") or estimate_params(
            layers, hidden, heads, kv_heads, head_dim, ffn, vocab, gated, tied
        )
    else:  # attention + embeddings, then the MLPs layer by layer (a config's num_parameters can't be split)
        params = estimate_params(layers, hidden, heads, kv_heads, head_dim, 0, vocab, gated, tied)
        params += moe.num_moe_layers * (moe.num_experts * moe.expert_params + moe.router_params)
        params += moe.num_moe_layers * moe.shared_expert_params
        dense_layers = int(layers) - moe.num_moe_layers
        if dense_layers:
            if cfg.get("intermediate_size") is None:
                raise ValueError(f"{name}: MoE config with {dense_layers} dense MLP layers lacks intermediate_size")
            params += dense_layers * (3 if gated else 2) * int(hidden) * int(cfg["intermediate_size"])
    torch_dtype = str(_first(cfg, "torch_dtype", "dtype", default="bfloat16")).replace("torch.", "")
    wdt = torch_dtype if torch_dtype in DTYPE_BYTES else "bf16"
    return ModelSpec(
        name,
        int(layers),
        int(hidden),
        int(heads),
        int(kv_heads),
        int(head_dim),
        int(ffn),
        int(vocab),
        float(params),
        wdt,
        moe=moe,
        layer_windows=_layer_windows(cfg, int(layers), model_type),
    )


def _layer_windows(cfg: dict, layers: int, model_type: str) -> tuple[int | None, ...]:
    """Per layer its sliding window from a HF config: `layer_types`, Gemma 2 / 3's defaults
    (alternating; `sliding_window_pattern` - 1 local layers to one global), or one window on every
    layer (Mistral; Qwen only with use_sliding_window). Empty: no windows."""
    window = cfg.get("sliding_window")
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types is None and model_type.startswith("gemma2"):
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    elif types is None and model_type.startswith("gemma3"):
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if types is not None:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if model_type.startswith("qwen") and not cfg.get("use_sliding_window", False):
        return ()
    return (int(window),) * layers


def _int_key(cfg: dict, key: str, name: str, minimum: int) -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < minimum:
        raise ValueError(f"{name}: {key} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _experts_from_hf_config(cfg: dict, layers: int, hidden: int, gated: bool, name: str) -> MoESpec | None:
    """The routed experts of a HF MoE config, None for a dense one.

    Keys as HF writes them: Mixtral `num_local_experts`; Qwen2-MoE / Qwen3-MoE / OLMoE
    `num_experts`; all `num_experts_per_tok`. Expert size: `moe_intermediate_size` (Qwen2/3-MoE,
    whose `intermediate_size` is the dense MLP of non-MoE layers), else `intermediate_size`
    (Mixtral, OLMoE). Qwen2-MoE's shared expert: `shared_expert_intermediate_size`, plus its
    sigmoid gate (hidden -> 1). Layer i is MoE unless i is in `mlp_only_layers` or
    (i + 1) % `decoder_sparse_step` != 0 (HF Qwen2/3-MoE's rule). Router: hidden x E, no bias."""
    key = "num_local_experts" if cfg.get("num_local_experts") is not None else "num_experts"
    if cfg.get(key) is None:
        return None
    num_experts = _int_key(cfg, key, name, 0)
    if num_experts == 0:  # Qwen2-MoE with num_experts 0: every layer dense
        return None
    if cfg.get("num_experts_per_tok") is None:
        raise ValueError(f"{name}: MoE config ({key} = {num_experts}) lacks num_experts_per_tok")
    top_k = _int_key(cfg, "num_experts_per_tok", name, 1)
    if top_k > num_experts:
        raise ValueError(f"{name}: num_experts_per_tok = {top_k} exceeds {key} = {num_experts}")
    model_type = str(cfg.get("model_type", "")).lower()
    if cfg.get("moe_intermediate_size") is not None:
        expert_ffn = _int_key(cfg, "moe_intermediate_size", name, 1)
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        raise ValueError(f"{name}: {model_type} config lacks moe_intermediate_size (the size of one expert)")
    elif cfg.get("intermediate_size") is not None:
        expert_ffn = _int_key(cfg, "intermediate_size", name, 1)
    else:
        raise ValueError(f"{name}: MoE config lacks intermediate_size (or moe_intermediate_size), the expert size")
    step = _int_key(cfg, "decoder_sparse_step", name, 1) if cfg.get("decoder_sparse_step") is not None else 1
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, (list, tuple)) or not all(isinstance(i, int) for i in mlp_only):
        raise ValueError(f"{name}: mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
    mlp_only = set(mlp_only)
    moe_layers = sum(1 for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
    shared_ffn = 0
    if cfg.get("shared_expert_intermediate_size"):
        shared_ffn = _int_key(cfg, "shared_expert_intermediate_size", name, 0)
    mult = 3 if gated else 2
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        num_moe_layers=moe_layers,
        expert_params=float(mult * hidden * expert_ffn),
        router_params=float(hidden * num_experts),
        shared_expert_params=float(mult * hidden * shared_ffn + hidden) if shared_ffn else 0.0,
        expert_intermediate_size=expert_ffn,
        shared_expert_intermediate_size=shared_ffn,
    )


def model_from_gguf(path: str) -> ModelSpec:
    """ModelSpec from a GGUF file's metadata; weight bytes = the file's real tensor bytes."""
    from gguf import GGUFReader

    r = GGUFReader(path)

    def val(key: str, default: Any = None) -> Any:
        f = r.fields.get(key)
        return default if f is None else f.contents()

    arch = val("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: no general.architecture in the GGUF metadata")
    layers = val(f"{arch}.block_count")
    hidden = val(f"{arch}.embedding_length")
    heads = val(f"{arch}.attention.head_count")
    if not (layers and hidden and heads):
        raise ValueError(f"{path}: GGUF metadata lacks block_count / embedding_length / head_count")
    kv_heads = val(f"{arch}.attention.head_count_kv", heads)
    head_dim = val(f"{arch}.attention.key_length", hidden // heads)
    ffn = val(f"{arch}.feed_forward_length", 4 * hidden)
    vocab = val(f"{arch}.vocab_size")
    if vocab is None:
        tokens = r.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 0
    params = sum(int(t.n_elements) for t in r.tensors)
    wbytes = sum(int(t.n_bytes) for t in r.tensors)
    name = os.path.basename(path)
    moe = _experts_from_gguf(r, arch, name, val)
    return ModelSpec(
        name,
        int(layers),
        int(hidden),
        int(heads),
        int(kv_heads),
        int(head_dim),
        int(ffn),
        int(vocab),
        float(params),
        "gguf",
        weight_bytes_override=float(wbytes),
        moe=moe,
    )


def _experts_from_gguf(r: Any, arch: str, name: str, val: Any) -> MoESpec | None:
    """The routed experts of a GGUF file, from its tensors as stored (llama.cpp's 3-D
    `blk.N.ffn_{gate,up,down}_exps`, router `ffn_gate_inp`, shared expert `*_shexp`): one expert's
    parameters and real bytes are the layer's expert tensors divided by the expert count."""
    num_experts = int(val(f"{arch}.expert_count", 0) or 0)
    exps = [t for t in r.tensors if t.name.startswith("blk.") and "_exps." in t.name]
    if not num_experts or not exps:
        return None
    top_k = int(val(f"{arch}.expert_used_count", 0) or 0)
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{name}: {arch}.expert_used_count = {top_k} must be in 1..{arch}.expert_count = {num_experts}"
        )
    moe_layers = len({t.name.split(".")[1] for t in exps})
    n = moe_layers * num_experts
    exp_names = {t.name for t in exps}

    def total(pred: Any, attr: str) -> float:
        return float(sum(int(getattr(t, attr)) for t in r.tensors if pred(t.name)))

    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        num_moe_layers=moe_layers,
        expert_params=total(lambda s: s in exp_names, "n_elements") / n,
        router_params=total(lambda s: ".ffn_gate_inp." in s, "n_elements") / moe_layers,
        shared_expert_params=total(lambda s: "_shexp." in s, "n_elements") / moe_layers,
        expert_intermediate_size=int(val(f"{arch}.expert_feed_forward_length", 0) or 0),
        shared_expert_intermediate_size=int(val(f"{arch}.expert_shared_feed_forward_length", 0) or 0),
        expert_bytes=total(lambda s: s in exp_names, "n_bytes") / n,
    )


# MoE presets: the shapes of the published HF config.json files (keys as HF writes them).
MOE_PRESET_CONFIGS: dict[str, dict] = {
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1: 46.7B total, 12.9B active
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B: 30.5B total, 3.3B active
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "olmoe-1b-7b": {  # allenai/OLMoE-1B-7B-0924: 6.9B total, 1.3B active
        "model_type": "olmoe",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "intermediate_size": 1024,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "vocab_size": 50304,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
MODEL_PRESETS.update({k: model_from_hf_config(cfg, k) for k, cfg in MOE_PRESET_CONFIGS.items()})


def resolve_model(model: str | None = None, config: str | None = None) -> ModelSpec:
    """A preset name, a model folder (its config.json), a .gguf file, or `config` = a config.json."""
    if config is not None:
        if not os.path.isfile(config):
            raise ValueError(f"config file not found: {config}")
        with open(config, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{config}: not valid JSON ({e.msg})") from None
        return model_from_hf_config(cfg, os.path.basename(os.path.dirname(os.path.abspath(config))) or config)
    model = model or "llama3-8b"
    key = model.lower()
    if key in MODEL_PRESETS and not os.path.exists(model):
        return replace(MODEL_PRESETS[key])
    if os.path.isdir(model):
        cfg_path = os.path.join(model, "config.json")
        if os.path.isfile(cfg_path):
            return resolve_model(config=cfg_path)
        ggufs = sorted(n for n in os.listdir(model) if n.endswith(".gguf"))
        if ggufs:
            return model_from_gguf(os.path.join(model, ggufs[0]))
        raise ValueError(f"{model}: no config.json or .gguf file in this folder")
    if os.path.isfile(model) and model.endswith(".gguf"):
        return model_from_gguf(model)
    if key == "default":
        from kvflow.bench.datasets import default_model_gguf

        path = default_model_gguf()
        if path:
            return model_from_gguf(path)
    raise ValueError(
        f"unknown model {model!r}: give a preset ({', '.join(MODEL_PRESETS)}), "
        "a model folder, a .gguf file or --config FILE"
    )


# ----------------------------------------------------------------------------------------------
# Hardware
# ----------------------------------------------------------------------------------------------


def measure_local_hardware(copy_mb: int = 512, matmul_n: int = 1536, repeats: int = 3) -> Hardware:
    """This machine: copy bandwidth of a large torch tensor copy (bytes read + written per second,
    best of `repeats`), fp32 matmul FLOP/s (2n³ per n×n matmul, best of `repeats`), memory =
    MemAvailable from /proc/meminfo."""
    import time

    import torch

    n = copy_mb * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    bandwidth = 2 * src.numel() * 4 / best
    del src, dst
    a = torch.randn(matmul_n, matmul_n)
    b = torch.randn(matmul_n, matmul_n)
    a @ b
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    flops = 2 * matmul_n**3 / best
    mem = meminfo_bytes("MemAvailable") or meminfo_bytes("MemTotal") or 0.0
    return Hardware(
        "local",
        mem,
        bandwidth,
        flops,
        f"measured: copy bandwidth (read+write), fp32 matmul n={matmul_n}, MemAvailable; "
        f"{torch.get_num_threads()} torch threads",
    )


def resolve_hardware(
    name: str = "h100",
    bandwidth_gbps: float | None = None,
    flops_tflops: float | None = None,
    memory_gb: float | None = None,
) -> Hardware:
    key = (name or "h100").lower()
    if key == "local":
        hw = measure_local_hardware()
    elif key in HARDWARE_PRESETS:
        hw = replace(HARDWARE_PRESETS[key])
    else:
        raise ValueError(f"unknown hardware {name!r}; choose from {', '.join([*HARDWARE_PRESETS, 'local'])}")
    if bandwidth_gbps is not None:
        if bandwidth_gbps <= 0:
            raise ValueError("--bandwidth must be > 0 GB/s")
        hw.bandwidth = bandwidth_gbps * 1e9
    if flops_tflops is not None:
        if flops_tflops <= 0:
            raise ValueError("--flops must be > 0 TFLOP/s")
        hw.flops = flops_tflops * 1e12
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ValueError("--memory-gb must be > 0")
        hw.memory_bytes = memory_gb * 1e9
    return hw


# ----------------------------------------------------------------------------------------------
# The roofline
# ----------------------------------------------------------------------------------------------


@dataclass
class RooflineRow:
    batch: int
    fits: bool
    memory_needed_bytes: float
    kv_bytes: float
    memory_floor_s: float
    compute_floor_s: float
    step_s: float
    bound: str  # "memory" | "compute"
    tokens_per_s: float  # per device
    tokens_per_s_per_user: float
    cost_per_million: float
    weight_bytes_read: float = 0.0  # per step: all weights (dense), dense part + touched experts (MoE)
    experts_touched: float | None = None  # distinct experts per MoE layer this step (None: dense)


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts one MoE layer routes a batch of `batch` tokens to, each token
    picking `top_k` distinct experts of `num_experts` uniformly and independently:
    E × (1 − ((E − k) / E)^B)  (an expert escapes one token with probability (E − k)/E)."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    return num_experts * (1.0 - ((num_experts - top_k) / num_experts) ** batch)


def check_experts_touched(model: ModelSpec, batch: int, touched: float) -> float:
    """A given distinct-expert count must be possible: k (one token) <= N <= min(E, batch × k)."""
    if model.moe is None:
        raise ValueError(f"--experts-touched applies to MoE models; {model.name} is dense")
    e, k = model.moe.num_experts, model.moe.top_k
    hi = min(e, batch * k)
    if not k <= touched <= hi:
        can = f"exactly {k}" if hi == k else f"between {k} and {hi}"
        raise ValueError(
            f"--experts-touched {touched:g} at batch {batch}: a MoE layer with {e} experts, top-{k} "
            f"touches {can} distinct experts"
        )
    return float(touched)


def max_sequences(model: ModelSpec, hw: Hardware, context: int, kv_dtype: str = "bf16") -> int:
    """How many sequences of `context` tokens fit in memory after the weights (0 if none)."""
    free = hw.memory_bytes - model.weight_bytes
    per_seq = context * kv_bytes_per_token(model, kv_dtype, context)
    return max(0, int(free // per_seq)) if per_seq > 0 else 0


def decode_step(
    model: ModelSpec,
    hw: Hardware,
    batch: int,
    context: int,
    kv_dtype: str = "bf16",
    price_per_hour: float = 3.0,
    experts_touched: float | None = None,
) -> RooflineRow:
    """One decode step of `batch` sequences. A MoE model reads its dense part and, per MoE layer,
    `experts_touched` distinct experts (default: the expectation under uniform routing)."""
    kv = batch * context * kv_bytes_per_token(model, kv_dtype, context)
    touched = None
    if model.moe is not None:
        if experts_touched is None:
            touched = expected_experts_touched(model.moe.num_experts, model.moe.top_k, batch)
        else:
            touched = check_experts_touched(model, batch, experts_touched)
    elif experts_touched is not None:
        check_experts_touched(model, batch, experts_touched)
    read = model.step_weight_bytes(touched)
    mem_floor = (read + kv) / hw.bandwidth
    comp_floor = 2 * model.active_params * batch / hw.flops
    step = max(mem_floor, comp_floor)
    tps = batch / step
    return RooflineRow(
        batch=batch,
        fits=model.weight_bytes + kv <= hw.memory_bytes,
        memory_needed_bytes=model.weight_bytes + kv,
        kv_bytes=kv,
        memory_floor_s=mem_floor,
        compute_floor_s=comp_floor,
        step_s=step,
        bound="memory" if mem_floor >= comp_floor else "compute",
        tokens_per_s=tps,
        tokens_per_s_per_user=1.0 / step,
        cost_per_million=cost_per_million_tokens(price_per_hour, tps),
        weight_bytes_read=read,
        experts_touched=touched,
    )


def cost_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    return price_per_hour / (3600.0 * tokens_per_s) * 1e6


DEFAULT_BATCHES = tuple(2**i for i in range(10))  # 1 .. 512


def roofline_table(
    model: ModelSpec,
    hw: Hardware,
    context: int = 2048,
    kv_dtype: str = "bf16",
    price_per_hour: float = 3.0,
    batches: Iterable[int] = DEFAULT_BATCHES,
    experts_touched: float | Sequence[float] | None = None,
) -> list[RooflineRow]:
    """`experts_touched`: None (expected under uniform routing), one count for every batch size,
    or one per batch size (e.g. measured on real traffic)."""
    if context < 1:
        raise ValueError("--context must be >= 1")
    batches = list(batches)
    if experts_touched is None or isinstance(experts_touched, (int, float)):
        touched: list[float | None] = [experts_touched] * len(batches)
    else:
        touched = list(experts_touched)
        if len(touched) == 1:
            touched *= len(batches)
        if len(touched) != len(batches):
            raise ValueError(
                f"--experts-touched: give one count or one per batch size ({len(batches)}), got {len(touched)}"
            )
    return [decode_step(model, hw, b, context, kv_dtype, price_per_hour, t) for b, t in zip(batches, touched)]


# ----------------------------------------------------------------------------------------------
# Speculative decoding (Leviathan et al. 2023)
# ----------------------------------------------------------------------------------------------


def spec_expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per target pass: (1 − α^(γ+1)) / (1 − α)  (γ+1 when α = 1)."""
    _check_alpha(alpha, gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def spec_speedup(alpha: float, gamma: int, draft_cost: float) -> float:
    """Expected wall-time speed-up: (1 − α^(γ+1)) / ((1 − α)(γc + 1))."""
    if draft_cost < 0:
        raise ValueError("--draft-cost must be >= 0")
    return spec_expected_tokens(alpha, gamma) / (gamma * draft_cost + 1)


def _check_alpha(alpha: float, gamma: int) -> None:
    if not 0 <= alpha <= 1:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha}")
    if gamma < 0 or int(gamma) != gamma:
        raise ValueError(f"gamma must be an integer >= 0, got {gamma}")


def spec_table(alphas: Sequence[float], gammas: Sequence[int], draft_cost: float) -> list[dict]:
    return [
        {
            "alpha": a,
            "gamma": g,
            "expected_tokens": spec_expected_tokens(a, g),
            "speedup": spec_speedup(a, g, draft_cost),
        }
        for a in alphas
        for g in gammas
    ]


def rows_as_dicts(rows: Sequence[RooflineRow]) -> list[dict]:
    return [asdict(r) for r in rows]
