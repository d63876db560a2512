"""All engine configuration in one typed place, validated at start-up.

`EngineConfig` holds what the user chooses (every field is an `LLM(...)` keyword and a
`kvflow serve --flag`); `ModelConfig` holds what the checkpoint dictates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_DTYPES = ("float32", "bfloat16", "float16")
_QUANTIZATIONS = (None, "int8", "int4")
GGUF_WEIGHTS = ("native", "dequantize")
_KV_CACHE_DTYPES = ("auto", "int8")
KERNEL_AUTOTUNE_MODES = ("on", "off")
ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")


@dataclass
class EngineConfig:
    """Engine options. `None` means "derive from the model or the machine"."""

    model: str | None = None  # HF folder or .gguf file; None -> the embedded default model
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # default: the model's context length
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; overrides kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    seed: int = 0
    tokenizer: str | None = None  # default: the model's own
    enable_prefix_caching: bool = True
    # None (weights in `dtype`) | "int8" (W8A8 per-token, FBGEMM) | "int4" (4-bit blocks of 32,
    # round to nearest at load: Q4_1 for the projections, Q8_0 for the logits; the block kernels)
    quantization: str | None = None
    # A GGUF's quantized tensors: "native" (kept in their block formats and run by the block kernels,
    # where they can run: CPU, float32, one rank) or "dequantize" (float32 at load: exact HF equivalence).
    gguf_weights: str = "native"
    kv_cache_dtype: str = "auto"  # "auto" (= dtype) | "int8" (per-token, per-head scales)
    # Attention: "native" (C kernel reading the paged cache in place, CPU float32), "triton" (Triton
    # kernels reading it in place, CUDA), "torch" (gather + SDPA, any device), "auto" (triton on CUDA,
    # native on the CPU where they run, else torch).
    attention_backend: str = "auto"
    # CUDA: decode-only steps replay CUDA graphs captured at start-up for these batch sizes (a step
    # pads up to the next one; larger steps run eagerly); None: 1, 2, 4 and multiples of 8 up to
    # min(max_num_seqs, 256). enforce_eager turns the graphs off (as vLLM's --enforce-eager).
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    # Linear kernels (CPU float32 / bfloat16): "on" times the candidate paths on this CPU at the first
    # start and caches the choice (kvflow/kernels/cpu/autotune.py); "off" uses the documented default.
    kernel_autotune: str = "on"
    # Lower KV tiers for evicted prefix-cache blocks ("prefill once"); 0 / None = off.
    kv_offload_cpu_gb: float = 0.0
    kv_offload_disk_dir: str | None = None
    kv_offload_disk_gb: float = 4.0  # used only with kv_offload_disk_dir
    # Prefill/decode disaggregation, as vLLM's dict: {"kv_connector": "tcp" | "shm", "kv_role":
    # "kv_producer" | "kv_consumer" | "kv_both", ...} (see kvflow/kv_transfer/config.py); None = off.
    kv_transfer_config: dict[str, Any] | None = None
    # Tensor parallelism: each layer split over this many ranks (worker processes on this machine,
    # shared-memory or gloo all-reduces); "mp" (processes on this machine) or "ray" (Ray actors).
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "uni" for one rank, "mp" for more
    cpu_threads_per_rank: int | None = None  # None: this process's CPUs split evenly between the ranks
    # Speculative decoding, as vLLM's dict: {"method": "ngram", "num_speculative_tokens": 4, ...}
    # (see kvflow/spec_decode/config.py); None = off.
    speculative_config: dict[str, Any] | None = None
    # Structured outputs: a grammar that does not compile within this is refused (400).
    structured_outputs_compile_timeout_s: float = 10.0
    # Scheduling: fcfs | priority (lower first, aging) | slo (goodput: chunk size from slack, EDF +
    # shortest prompt, relegation, admission by predicted TTFT); see kvflow/core/sched/.
    scheduling_policy: str = "fcfs"
    fairness: str = "none"  # none | vtc (fair share of service across clients)
    default_ttft_slo_ms: float | None = None  # SLOs of requests that give none
    default_tpot_slo_ms: float | None = None
    max_queue_time_s: float | None = None  # a request never scheduled within this ends with an error
    priority_aging_s: float = 10.0  # priority: one level more important per this many seconds waited
    # slo: refuse (503) a request whose predicted TTFT exceeds this many times its TTFT SLO; None: never
    slo_admission_factor: float | None = 2.0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}")
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"gguf_weights must be one of {GGUF_WEIGHTS}, got {self.gguf_weights!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        self._check_device()
        if self.kernel_autotune not in KERNEL_AUTOTUNE_MODES:
            raise ValueError(f"kernel_autotune must be 'on' or 'off', got {self.kernel_autotune!r}")
        _positive("block_size", self.block_size)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.kv_offload_cpu_gb < 0 or self.kv_offload_disk_gb < 0:
            raise ValueError("kv_offload_cpu_gb and kv_offload_disk_gb must be >= 0")
        from kvflow.core.sched import FAIRNESS_MODES, SCHEDULING_POLICIES

        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        if self.fairness not in FAIRNESS_MODES:
            raise ValueError(f"fairness must be one of {', '.join(FAIRNESS_MODES)}, got {self.fairness!r}")
        for name in ("default_ttft_slo_ms", "default_tpot_slo_ms", "max_queue_time_s", "slo_admission_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or unset), got {value}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if not self.structured_outputs_compile_timeout_s > 0:
            raise ValueError("structured_outputs_compile_timeout_s must be > 0, got "
                             f"{self.structured_outputs_compile_timeout_s}")
        if self.speculative_config is not None:
            self.speculative()  # validate now, with a message naming the key
        if (self.kv_offload_cpu_gb > 0 or self.kv_offload_disk_dir) and not self.enable_prefix_caching:
            raise ValueError("the KV offload tiers hold prefix-cache blocks: they need enable_prefix_caching")
        self._check_parallel()
        if self.kv_transfer_config is not None:
            from kvflow.kv_transfer.config import KVTransferConfig

            KVTransferConfig.parse(self.kv_transfer_config)  # validate now, with a message naming the key
            if not self.enable_prefix_caching:
                raise ValueError("kv_transfer_config: transferred blocks are found by their prefix-cache hashes; "
                                 "it needs enable_prefix_caching")
            if self.kv_offload_cpu_gb > 0 or self.kv_offload_disk_dir:
                raise ValueError("kv_transfer_config cannot be combined with the KV offload tiers yet "
                                 "(kv_offload_cpu_gb / kv_offload_disk_dir): choose one")

    def _check_device(self) -> None:
        kind = self.device.split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {self.device!r}")
        if kind == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r} but this torch ({torch.__version__}) sees no CUDA GPU "
                                 "(a CPU-only build, or no visible device); use device='cpu'")
        if self.cuda_graph_sizes is not None:
            sizes = [int(x) for x in self.cuda_graph_sizes]
            if not sizes or min(sizes) < 1:
                raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes!r}")
            self.cuda_graph_sizes = sorted(set(sizes))

    def graph_batch_sizes(self) -> list[int]:
        """The decode batch sizes CUDA graphs are captured for (see cuda_graph_sizes)."""
        if self.cuda_graph_sizes is not None:
            return [b for b in self.cuda_graph_sizes if b <= self.max_num_seqs] or [1]
        top = min(self.max_num_seqs, 256)
        return [b for b in (1, 2, 4, *range(8, top + 1, 8)) if b <= top]

    def _check_parallel(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.cpu_threads_per_rank is not None:
            _positive("cpu_threads_per_rank", self.cpu_threads_per_rank)
        backends = (None, "uni", "mp", "ray")
        if self.distributed_executor_backend not in backends:
            raise ValueError(f"distributed_executor_backend must be one of uni, mp, ray, got "
                             f"{self.distributed_executor_backend!r}")
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        if self.distributed_executor_backend == "uni":
            raise ValueError(f"tensor_parallel_size={tp} needs worker processes: distributed_executor_backend "
                             "'mp' (or unset)")
        if self.device != "cpu":
            raise ValueError(f"tensor parallelism runs over gloo on CPU so far; device is {self.device!r}")
        unsupported = [name for name, on in (
            (f"quantization={self.quantization!r}", self.quantization not in (None, "int8")),
        ) if on]
        if unsupported:
            raise ValueError(f"tensor_parallel_size={tp} does not work with {', '.join(unsupported)} yet")

    def speculative(self):
        """The typed `SpeculativeConfig`, or None when speculation is off."""
        if self.speculative_config is None:
            return None
        from kvflow.spec_decode.config import SpeculativeConfig

        if isinstance(self.speculative_config, SpeculativeConfig):
            return self.speculative_config
        if not isinstance(self.speculative_config, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {self.speculative_config!r}")
        return SpeculativeConfig.from_dict(self.speculative_config)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {sorted(unknown)}; valid options: {sorted(cls.field_names())}"
            )
        return cls(**kwargs)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class RopeConfig:
    theta: float = 10000.0
    scaling_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
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
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window they only use when this flag is set
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
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope=_rope_from_hf(cfg),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


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


@dataclass
class ServerConfig:
    """Options of `kvflow serve` beyond the engine's (each is a --dashed-flag)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the model's name
    max_waiting_requests: int = 512  # admission control: past it, 503 + Retry-After
    max_request_body_bytes: int = 4 * 2**20
    log_interval_s: float = 5.0  # the periodic stats line while busy
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    allowed_origins: list[str] | None = None  # CORS: origins browsers may call from (None: no CORS)
    # How chat templates write tool calls: auto (from the template) | hermes | llama3_json | mistral |
    # generic (kvflow's JSON protocol, for templates without tool support)
    tool_call_parser: str = "auto"
    # Data parallelism: this many engine replicas (one process each, pinned to an even share of
    # the CPUs) behind one router on --host/--port, routed by router_policy (kvflow/router/).
    data_parallel_size: int = 1
    router_policy: str = "cache_aware"  # round_robin | least_loaded | cache_aware
    # A replica that exits while serving is restarted, at most this many times within any window
    # (a replica that keeps crashing stays out of rotation; 0: never restarted).
    replica_max_restarts: int = 3
    replica_restart_window_s: float = 300.0
    # Where the replicas run: "mp" (processes on this machine) or "ray" (Ray actors, one CPU bundle
    # each, on the cluster of RAY_ADDRESS or a local one; kvflow/router/ray_replicas.py).
    data_parallel_backend: str = "mp"

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        _positive("data_parallel_size", self.data_parallel_size)
        from kvflow.router.policies import DATA_PARALLEL_POLICIES

        if self.router_policy not in DATA_PARALLEL_POLICIES:
            raise ValueError(f"router_policy must be one of {', '.join(DATA_PARALLEL_POLICIES)}, got "
                             f"{self.router_policy!r}")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be mp or ray, got {self.data_parallel_backend!r}")
        if self.replica_max_restarts < 0 or not 0 < self.replica_restart_window_s < float("inf"):
            raise ValueError(f"replica_max_restarts must be >= 0 and replica_restart_window_s a finite number > 0, "
                             f"got {self.replica_max_restarts} and {self.replica_restart_window_s}")
        _positive("max_waiting_requests", self.max_waiting_requests)
        _positive("max_request_body_bytes", self.max_request_body_bytes)
        from kvflow.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS

        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.log_interval_s <= 0 or self.shutdown_grace_s < 0:
            raise ValueError("log_interval_s must be > 0 and shutdown_grace_s >= 0")
