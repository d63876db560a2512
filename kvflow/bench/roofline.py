"""Back-of-the-envelope decode roofline: KV size, memory fit, step-time floors, cost, spec-decode gains.

All pure functions (no torch) except `measure_local_hardware`. Units: bytes, seconds, FLOP/s,
bytes/s; GB = 1e9 bytes.

Decode step of `batch` sequences, each holding `context` tokens of KV:
    memory floor  = (weight bytes + batch × context × KV bytes/token) / bandwidth
    compute floor = 2 × params × batch / FLOP/s          (matmul FLOPs only, attention ignored)
    step time     = max(memory floor, compute floor)
    tokens/s      = batch / step time           (per device)
    $ per 1M tok  = price per hour / (3600 × tokens/s) × 1e6
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

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

    @property
    def weight_bytes(self) -> float:
        if self.weight_bytes_override is not None:
            return self.weight_bytes_override
        return self.num_params * dtype_bytes(self.weight_dtype)


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


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str = "bf16") -> float:
    """2 (K and V) × layers × kv_heads × head_dim × bytes per element."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes(kv_dtype)


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
    params = cfg.get("num_parameters") or estimate_params(
        layers, hidden, heads, kv_heads, head_dim, ffn, vocab, gated, tied
    )
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
    )


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


def _meminfo_bytes(field: str = "MemAvailable") -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
    mem = _meminfo_bytes("MemAvailable") or _meminfo_bytes("MemTotal") or 0.0
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


def max_sequences(model: ModelSpec, hw: Hardware, context: int, kv_dtype: str = "bf16") -> int:
    """How many sequences of `context` tokens fit in memory after the weights (0 if none)."""
    free = hw.memory_bytes - model.weight_bytes
    per_seq = context * kv_bytes_per_token(model, kv_dtype)
    return max(0, int(free // per_seq)) if per_seq > 0 else 0


def decode_step(
    model: ModelSpec, hw: Hardware, batch: int, context: int, kv_dtype: str = "bf16", price_per_hour: float = 3.0
) -> RooflineRow:
    kv = batch * context * kv_bytes_per_token(model, kv_dtype)
    mem_floor = (model.weight_bytes + kv) / hw.bandwidth
    comp_floor = 2 * model.num_params * batch / hw.flops
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
) -> list[RooflineRow]:
    if context < 1:
        raise ValueError("--context must be >= 1")
    return [decode_step(model, hw, b, context, kv_dtype, price_per_hour) for b in batches]


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
