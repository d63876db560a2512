"""`EngineConfig`: what the user chooses for an engine. Every field is an `LLM(...)` keyword and a
`kvflow serve --flag`; its help text and accepted values are declared here once (`option`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvflow.config.chat_template import chat_template_text
from kvflow.config.generation import check_source, read_override
from kvflow.config.kv_events import KVEventsConfig
from kvflow.config.kv_transfer import KVTransferConfig
from kvflow.config.options import check_choices, option, positive
from kvflow.config.speculative import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "int8", "int4")
GGUF_WEIGHTS = ("native", "dequantize", "auto")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int4")
# The KV dtypes stored as plain floats (no scales), whatever the model's dtype.
FLOAT_KV_CACHE_DTYPES = ("float32", "bfloat16")
# vLLM's spelling: "fp8" is fp8_e4m3 (normalized at start-up, so the rest of kvflow sees one name).
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
# The KV dtypes stored as 1-byte codes with a float32 scale per token, K/V and kv head.
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2", "int4")
MOE_EXPERT_METRICS = ("off", "per_layer", "per_expert")
KERNEL_AUTOTUNE_MODES = ("on", "off")
ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")
DISTRIBUTED_EXECUTOR_BACKENDS = (None, "uni", "mp", "ray")
# The scheduling policies and fairness modes kvflow/core/sched/ implements (it registers each under
# one of these names).
SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
FAIRNESS_MODES = ("none", "vtc")


@dataclass
class EngineConfig:
    """Engine options. `None` means "derive from the model or the machine"."""

    model: str | None = option(None, "HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    dtype: str = option("float32", "weight and KV dtype", choices=DTYPES)
    device: str = option("cpu", "torch device: cpu, cuda or cuda:N")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's context length)")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV pool size in blocks (overrides --kv-cache-memory-gb)")
    kv_cache_memory_gb: float = option(2.0, "memory for the KV pool in GiB")
    max_num_batched_tokens: int = option(2048, "token budget of one engine step (prefill chunks + decodes)")
    max_num_seqs: int = option(256, "most sequences running at once")
    max_logprobs: int = option(
        20,  # (vLLM's default)
        "most top logprobs a request may ask for (logprobs, prompt_logprobs, top_logprobs); -1: the vocabulary size",
    )
    seed: int = option(0, "seed of the engine's shared random generator")
    tokenizer: str | None = option(None, "tokenizer folder (default: the model's own)")
    enable_prefix_caching: bool = option(True, "share the KV of common prompt prefixes between requests")
    disable_hybrid_kv_cache_manager: bool = option(
        False,
        "keep every KV block of sliding-window layers (by default a windowed layer holds only its "
        "window's blocks; turn this on to compare, or for KV connectors, which need the full layout)",
    )
    quantization: str | None = option(
        None,
        "weight quantization: int8 (W8A8, per-channel weights, per-token activations, FBGEMM), "
        "int4 (4-bit blocks of 32 with scale and offset, GGML's Q4_1 for the projections and Q8_0 for the "
        "logits, rounded at load; block kernels) or unset (weights in --dtype)",
        choices=QUANTIZATIONS,
    )
    gguf_weights: str = option(
        "native",
        "a GGUF's quantized tensors: native (kept in their block formats and run by the block "
        "kernels where they can run: CPU, float32, one rank), dequantize (float32 at load: exact HF "
        "equivalence) or auto (measured at the first start on this CPU: the blocks, or float32, or "
        "bfloat16 where the CPU multiplies bf16 natively, whichever computes a 64-request decode step "
        "fastest; bfloat16 sets --dtype and rounds the weights; needs --dtype float32, the default)",
        choices=GGUF_WEIGHTS,
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache dtype: auto (= --dtype; bfloat16 where a GGUF's blocks run as stored, as llama.cpp keeps "
        "its cache in 16 bits), float32, bfloat16, int8, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2 or int4 (two "
        "values a byte); the quantized ones keep one float32 scale per token, K/V and kv head (no calibration)",
        choices=KV_CACHE_DTYPES,
    )
    attention_sinks: int = option(
        0,
        "StreamingLLM: keep the KV of a sequence's first N tokens (rounded up to whole KV blocks) plus "
        "the recent --attention-window, dropping the blocks between, so a request generates past "
        "max_model_len with constant KV; positions roll inside the cache (see "
        "docs/features/attention_sinks.md). 0 with --attention-window set: the window alone",
    )
    attention_window: int | None = option(
        None,
        "StreamingLLM: the recent tokens kept besides the sink blocks (at least one KV block); the cache "
        "then holds at most sink blocks + this many tokens (default with --attention-sinks: max_model_len "
        "less the sink blocks)",
    )
    moe_expert_metrics: str = option(
        "per_layer",
        "Mixture-of-Experts routing metrics: per_layer (tokens routed and load imbalance per MoE layer: a "
        "series per layer), per_expert (also tokens per layer and expert: layers x experts series, e.g. "
        "48 x 128 = 6144) or off (nothing counted, no per-step work)",
        choices=MOE_EXPERT_METRICS,
    )
    attention_backend: str = option(
        "auto",
        "attention: native (C++ kernel reading the paged cache in place, CPU), triton (Triton "
        "kernels reading it in place, CUDA), torch (gather + SDPA, any device) or auto (triton on CUDA, "
        "native on the CPU where it runs, else torch)",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = option(False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    cuda_graph_sizes: list[int] | None = option(
        None,
        "CUDA: decode batch sizes to capture graphs for, comma-separated; a decode step pads up to "
        "the next one, larger steps run eagerly (default: 1, 2, 4 and multiples of 8 up to "
        "min(max_num_seqs, 256))",
    )
    kernel_autotune: str = option(
        "on",
        "on: time the linear kernel paths on this CPU at the first start and cache the choice (a "
        "few seconds, once); off: the documented default choice",
        choices=KERNEL_AUTOTUNE_MODES,
    )
    # Lower KV tiers for evicted prefix-cache blocks ("prefill once").
    kv_offload_cpu_gb: float = option(0.0, "CPU-memory tier for evicted prefix-cache blocks, GiB (0 = off)")
    kv_offload_disk_dir: str | None = option(
        None, "directory of the disk tier for evicted prefix-cache blocks (kept across runs)"
    )
    kv_offload_disk_gb: float = option(4.0, "size limit of the disk tier, GiB (with --kv-offload-disk-dir)")
    kv_transfer_config: dict[str, Any] | None = option(
        None,
        'prefill/decode disaggregation as a JSON object, e.g. \'{"kv_connector": "tcp", '
        '"kv_role": "kv_producer"}\' (keys: kv_connector tcp|shm, kv_role '
        "kv_producer|kv_consumer|kv_both, kv_ip, kv_port, kv_lease_s, kv_transfer_timeout_s, "
        "kv_load_failure_policy recompute|fail, engine_id; see KVTransferConfig)",
    )
    kv_events_config: dict[str, Any] | None = option(
        None,
        "KV cache events (blocks stored / removed / all cleared, with their hashes, token ids and "
        "medium) published over ZMQ, as a JSON object in vLLM's shape, e.g. '{\"enable_kv_cache_events\": "
        'true, "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}\' (keys: '
        "enable_kv_cache_events, publisher zmq|null, endpoint, replay_endpoint, buffer_steps, hwm, "
        "max_queue_size, topic; see docs/features/kv_cache_and_tiers.md)",
    )
    step_record_capacity: int = option(
        4096,
        "steps kept in the ring of step records that GET /debug/requests/{id} explains requests from "
        "(and as many recent requests); 0 turns the records off (see docs/operations/diagnosis.md)",
    )
    tensor_parallel_size: int = option(
        1,
        "split every layer over this many ranks (worker processes on this machine, all-reduce over "
        "shared memory or gloo, whichever measures faster); a Mixture-of-Experts model's experts are "
        "split inside, or partitioned whole with --enable-expert-parallel",
    )
    enable_expert_parallel: bool = option(
        False,
        "Mixture-of-Experts models under --tensor-parallel-size N: partition the experts over the N ranks "
        "(each holds and computes a contiguous range of whole experts; with E experts the first E mod N "
        "ranks hold one more) instead of splitting every expert's width; attention stays tensor-parallel",
    )
    distributed_executor_backend: str | None = option(
        None,
        "uni (one rank), mp (a process per rank, the default for TP > 1) or ray (Ray actors in a "
        "placement group; RAY_ADDRESS joins a cluster)",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    cpu_threads_per_rank: int | None = option(
        None, "torch threads (and pinned CPUs) per tensor-parallel rank (default: this process's CPUs split evenly)"
    )
    speculative_config: dict[str, Any] | None = option(
        None,
        'speculative decoding as a JSON object, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (keys: method, num_speculative_tokens, prompt_lookup_min, '
        "prompt_lookup_max, model, quantization, adaptive; see SpeculativeConfig)",
    )
    structured_outputs_compile_timeout_s: float = option(
        10.0, "structured outputs: a grammar that does not compile within this many seconds is refused (400)"
    )
    scheduling_policy: str = option(
        "fcfs",
        "fcfs | priority (lower first, with aging) | slo (goodput: chunk size from slack, EDF + "
        "shortest prompt, relegation, admission by predicted TTFT)",
        choices=SCHEDULING_POLICIES,
    )
    fairness: str = option("none", "none | vtc (a fair share of service across clients)", choices=FAIRNESS_MODES)
    pooling: str = option(
        "last",
        "embeddings (/v1/embeddings, LLM.embed): pool the final hidden states of the prompt by its last "
        "token or by the mean over all its tokens (then L2-normalised)",
        choices=("last", "mean"),
    )
    chat_template: str | None = option(
        None,
        "the chat template (a Jinja file's path, or the template itself) instead of the model's own: "
        "for a model without one, or a template with tool support (as vLLM's --chat-template)",
    )
    generation_config: str = option(
        "auto",
        "default sampling parameters of requests that leave them out: auto (the model folder's "
        "generation_config.json: its temperature, top_p, top_k, min_p and repetition_penalty, as vLLM), "
        "vllm (the API's own defaults), or a folder holding a generation_config.json",
    )
    override_generation_config: dict[str, Any] | None = option(
        None,
        "default sampling parameters as a JSON object, over --generation-config's, e.g. "
        '\'{"temperature": 0.6, "top_p": 0.95}\' (keys: temperature, top_p, top_k, min_p, repetition_penalty)',
    )
    default_ttft_slo_ms: float | None = option(None, "TTFT SLO of requests that give none, ms")
    default_tpot_slo_ms: float | None = option(None, "TPOT SLO of requests that give none, ms")
    max_queue_time_s: float | None = option(None, "a request not scheduled within this many seconds ends with an error")
    priority_aging_s: float = option(
        10.0, "priority policy: a waiting request becomes one level more important per this many seconds"
    )
    slo_admission_factor: float | None = option(
        2.0,
        "slo policy: refuse (503) a request whose predicted TTFT exceeds this many times its TTFT SLO (unset: never)",
    )

    # Multi-LoRA serving (kvflow.lora; docs/features/lora.md), as vLLM names the flags.
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) over the base model, many in one batch")
    lora_modules: list[str] | None = option(
        None,
        "adapters known at start-up, name=path (space- or comma-separated); a request selects one by "
        "its name in the `model` field (needs --enable-lora)",
    )
    max_loras: int = option(1, "most distinct LoRA adapters in one batch (resident slots)")
    max_lora_rank: int = option(16, "highest LoRA rank accepted; an adapter with a higher rank is refused at load")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept loaded in CPU memory, resident or not (default: --max-loras; >= --max-loras)"
    )

    def __post_init__(self) -> None:
        check_choices(self)
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        self._check_device()
        positive("block_size", self.block_size)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("max_num_seqs", self.max_num_seqs)
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be -1 (the vocabulary size) or an integer >= 0, got {self.max_logprobs!r}"
            )
        if self.step_record_capacity < 0:
            raise ValueError(f"step_record_capacity must be >= 0, got {self.step_record_capacity}")
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_model_len is not None:
            positive("max_model_len", self.max_model_len)
        if self.kv_offload_cpu_gb < 0 or self.kv_offload_disk_gb < 0:
            raise ValueError("kv_offload_cpu_gb and kv_offload_disk_gb must be >= 0")
        for name in ("default_ttft_slo_ms", "default_tpot_slo_ms", "max_queue_time_s", "slo_admission_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or unset), got {value}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if not self.structured_outputs_compile_timeout_s > 0:
            raise ValueError(
                f"structured_outputs_compile_timeout_s must be > 0, got {self.structured_outputs_compile_timeout_s}"
            )
        if self.chat_template is not None:
            chat_template_text(self.chat_template)  # a file or a template (the engine compiles it)
        check_source(self.generation_config)
        self.override_generation_config = read_override(self.override_generation_config)
        if self.speculative_config is not None:
            self.speculative()  # validate now, with a message naming the key
        if (self.kv_offload_cpu_gb > 0 or self.kv_offload_disk_dir) and not self.enable_prefix_caching:
            raise ValueError("the KV offload tiers hold prefix-cache blocks: they need enable_prefix_caching")
        if self.gguf_weights == "auto" and self.dtype != "float32":
            raise ValueError(
                f"gguf_weights='auto' chooses the dtype itself (float32 or bfloat16), got dtype={self.dtype!r}: "
                "leave dtype at float32, or choose gguf_weights='dequantize' to run the GGUF in that dtype"
            )
        self._check_parallel()
        self._check_lora()
        self._check_attention_sinks()
        if self.kv_events_config is not None:
            self.kv_events()  # validate now, with a message naming the key
        if self.kv_transfer_config is not None:
            self.kv_transfer()  # validate now, with a message naming the key
            if not self.enable_prefix_caching:
                raise ValueError(
                    "kv_transfer_config: transferred blocks are found by their prefix-cache hashes; "
                    "it needs enable_prefix_caching"
                )
            if self.kv_offload_cpu_gb > 0 or self.kv_offload_disk_dir:
                raise ValueError(
                    "kv_transfer_config cannot be combined with the KV offload tiers yet "
                    "(kv_offload_cpu_gb / kv_offload_disk_dir): choose one"
                )

    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as name -> path (checked by `_check_lora`)."""
        out: dict[str, str] = {}
        for item in self.lora_modules or []:
            name, sep, path = str(item).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules entries must be name=path, got {item!r}")
            if name.strip() in out:
                raise ValueError(f"lora_modules names {name.strip()!r} twice")
            out[name.strip()] = path.strip()
        return out

    def _check_lora(self) -> None:
        positive("max_loras", self.max_loras)
        positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None:
            positive("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(
                    f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                    "resident adapters are kept in CPU memory too"
                )
        if isinstance(self.lora_modules, str):
            self.lora_modules = self.lora_modules.replace(",", " ").split()
        modules = self.lora_module_paths()
        if not self.enable_lora:
            if modules:
                raise ValueError("lora_modules needs enable_lora (--enable-lora)")
            return
        # What does not compose with adapters yet: refused here rather than served wrongly.
        conflicts = [
            (self.tensor_parallel_size > 1, "tensor_parallel_size > 1 (adapters are not sharded yet)"),
            (
                (self.speculative() is not None and self.speculative().method == "draft_model"),
                "a draft-model speculative_config (the draft model has no adapters; use method ngram)",
            ),
            (
                self.kv_transfer_config is not None,
                "kv_transfer_config (transferred blocks carry no adapter identity yet)",
            ),
            (
                self.kv_offload_cpu_gb > 0 or self.kv_offload_disk_dir is not None,
                "the KV offload tiers (their keys carry no adapter identity yet)",
            ),
            (self.quantization is not None, f"quantization={self.quantization!r} (adapters run over float weights)"),
            (self.device.startswith("cuda"), "device cuda (the LoRA path is checked on the CPU only so far)"),
        ]
        bad = [why for on, why in conflicts if on]
        if bad:
            raise ValueError("enable_lora is not supported with " + "; ".join(bad) + " yet")

    @property
    def cpu_loras(self) -> int:
        """--max-cpu-loras, resolved (default: --max-loras)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def streaming_kv(self) -> bool:
        """Attention sinks / a recent window evict KV (StreamingLLM): see kvflow.core.attention_sinks."""
        return self.attention_sinks > 0 or self.attention_window is not None

    def _check_attention_sinks(self) -> None:
        if (
            isinstance(self.attention_sinks, bool)
            or not isinstance(self.attention_sinks, int)
            or self.attention_sinks < 0
        ):
            raise ValueError(f"attention_sinks must be an integer >= 0, got {self.attention_sinks!r}")
        if self.attention_window is not None:
            positive("attention_window", self.attention_window)
            if self.attention_window < self.block_size:
                raise ValueError(
                    f"attention_window ({self.attention_window}) must hold at least one KV block "
                    f"(block_size {self.block_size})"
                )
        if not self.streaming_kv:
            return
        # Evicting a block re-rotates the keys of the blocks after it in place: those blocks can be
        # neither shared nor moved as they were hashed, and their keys must be floats.
        conflicts = [
            (
                self.enable_prefix_caching,
                "enable_prefix_caching (re-rotated blocks cannot be shared; pass "
                "enable_prefix_caching=False / --no-enable-prefix-caching)",
            ),
            (self.speculative_config is not None, "speculative_config (drafts would cross evictions)"),
            (self.kv_transfer_config is not None, "kv_transfer_config (blocks move by their prefix hashes)"),
            (
                self.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES,
                f"kv_cache_dtype={self.kv_cache_dtype!r} (keys are re-rotated in the model dtype)",
            ),
            (self.tensor_parallel_size > 1, "tensor_parallel_size > 1 (not wired to the worker ranks yet)"),
        ]
        bad = [why for on, why in conflicts if on]
        if bad:
            raise ValueError("attention_sinks / attention_window cannot be combined with " + "; ".join(bad))

    def _check_device(self) -> None:
        kind = self.device.split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {self.device!r}")
        if kind == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    f"device={self.device!r} but this torch ({torch.__version__}) sees no CUDA GPU "
                    "(a CPU-only build, or no visible device); use device='cpu'"
                )
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
        positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.cpu_threads_per_rank is not None:
            positive("cpu_threads_per_rank", self.cpu_threads_per_rank)
        tp = self.tensor_parallel_size
        if self.enable_expert_parallel and tp == 1:
            raise ValueError(
                "enable_expert_parallel partitions the experts over the tensor-parallel ranks: it needs "
                "tensor_parallel_size > 1 (got 1)"
            )
        if tp == 1:
            return
        if self.distributed_executor_backend == "uni":
            raise ValueError(
                f"tensor_parallel_size={tp} needs worker processes: distributed_executor_backend 'mp' (or unset)"
            )
        if self.device != "cpu":
            raise ValueError(f"tensor parallelism runs over gloo on CPU so far; device is {self.device!r}")
        unsupported = [
            name
            for name, on in ((f"quantization={self.quantization!r}", self.quantization not in (None, "int8")),)
            if on
        ]
        if unsupported:
            raise ValueError(f"tensor_parallel_size={tp} does not work with {', '.join(unsupported)} yet")

    def speculative(self) -> SpeculativeConfig | None:
        """The typed `SpeculativeConfig`, or None when speculation is off."""
        if self.speculative_config is None:
            return None
        if isinstance(self.speculative_config, SpeculativeConfig):
            return self.speculative_config
        if not isinstance(self.speculative_config, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {self.speculative_config!r}")
        return SpeculativeConfig.from_dict(self.speculative_config)

    def kv_transfer(self) -> KVTransferConfig | None:
        """The typed `KVTransferConfig`, or None when disaggregation is off."""
        if self.kv_transfer_config is None:
            return None
        return KVTransferConfig.parse(self.kv_transfer_config)

    def kv_events(self) -> KVEventsConfig | None:
        """The typed `KVEventsConfig`, or None when no events are published."""
        if self.kv_events_config is None:
            return None
        return KVEventsConfig.parse(self.kv_events_config)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; valid options: {sorted(cls.field_names())}")
        return cls(**kwargs)
