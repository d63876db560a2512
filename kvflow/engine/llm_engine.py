"""The engine loop: add_request / step / abort. The offline `LLM` and the HTTP server drive
this same object (the server from its own thread)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvflow.config import QUANTIZED_KV_CACHE_DTYPES, EngineConfig
from kvflow.config.generation import default_sampling
from kvflow.core.attention_sinks import StreamingKV
from kvflow.core.kv_cache_manager import KVCacheManager, cdiv
from kvflow.core.kv_groups import kv_layout, refusal, requests_that_fit
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched import VirtualTokenCounter, make_policy
from kvflow.core.scheduler import KVMemoryStats, Scheduler, SchedulerOutput
from kvflow.core.step_cost import StepCostModel
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.slo_tracker import SLOStats, SLOTracker
from kvflow.engine.step_records import StepRecords
from kvflow.executor import Executor
from kvflow.kv_events.events import KVEventBatch, KVEventSink
from kvflow.kv_transfer.base import KVConnectorScheduler
from kvflow.lora.request import LoRARequest
from kvflow.lora.stats import LoRAStats
from kvflow.models.chat_template import read_chat_template
from kvflow.outputs import RequestMetrics, RequestOutput
from kvflow.sample.bad_words import bad_word_sequences
from kvflow.sampling_params import MAX_EXPERT_TRACE_ENTRIES, SamplingParams, check_text
from kvflow.structured_output.manager import StructuredOutputManager, StructuredOutputStats
from kvflow.utils.validation import is_int

if TYPE_CHECKING:
    from kvflow.kv_events.publisher import KVEventPublisher
    from kvflow.kv_transfer.offload_store import OffloadStats
    from kvflow.kv_transfer.pd import KVTransferStats
    from kvflow.layers.moe import MoeRoutingStats
    from kvflow.spec_decode.speculator import SpecDecodeStats
    from kvflow.worker.model_runner import KVCacheSpec

logger = logging.getLogger("kvflow")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    peak_kv_cache_usage: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # (request, step) pairs that produced tokens: generation tokens / this = tokens per target pass
    sampling_rows_total: int
    num_steps: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found (in the pool or an offload tier)
    kv_memory: KVMemoryStats
    # Averaged over steps: tokens stored / slots in held blocks, and / a contiguous reservation.
    kv_utilization_mean: float
    kv_utilization_contiguous_mean: float
    kv_offload: OffloadStats | None = None
    kv_transfer: KVTransferStats | None = None
    spec_decode: SpecDecodeStats | None = None
    structured_output: StructuredOutputStats | None = None
    slo: SLOStats | None = None
    step_cost_error: float | None = None  # median relative error of the step-time predictions
    linear_kernels: str = ""  # the linear paths in use (the kernel autotune's choices)
    # A Mixture-of-Experts model's routing: tokens per layer (and expert), load imbalance (None: a
    # dense model, or moe_expert_metrics="off")
    moe: MoeRoutingStats | None = None
    # What the pool holds at most: max_model_len requests decoding at once x their length with
    # sliding-window layers holding only their window, else its blocks' slots (see _num_blocks).
    kv_capacity_tokens: int = 0
    lora: LoRAStats | None = None  # LoRA adapters (--enable-lora; None: off)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


MAX_CACHE_SALT_CHARS = 1024


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens (vLLM's): the prompt's last `keep` tokens (-1: max_model_len)."""
    if keep is None:
        return prompt_ids
    if keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({max_model_len}); "
            "give at most max_model_len, or -1 for it"
        )
    return prompt_ids[-(max_model_len if keep == -1 else keep) :]


def check_cache_salt(salt: object) -> None:
    """A cache salt is a non-empty string of at most MAX_CACHE_SALT_CHARS characters (or None)."""
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS):
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from kvflow.models.loader import gguf_block_weights, load_checkpoint
        from kvflow.worker import gguf_weights

        config = gguf_weights.resolve(config)  # (--gguf-weights auto: measured, then native or dequantize)
        self.block_weights = gguf_block_weights(config)
        ckpt = load_checkpoint(config.model, config.tokenizer, keep_blocks=self.block_weights)
        if ckpt.block_quantized and config.kv_cache_dtype == "auto":
            # A GGUF's blocks run as stored keep K/V in 16 bits, as llama.cpp does with the same
            # file: half of float32's KV bytes per token (twice the tokens in the same pool) and half
            # the bytes a decode step's attention reads. --kv-cache-dtype float32 keeps float32.
            config = replace(config, kv_cache_dtype="bfloat16")
            logger.info("KV cache in bfloat16 (GGUF blocks run as stored; --kv-cache-dtype float32 for float32)")
        self.config = config
        self.model_name = ckpt.name
        self.model_path = ckpt.path
        self.model_config = ckpt.model_config
        self.tokenizer = ckpt.tokenizer
        if config.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("chat_template: this model has no tokenizer to render a chat template with")
            self.tokenizer.chat_template = read_chat_template(config.chat_template)
        self.max_model_len = self._resolve_max_model_len()
        # The most top logprobs a request may ask for (--max-logprobs; -1: the whole vocabulary)
        vocab = self.model_config.vocab_size
        self.max_logprobs = vocab if config.max_logprobs == -1 else min(config.max_logprobs, vocab)
        self.streaming = self._streaming_kv()  # attention sinks (None: off)
        self.eos_token_ids = self._eos_ids(ckpt.generation_config)
        # Requests' default sampling parameters (--generation-config): what a request leaves out
        self.default_sampling = default_sampling(
            config.generation_config,
            ckpt.generation_config,
            config.override_generation_config,
            lambda values: SamplingParams(**values),
        )
        if self.default_sampling:
            logger.info("default sampling parameters from the generation config: %s", self.default_sampling)

        # The pool is sized from one rank's KV bytes per token (the worker's answer: under tensor
        # parallelism each rank holds its share of the KV heads); the runners then allocate it.
        kv_spec = Executor.kv_cache_spec(self.model_config, config)
        self.kv_bytes_per_token = kv_spec.bytes_per_token
        # Which layers share block tables: sliding-window layers hold only their window (kv_groups).
        self.kv_layout = kv_layout(self.model_config, config.disable_hybrid_kv_cache_manager, self.max_model_len)
        why = refusal(self.kv_layout, config)
        if why is not None:
            raise ValueError(why)
        self.num_kv_blocks = self._num_blocks(kv_spec)
        self.executor = Executor.create(config, ckpt, self.max_model_len, self.num_kv_blocks)
        self.runner = self.executor.runner
        from kvflow.kv_transfer.factory import make_kv_connector

        # What moves KV in and out of the pool (offload tiers, another engine): one connector, split
        # into its scheduler side and the executor's worker side (whose block reads and writes
        # reach every tensor-parallel rank).
        self.kv_connector, self.executor.kv_connector = make_kv_connector(
            config, self._kv_identity(ckpt), self.executor.kv_io, self.model_config.num_layers
        )
        # KV cache events (--kv-events-config): the pool, the manager and the offload tiers report
        # into one sink; each step's events go to the publisher as one batch. None: off, no work.
        self.kv_events: KVEventSink | None = None
        self.kv_event_publisher: KVEventPublisher | None = None
        events_config = config.kv_events()
        if events_config is not None and events_config.enabled:
            from kvflow.kv_events.publisher import make_publisher

            self.kv_event_publisher = make_publisher(events_config)
            self.kv_events = KVEventSink()
            self.kv_events.cleared()  # the first batch says: this engine's cache starts empty
        self.kv_cache = KVCacheManager(
            self.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            events=self.kv_events,
            layout=self.kv_layout,
        )
        # One model of step times, learned from every step: the speculator and the slo policy predict with it.
        self.step_cost = StepCostModel()
        self.step_cost.decode_pass = self.executor.decode_pass()
        policy = make_policy(
            config.scheduling_policy,
            self.step_cost,
            config.max_num_batched_tokens,
            config.priority_aging_s,
            config.slo_admission_factor,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            policy,
            VirtualTokenCounter() if config.fairness == "vtc" else None,
            config.max_queue_time_s,
            connector=self.kv_connector,
            streaming=self.streaming,
            max_loras=config.max_loras if config.enable_lora else None,
        )
        # LoRA adapters by name (--enable-lora): --lora-modules now, load_lora / unload_lora later.
        self.loras: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        for name, path in config.lora_module_paths().items():
            self.load_lora(name, path)
        moe = self.model_config.moe
        # the decoder layers that route (expert traces are per MoE layer)
        self.moe_layers = [] if moe is None else [i for i in range(self.model_config.num_layers) if moe.is_sparse(i)]
        self.output_processor = OutputProcessor(self.tokenizer, self.moe_layers)
        # Grammars for structured outputs; the compiler is built on first use (or warm_up()).
        self.structured = (
            None
            if self.tokenizer is None
            else StructuredOutputManager(
                self.tokenizer,
                self.model_config.vocab_size,
                self.eos_token_ids,
                config.structured_outputs_compile_timeout_s,
            )
        )
        spec = config.speculative()
        self.speculator = None
        if spec is not None:
            from kvflow.spec_decode.speculator import Speculator

            proposer = None
            if spec.method == "draft_model":
                from kvflow.spec_decode.draft_model import DraftModelProposer

                proposer = DraftModelProposer.create(
                    config, spec, self.model_config.vocab_size, self.max_model_len, self.num_kv_blocks, self.tokenizer
                )
            self.speculator = Speculator(spec, proposer, cost=self.step_cost)
        self.slo = SLOTracker()
        # The ring of step records that GET /debug/requests/{id} explains requests from.
        self.step_records = StepRecords(config.step_record_capacity)
        self._children: dict[str, list[str]] = {}
        self._ids = itertools.count()
        self._shut_down = False
        self._peak_usage = 0.0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._sampling_rows = 0  # (request, step) pairs that produced tokens
        self._steps = 0
        self._util_sum = self._util_contig_sum = 0.0
        self._util_steps = 0
        self._publish_kv_events()  # AllBlocksCleared (and a disk tier's blocks): batch 0

    # ---- start-up checks -----------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        mc, want = self.model_config, self.config.max_model_len
        limit = mc.max_position_embeddings
        if want is None:
            want = limit
        elif want > limit:
            raise ValueError(f"max_model_len={want} exceeds the model's context length {limit}")
        if mc.sliding_window is not None and mc.sliding_window < want:
            logger.warning("sliding window %d < max_model_len %d: attention is windowed", mc.sliding_window, want)
        return want

    def _streaming_kv(self) -> StreamingKV | None:
        """The attention-sink policy (--attention-sinks / --attention-window), for a model that
        attends to its whole context (a sliding window inside the cache's length would not see the
        sinks)."""
        cfg, mc = self.config, self.model_config
        if not cfg.streaming_kv:
            return None
        windows = [w for w in (mc.sliding_window, *mc.layer_windows) if w is not None]
        if windows and min(windows) < self.max_model_len:
            raise ValueError(
                f"attention_sinks / attention_window are for models without a sliding window; "
                f"{mc.architecture} attends within {min(windows)} tokens already (< max_model_len "
                f"{self.max_model_len}): serve it without them"
            )
        policy = StreamingKV.create(cfg.attention_sinks, cfg.attention_window, cfg.block_size, self.max_model_len)
        logger.info(
            "attention sinks: %d sink tokens (%d blocks) + a window of %d tokens: at most %d KV blocks "
            "per request, generation past max_model_len",
            cfg.attention_sinks,
            policy.sink_blocks,
            policy.window,
            policy.max_blocks,
        )
        return policy

    def _eos_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        gen_eos = generation_config.get("eos_token_id")
        ids.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _num_blocks(self, kv: KVCacheSpec) -> int:
        """Blocks (pages, with a hybrid layout: one block of `slots` layers each) in the pool, with
        what they hold logged: the tokens, or with sliding windows the max_model_len requests that
        fit at once, against keeping every block in the same memory."""
        cfg, layout = self.config, self.kv_layout
        bs = cfg.block_size
        block_bytes = bs * kv.bytes_per_token // kv.num_layers * layout.slots
        num = cfg.num_kv_blocks or int(cfg.kv_cache_memory_gb * 2**30 // block_bytes)
        usable = num - layout.frees_blocks  # (NULL_BLOCK is reserved)
        chunk = min(cfg.max_num_batched_tokens, self.max_model_len)
        needed = layout.blocks_held(self.max_model_len, bs, chunk)
        if layout.num_groups == 1:
            logger.info(
                "KV cache: %d bytes/token (2 x %d layers x %d kv heads x %d head_dim x %s), "
                "%d blocks of %d tokens = %d tokens, %.2f GiB",
                kv.bytes_per_token,
                kv.num_layers,
                kv.num_kv_heads,
                kv.head_dim,
                kv.per_value,
                num,
                bs,
                num * bs,
                num * block_bytes / 2**30,
            )
        else:  # a block is one block of `slots` layers, which one depends on the group holding it
            logger.info(
                "KV cache: %d bytes per token and layer (2 x %d kv heads x %d head_dim x %s), "
                "%d blocks of %d tokens x %d layers, %.2f GiB",
                kv.bytes_per_token // kv.num_layers,
                kv.num_kv_heads,
                kv.head_dim,
                kv.per_value,
                num,
                bs,
                layout.slots,
                num * block_bytes / 2**30,
            )
        # Tokens that fit: without windows the pool's slots; with them, max_model_len requests
        # decoding at once (each its full-attention blocks and its windows) times their length.
        fit = requests_that_fit(layout, usable, self.max_model_len, bs, 1)
        self.kv_capacity_tokens = fit * self.max_model_len if layout.frees_blocks else num * bs
        if layout.frees_blocks:
            full = int(num * block_bytes // (bs * kv.bytes_per_token)) // cdiv(self.max_model_len, bs)
            logger.info(
                "KV cache: sliding-window layers hold only their window (%s; blocks of %d layers): %d requests "
                "of max_model_len=%d tokens fit at once while decoding = %d tokens (%d keeping every block of "
                "every layer in the same memory, --disable-hybrid-kv-cache-manager); a request holds at most "
                "%d blocks, at the prefill chunk (%d tokens) that reaches max_model_len",
                layout.describe(),
                layout.slots,
                fit,
                self.max_model_len,
                self.kv_capacity_tokens,
                full,
                needed,
                chunk,
            )
        if usable < needed:
            raise ValueError(
                f"the KV cache holds {num * bs} tokens ({num} blocks of {bs}) but one "
                f"request of max_model_len={self.max_model_len} tokens needs {needed} blocks "
                f"({needed * block_bytes / 2**30:.3f} GiB); raise kv_cache_memory_gb or num_kv_blocks, "
                f"or lower max_model_len"
            )
        return num

    def _kv_identity(self, ckpt) -> bytes:
        """What makes KV blocks interchangeable between runs and engines: the same weights, dtypes
        and block geometry."""
        import json

        cfg = self.config
        return json.dumps(
            [
                ckpt.name,
                ckpt.hf_config,
                os.path.getsize(ckpt.path) if os.path.isfile(ckpt.path) else None,
                cfg.dtype,
                cfg.kv_cache_dtype,
                cfg.quantization,
                self.block_weights,
                cfg.block_size,
                # quantized blocks are serialized per rank (codes, then scales, of its heads)
                cfg.tensor_parallel_size if cfg.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES else 1,
            ],
            sort_keys=True,
            default=str,
        ).encode()

    # ---- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            check_text(prompt, "the prompt")
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if not isinstance(prompt, (list, tuple)) or not all(is_int(t) for t in prompt):
            raise ValueError(f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        client: str | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input, or
        AdmissionRejected when the scheduling policy refuses it (and then changes nothing).
        `client`: who sent it (fair share across clients); `cache_salt`: only requests with the
        same salt share prefix-cache blocks (vLLM's)."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = truncate_prompt(
            self.tokenize(prompt, add_special_tokens), params.truncate_prompt_tokens, self.max_model_len
        )
        self._validate_request(prompt_ids, params)
        self._check_lora(lora_request)
        check_cache_salt(cache_salt)
        # Without a connector, the base class's check refuses any transfer the params ask for.
        (self.kv_connector or KVConnectorScheduler()).check_request(params.kv_transfer_params)
        max_tokens = params.max_tokens or (self.max_model_len - len(prompt_ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        cfg = self.config
        ttft = params.ttft_slo_ms if params.ttft_slo_ms is not None else cfg.default_ttft_slo_ms
        tpot = params.tpot_slo_ms if params.tpot_slo_ms is not None else cfg.default_tpot_slo_ms
        sched_fields = dict(
            priority=params.priority,
            client=client,
            ttft_slo=None if ttft is None else ttft / 1000,
            tpot_slo=None if tpot is None else tpot / 1000,
            lora=lora_request,
            cache_salt=cache_salt,
        )
        self.scheduler.check_admission(
            Request(request_id, request_id, 0, prompt_ids, params, max_tokens, arrival, **sched_fields)
        )
        grammar = self._grammar(params)
        child_params = [params.for_child(i) for i in range(params.n)]
        banned = self._bad_words(params)
        for p in child_params:
            p._eos_token_ids = self.eos_token_ids
            p._bad_words_token_ids = banned
        self.output_processor.add_request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_ids,
            child_params,
            arrival,
            RequestMetrics(
                arrival, ttft_slo=sched_fields["ttft_slo"], tpot_slo=sched_fields["tpot_slo"], priority=params.priority
            ),
        )
        children = []
        for i, p in enumerate(child_params):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            if grammar is not None:
                self.structured.add_request(child_id, grammar)
            self.scheduler.add_request(
                Request(child_id, request_id, i, prompt_ids, p, max_tokens, arrival, **sched_fields)
            )
            children.append(child_id)
        self._children[request_id] = children
        self.step_records.on_arrival(request_id, children, len(prompt_ids))
        self._prompt_tokens += len(prompt_ids) * params.n
        return request_id

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def _check_lora(self, lora: LoRARequest | None) -> None:
        """Load (and check) a request's adapter before it is queued: a bad one is the request's
        error, never the step's."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if self.runner.lora is None:
            raise ValueError("a LoRA adapter was requested but the engine runs without --enable-lora")
        self.runner.lora.add(lora)

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load the PEFT adapter at `path` under `name` (ValueError: a bad adapter, or a name in use)."""
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need --enable-lora")
        if name in self.loras:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        if name == self.model_name:
            raise ValueError(f"{name!r} is the base model's name")
        lora = LoRARequest(name, next(self._lora_ids), path)
        self.runner.lora.add(lora)
        self.loras[name] = lora
        return lora

    def unload_lora(self, name: str) -> None:
        """Forget the adapter `name` (KeyError: none loaded). Requests already running under it
        finish under it (it is read again from its folder if they need it after this)."""
        lora = self.loras.pop(name)
        if self.runner.lora is not None:
            self.runner.lora.remove(lora.lora_int_id)

    def lora_names(self, which: str) -> list[str]:
        """Adapters of the `running` or `waiting` requests, by name (the lora_requests_info gauge)."""
        reqs = self.scheduler.running if which == "running" else self.scheduler.waiting
        return sorted({r.lora.lora_name for r in reqs if r.lora is not None})

    def _bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """bad_words as the token sequences they are banned as (kvflow.sample.bad_words)."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer; this model has none")
        return bad_word_sequences(params.bad_words, lambda text: self.tokenize(text, add_special_tokens=False))

    def _validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """What only the model knows: the vocabulary and the context length."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is out of range [0, {vocab})")
        bad = [t for t in params.logit_bias or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is out of range [0, {vocab})")
        bad = [t for t in params.allowed_token_ids or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"allowed_token_ids: token id {bad[0]} is out of range [0, {vocab})")
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise ValueError(
                f"the prompt has {n} tokens but max_model_len is {limit}; "
                f"at most {limit - 1} prompt tokens leave room for one output token"
            )
        # (attention sinks: the cache rolls, the output's length has no limit)
        if self.streaming is None and params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                f"{n + params.max_tokens} exceeds max_model_len {limit}"
            )
        if params.min_tokens > limit - n and self.streaming is None:
            raise ValueError(
                f"min_tokens ({params.min_tokens}) exceeds the {limit - n} tokens left after the "
                f"prompt ({n} tokens) within max_model_len {limit}"
            )
        if params.return_expert_trace:
            self._check_expert_trace(n, params)
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise ValueError("prompt_logprobs is not supported with tensor_parallel_size > 1")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(
                    f"{name} {asked} exceeds max_logprobs {self.max_logprobs} (start the engine with a larger "
                    "--max-logprobs, -1 for the whole vocabulary)"
                )

    def _check_expert_trace(self, n: int, params: SamplingParams) -> None:
        """An expert trace needs experts, and stays within MAX_EXPERT_TRACE_ENTRIES (tokens x MoE layers)."""
        if not self.moe_layers:
            raise ValueError(
                f"return_expert_trace needs a Mixture-of-Experts model; {self.model_config.architecture} has no experts"
            )
        tokens = n + (params.max_tokens if params.max_tokens is not None else self.max_model_len - n)
        entries = tokens * len(self.moe_layers)
        if entries > MAX_EXPERT_TRACE_ENTRIES:
            raise ValueError(
                f"return_expert_trace: the prompt ({n} tokens) + max_tokens = {tokens} tokens x "
                f"{len(self.moe_layers)} MoE layers = {entries} trace entries exceeds the limit of "
                f"{MAX_EXPERT_TRACE_ENTRIES}; lower max_tokens (or shorten the prompt)"
            )

    def _grammar(self, params: SamplingParams):
        """The compiled grammar of a constrained request (waits for the compile: the server has
        already waited for it off the engine thread, so there it is a cache hit)."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.structured is None:
            raise ValueError("structured outputs need the model's tokenizer; this model has none")
        return self.structured.compiled(spec)

    def abort(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        outputs = []
        for rid in ids:
            children = self._children.pop(rid, [])
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            self._release(children)
            out = self.output_processor.finish(rid, "abort")
            if out is not None:
                outputs.append(out)
        outputs += self._flush_kv_connector()
        self._publish_kv_events()
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with an error (a model step raised)."""
        return self._fail_requests(dict.fromkeys(list(self._children), error))

    def _fail_requests(self, errors: dict[str, str]) -> list[RequestOutput]:
        """End these user requests (parent id -> error) with finish_reason "error", all their
        completions with them; everyone else goes on."""
        outputs = []
        for rid, error in errors.items():
            children = self._children.pop(rid, [])
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ERROR)
            self._release(children)
            out = self.output_processor.finish(rid, "error", error)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.kv_events is None:
            return self._step()
        try:
            return self._step()
        finally:
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """The events since the last batch, as one batch (none: nothing is sent)."""
        if self.kv_events is not None and len(self.kv_events):
            self.kv_event_publisher.publish(KVEventBatch(time.time(), self.kv_events.take()))

    def _step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        expired = self._expire(sched)
        if not sched.seqs:  # nothing to compute; maybe KV transfers to drive
            if not sched.is_empty or self.has_pending_kv_transfers():
                expired += self._drive_kv_transfers(sched)
            self.slo.record(expired)
            return expired
        self._steps += 1
        self._peak_usage = max(self._peak_usage, self.kv_cache.usage)
        t0 = time.perf_counter()
        grammar = None if self.structured is None else self.structured.bitmask(sched.seqs)
        result = self.executor.execute(sched, grammar)  # raises only for a fault of the step itself
        self._observe_step_time(sched, time.perf_counter() - t0)
        if self.speculator is not None:
            self.speculator.observe(sched, result.sampled)
        for child_id, (start, experts) in result.expert_trace.items():  # (before finished requests go)
            req = self.scheduler.requests.get(child_id)
            if req is not None:
                self.output_processor.record_expert_trace(req.parent_id, req.index, start, experts)
        for child_id, (start, entries) in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(child_id)
            if req is not None:
                self.output_processor.record_prompt_logprobs(req.parent_id, start, entries)
        advanced, finished = self.scheduler.update_from_output(sched, result.sampled)
        kv_failed = self.scheduler.update_kv_transfers(result.kv_connector_output)
        broken: dict[str, str] = {}
        if self.structured is not None and self.structured.has_requests():
            finished += self._advance_grammars(advanced, broken)
        self._generation_tokens += sum(len(tokens) for _, tokens in advanced)
        self._sampling_rows += len(advanced)
        self._track_kv_utilization()
        outputs, stopped, failed = self.output_processor.process(advanced, finished, result.logprobs)
        outputs += self._embedded(finished, result.embeddings)
        if stopped:
            finished += self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._attach_transfer_params(outputs, finished)
        self._release([r.request_id for r in finished])
        for out in outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        for child_id, error in [*result.failed.items(), *broken.items()]:
            req_parent = self._parent_of(child_id)
            if req_parent is not None:
                failed.setdefault(req_parent, error if child_id in broken else f"sampling failed: {error}")
        if failed:
            for rid, error in failed.items():
                logger.warning("request %s failed alone: %s", rid, error)
            outputs += self._fail_requests({rid: f"request failed: {e}" for rid, e in failed.items()})
        outputs = expired + outputs + self._fail_kv_loads(kv_failed) + self._flush_kv_connector()
        self.slo.record(outputs)
        return outputs

    def _embedded(self, finished: list[Request], embeddings: dict[str, list[float]]) -> list[RequestOutput]:
        """The outputs of the embedding requests (SamplingParams.pooling) that ended this step."""
        outputs = []
        for req in finished:
            if req.params.pooling is not None:
                out = self.output_processor.embedded(req, embeddings.get(req.request_id))
                if out is not None:
                    outputs.append(out)
        return outputs

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's default sampling parameters (--generation-config)."""
        return SamplingParams(**self.default_sampling)

    def embedding_params(self, pooling: str | None = None) -> SamplingParams:
        """The params of an embedding request: pooling (default: the engine's --pooling), no sampling."""
        return SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling or self.config.pooling)

    # ---- KV transfers (connector) ----------------------------------------------------------------
    def has_pending_kv_transfers(self) -> bool:
        return self.kv_connector is not None and self.kv_connector.has_pending()

    def _flush_kv_connector(self) -> list[RequestOutput]:
        """Hand the worker side what finishing or aborting requests asked for (held blocks, dropped
        fetches) now, not at the next step: a client must never hold kv_transfer_params for a
        transfer the producer does not know yet."""
        if self.kv_connector is None:
            return []
        meta = self.kv_connector.build_connector_meta()
        return [] if meta.is_empty else self._drive_kv_transfers(SchedulerOutput(kv_connector_metadata=meta))

    def _drive_kv_transfers(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """A step without compute: the connector's worker side moves bytes and reports."""
        result = self.executor.execute(sched)
        return self._fail_kv_loads(self.scheduler.update_kv_transfers(result.kv_connector_output))

    def _fail_kv_loads(self, failed: list[tuple[Request, str]]) -> list[RequestOutput]:
        """Requests whose KV load failed under kv_load_failure_policy "fail" (the scheduler has
        already dropped them)."""
        if not failed:
            return []
        self._release([r.request_id for r, _ in failed])
        return self._fail_requests({r.parent_id: f"request failed: {why}" for r, why in failed})

    @staticmethod
    def _attach_transfer_params(outputs: list[RequestOutput], finished: list[Request]) -> None:
        """A producer's finished request says where its KV can be fetched (n is 1 with kv_transfer_params)."""
        params = {r.parent_id: r.kv_transfer_params for r in finished if r.kv_transfer_params is not None}
        if params:
            for out in outputs:
                if out.request_id in params:
                    out.kv_transfer_params = params[out.request_id]

    def _expire(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """End the requests that waited past max_queue_time_s (the scheduler already dropped them)."""
        if not sched.timed_out:
            return []
        limit = self.config.max_queue_time_s
        errors = {}
        for req in sched.timed_out:
            errors.setdefault(
                req.parent_id,
                f"the request waited more than max_queue_time_s ({limit:g} s) "
                "without being scheduled; the server is overloaded, retry later",
            )
        return self._fail_requests(errors)

    def _observe_step_time(self, sched: SchedulerOutput, seconds: float) -> None:
        cost = self.step_cost
        tokens, chunks, context, pairs = cost.features((s.start_pos, len(s.token_ids)) for s in sched.seqs)
        if self.step_records.enabled:  # the prediction made before the step was seen, as observe() judges it
            predicted = cost.predict(tokens, chunks, context, pairs) if cost.num_samples >= 8 else None
            waiting_kv = tuple(self.scheduler.waiting_for_kv) if self.scheduler.waiting_for_kv else ()
            self.step_records.record(sched, time.time() - seconds, seconds, predicted, waiting_kv)
        cost.observe(tokens, seconds, chunks, context, pairs)

    def _advance_grammars(self, advanced: list[tuple[Request, list[int]]], broken: dict[str, str]) -> list[Request]:
        """Move each constrained sequence's matcher past its new tokens; end those whose grammar
        is complete (a stop token ended it, also with ignore_eos). `broken` gets the sequences
        whose tokens the grammar refused (never expected: the mask allowed them)."""
        complete = []
        for req, tokens in advanced:
            done = self.structured.accept(req.request_id, tokens)
            if done is None:
                broken[req.request_id] = f"the output left its grammar at token {tokens}"
            elif done and not req.is_finished:
                complete.append(req.request_id)
        return self.scheduler.finish_requests(complete, RequestStatus.FINISHED_STOPPED)

    def _release(self, request_ids: list[str]) -> None:
        """Per-request state outside the scheduler (generators, acceptance averages, matchers)."""
        self.executor.release(request_ids)
        if self.structured is not None:
            self.structured.remove(request_ids)
        if self.speculator is not None:
            self.speculator.release(request_ids)

    def _parent_of(self, child_id: str) -> str | None:
        req = self.scheduler.requests.get(child_id)
        return None if req is None else req.parent_id

    def _track_kv_utilization(self) -> None:
        if not self.scheduler.running:
            return
        mem = self.scheduler.kv_memory_stats()
        self._util_steps += 1
        self._util_sum += mem.utilization
        self._util_contig_sum += mem.tokens_stored / max(mem.tokens_reserved_contiguous, 1)

    def explain_request(self, request_id: str) -> dict | None:
        """What a request waited through (step records): plain data, or None when unknown or expired."""
        return self.step_records.explain(request_id, self.step_cost, set(self.scheduler.requests))

    def get_stats(self) -> EngineStats:
        offload, transfer = self._connector_stats()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            peak_kv_cache_usage=self._peak_usage,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            sampling_rows_total=self._sampling_rows,
            num_steps=self._steps,
            prefix_cache_queries=self.kv_cache.prefix_stats.queries,
            prefix_cache_hits=self.kv_cache.prefix_stats.hits,
            kv_memory=self.scheduler.kv_memory_stats(),
            kv_capacity_tokens=self.kv_capacity_tokens,
            kv_utilization_mean=self._util_sum / max(self._util_steps, 1),
            kv_utilization_contiguous_mean=self._util_contig_sum / max(self._util_steps, 1),
            kv_offload=offload,
            kv_transfer=transfer,
            spec_decode=None if self.speculator is None else self.speculator.stats.snapshot(),
            structured_output=None if self.structured is None else self.structured.snapshot(),
            slo=self.slo.snapshot(),
            step_cost_error=self.step_cost.prediction_error,
            linear_kernels=self.executor.kernel_summary(),
            moe=self.executor.moe_stats(),
            lora=self._lora_stats(),
        )

    def _lora_stats(self) -> LoRAStats | None:
        manager = self.runner.lora
        if manager is None:
            return None
        c = manager.counters
        return LoRAStats(
            self.config.max_loras,
            self.lora_names("running"),
            self.lora_names("waiting"),
            c.loads,
            c.evictions,
            c.cpu_evictions,
        )

    def _connector_stats(self) -> tuple[OffloadStats | None, KVTransferStats | None]:
        from kvflow.kv_transfer.offload_store import OffloadStats
        from kvflow.kv_transfer.pd import KVTransferStats

        stats = None if self.executor.kv_connector is None else self.executor.kv_connector.stats()
        return (
            stats if isinstance(stats, OffloadStats) else None,
            stats if isinstance(stats, KVTransferStats) else None,
        )

    def take_kv_transfer_times(self) -> list[float]:
        """Fetch durations since the last call (for the metrics histogram)."""
        return [] if self.executor.kv_connector is None else self.executor.kv_connector.take_transfer_times()

    def shutdown(self) -> None:
        """Stop the KV connector (the offload tiers first persist the prefix cache: a disk tier then
        serves the next run), the grammar compiler and the workers. A second call does nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        if self.structured is not None:
            self.structured.shutdown()
        if self.kv_connector is not None:  # (before the workers go: under TP every rank holds a share)
            meta = self.kv_connector.build_shutdown_meta()
            if meta is not None:
                self.executor.execute(SchedulerOutput(kv_connector_metadata=meta))
            self.executor.kv_connector.shutdown()
        if self.kv_event_publisher is not None:  # the tiers' last moves (persisted to disk) included
            self._publish_kv_events()
            self.kv_event_publisher.shutdown()
        self.executor.shutdown()
