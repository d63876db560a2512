"""Turns a `SchedulerOutput` into tensors, runs the model, samples.

Owns the device state: the model's weights, the KV cache tensors and the per-request random
generators. Knows sequences only as (tokens, start position, block table, sampling params).
Also answers what the engine must know before a runner exists (`kv_cache_spec`: one token's KV
bytes on a rank, from which the engine sizes its block pool), and tokenizes its own int8
calibration text: the engine reaches none of this tensor code except through the executor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvflow.attention.backend import DECODE_LIKE_ROWS, SeqLayout, kv_cache_bytes_per_token
from kvflow.attention.kv_formats import kv_format
from kvflow.attention.selector import make_attention_backend
from kvflow.config import EngineConfig, ModelConfig
from kvflow.core.kv_groups import kv_layout
from kvflow.core.scheduler import ScheduledSeq, SchedulerOutput
from kvflow.core.step_cost import DecodePass
from kvflow.distributed.parallel import local_config
from kvflow.layers.linear_kernels import select_linear_backend
from kvflow.models.decode_pass import native_decode_unsupported
from kvflow.models.registry import causal_lm_class
from kvflow.quantization.smoothquant import CALIBRATION_TEXT
from kvflow.sample.bad_words import ban_bad_words
from kvflow.sample.rejection_sampler import RejectionSampler
from kvflow.sample.sampler import Sampler, SamplingBatch
from kvflow.structured_output.manager import apply_bitmask
from kvflow.worker.prompt_logprobs import LogprobEntry, prompt_logprobs

if TYPE_CHECKING:
    from kvflow.distributed.parallel import TPGroup
    from kvflow.kv_transfer.base import KVConnectorOutput
    from kvflow.structured_output.manager import GrammarBitmask

logger = logging.getLogger("kvflow")

# What the kernel summary says of a Mixture-of-Experts model's experts (kvflow.layers.moe's
# SparseMoeBlock.path): stacked float experts in torch, a GGUF's quantized experts on their block
# kernels, float experts on the linear kernels of the backend, or all on native float kernels run
# by one call per layer.
MOE_PATH = "experts: torch, grouped by expert"
MOE_BLOCKS_PATH = "experts: GGUF blocks as stored, one block kernel pair per expert, grouped by expert"
MOE_KERNELS_PATH = "experts: one linear kernel pair per expert (the backend's paths), grouped by expert"
MOE_NATIVE_PATH = "experts: native float kernels, grouped by expert, a layer's experts in one native call"
MOE_PATHS = {"torch": MOE_PATH, "blocks": MOE_BLOCKS_PATH, "kernels": MOE_KERNELS_PATH, "native": MOE_NATIVE_PATH}
PASS_PROBE_CONTEXT = 64  # tokens of context per row in the decode steps that time the decode pass
# prefill chunks (sequences, tokens each) that time the attention paths for prefill rows
PREFILL_PROBE = (2, 256)


@dataclass
class RunnerOutput:
    # request id -> its new tokens: one, or with drafts the accepted ones then the verifier's own
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)  # one entry per new token
    # Requests whose own sampling raised (request id -> error); the rest of the batch went on.
    failed: dict[str, str] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None  # KV transfers finished since the last step
    # Requests that asked for an expert trace (Mixture-of-Experts): request id -> (position of the
    # step's first token of it, per token of the step its experts per MoE layer, [tokens][layers][k]).
    expert_trace: dict[str, tuple[int, list[list[list[int]]]]] = field(default_factory=dict)
    # Embedding requests (SamplingParams.pooling) whose prompt ended this step: request id -> the
    # pooled, L2-normalised final hidden state (float32).
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: request id -> (first prompt position scored, its entries)
    prompt_logprobs: dict[str, tuple[int, list[LogprobEntry]]] = field(default_factory=dict)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token's KV costs on one rank: under tensor parallelism each rank holds its share
    of the KV heads, so this is that share's."""

    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    kv_cache_dtype: str  # "auto" (the model dtype) | "float32" | "bfloat16" | "int8" | "fp8_e4m3" | "fp8_e5m2" | "int4"
    bytes_per_token: int  # K and V of every layer, the quantized dtypes' scales included

    @property
    def per_value(self) -> str:
        """One K or V value's cost, as the start-up log line says it."""
        fmt = kv_format(self.kv_cache_dtype)
        if fmt is not None:
            return fmt.what
        return f"{self.bytes_per_token // (2 * self.num_layers * self.num_kv_heads * self.head_dim)} bytes"


def kv_cache_spec(model_config: ModelConfig, config: EngineConfig) -> KVCacheSpec:
    """One rank's KV bytes per token for this model and engine config (dtype, KV dtype, TP size).
    Asked before any runner exists: the number of KV blocks the runners allocate comes from it."""
    mc = local_config(model_config, config.tensor_parallel_size, config.enable_expert_parallel)
    per_token = kv_cache_bytes_per_token(
        mc.num_layers, mc.num_kv_heads, mc.head_dim, getattr(torch, config.dtype), config.kv_cache_dtype
    )
    return KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.kv_cache_dtype, per_token)


def calibration_ids(tokenizer: Any | None, vocab_size: int) -> list[int]:
    """The token ids int8 smoothing is calibrated on: the fixed calibration text, or seeded random
    tokens for a model without a tokenizer."""
    ids = [] if tokenizer is None else tokenizer(CALIBRATION_TEXT, add_special_tokens=True)["input_ids"]
    return ids or _random_ids(vocab_size, 256)


class ModelRunner:
    collective = False  # its block reads and writes are local (see kvflow.kv_transfer.base.BlockIO)

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        max_model_len: int,
        num_blocks: int,
        weights: Iterable[tuple[str, torch.Tensor]],
        calibration: list[int] | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        """`model_config`: this rank's share of the model under tensor parallelism (`tp`).
        `calibration`: the token ids int8 smoothing is calibrated on (`calibration_ids`; every
        rank of a tensor-parallel group gets the same, as the calibration pass is collective)."""
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            from kvflow.kernels.cpu.allocator import keep_freed_memory

            keep_freed_memory()  # before the weights and the first steps allocate
        self.dtype = getattr(torch, config.dtype)
        self.attention = make_attention_backend(
            config.attention_backend,
            config.block_size,
            model_config.sliding_window,
            self.device,
            self.dtype,
            model_config.num_heads,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        model_cls = causal_lm_class(model_config)
        self.model = model_cls(model_config, self.attention, max_model_len, self.dtype, self.device, tp)
        self.model.load_weights(weights)
        self.model.eval()
        self.linear_backend = select_linear_backend(
            self.device, self.dtype, config.quantization, self.model.has_block_weights
        )
        if self.linear_backend in ("int8", "int8_mm"):
            # Smooth activation outliers into the weights before quantizing them (calibrated on a
            # fixed text, or seeded random tokens for a model without a tokenizer).
            ids = calibration if calibration is not None else calibration_ids(None, model_config.vocab_size)
            self.model.apply_smoothing(self._activation_amax(ids[: min(len(ids), max_model_len)]))
        self.kernel_plan = None
        if self.linear_backend == "auto":
            from kvflow.worker.autotune import plan_kernels

            self.kernel_plan = plan_kernels(
                *self.model.projection_shapes(), self.dtype, config.kernel_autotune, num_layers=model_config.num_layers
            )
        self.model.prepare(self.linear_backend, self.kernel_plan)
        if model_config.is_moe:  # tokens per layer / expert for the metrics ("off": no per-step work)
            # (every tensor-parallel rank routes every token; the first rank's counts are reported)
            self.model.set_routing_stats(config.moe_expert_metrics if tp is None or tp.is_first else "off")
        logger.info(
            "weights: %.1f MB as the kernels hold them (%s)", self.model.weight_bytes() / 1e6, self.linear_backend
        )
        self.kv_cache_dtype = config.kv_cache_dtype
        # KV groups (kvflow.core.kv_groups): with a hybrid layout, `slots` tensors of pages, the
        # j-th layer of every group in tensor j; a layer reads its group's block tables.
        self.kv_layout = kv_layout(model_config, config.disable_hybrid_kv_cache_manager, max_model_len)
        pages = self.attention.allocate_kv_cache(
            self.kv_layout.slots,
            num_blocks,
            model_config.num_kv_heads,
            model_config.head_dim,
            self.dtype,
            config.kv_cache_dtype,
        )
        where = [self.kv_layout.slot_of(i) for i in range(model_config.num_layers)]
        self.kv_caches = [pages[slot] for _, slot in where]
        self.layer_groups = [group for group, _ in where]
        # Attention sinks: the rotation that moves cached keys down the cache (kvflow.worker.kv_rerotate).
        self.key_rerotation = self._key_rerotation(model_config, max_model_len) if config.streaming_kv else None
        # One block of every layer as KV connectors move it (see read_blocks).
        if self.kv_caches[0].quantized:
            self.kv_block_shape: tuple[int, ...] = (model_config.num_layers, self._quantized_block_bytes())
            self.kv_block_dtype = torch.uint8
        else:
            self.kv_block_shape = (model_config.num_layers, *self.kv_caches[0].data.shape[1:])
            self.kv_block_dtype = self.kv_caches[0].data.dtype
        # CUDA: decode-only steps replay graphs captured now (kvflow.worker.cuda_graphs). Not for
        # Mixture-of-Experts models: which experts run depends on the data, which a graph cannot.
        self.decode_graphs = None
        if self.kv_layout.num_groups > 1:
            # One step, several block tables: the fused decode pass and the captured graphs read one.
            self.model.native_decode = None
        if (
            self.kv_layout.num_groups == 1
            and self.device.type == "cuda"
            and not config.enforce_eager
            and self.attention.supports_decode_graphs
            and not model_config.is_moe
        ):
            from kvflow.worker.cuda_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(
                self.model,
                self.attention,
                self.kv_caches,
                config.graph_batch_sizes(),
                -(-max_model_len // config.block_size) + 1,
                self.device,
            )
        if self.kernel_plan is not None and self.kernel_plan.pass_unmeasured and self.model.native_decode is not None:
            self._time_decode_pass(num_blocks, config.block_size, max_model_len)
        if self.kernel_plan is not None and hasattr(self.attention, "prefill_path"):
            self._choose_prefill_attention(model_config, num_blocks, config.block_size)
        logger.info("%s", self.kernel_summary())  # (once every choice is made)
        self.sampler = Sampler(config.seed, self.device)
        self.rejection_sampler = RejectionSampler(config.seed + 1, self.device)
        self._generators: dict[str, torch.Generator] = {}
        self._pool_sums: dict[str, torch.Tensor] = {}  # mean pooling: request id -> hidden-state sum so far
        self.lora = None  # LoRA adapters (--enable-lora): kvflow.lora.manager.LoRAManager
        if config.enable_lora:
            from kvflow.lora.layers import LoRABatch, attach, base_shapes
            from kvflow.lora.manager import LoRAManager

            self.lora_batch = LoRABatch()
            self.lora = LoRAManager(
                base_shapes(self.model),
                config.max_loras,
                config.cpu_loras,
                config.max_lora_rank,
                self.lora_batch,
                getattr(self.model, "adapter_rows", None),
            )
            attach(self.model, self.lora_batch)  # (after every kernel choice: wraps the final kernels)
        if self.device.type == "cpu":
            from kvflow.kernels.cpu.allocator import release_free_memory

            release_free_memory()  # (what loading left free in the heap)

    def _time_decode_pass(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """The decode pass's row limit, from decode steps of this model timed with and without it
        (kvflow.worker.autotune.measure_pass_rows), stored for later starts. The rows use the
        first blocks of the new KV cache: nothing holds them yet, and whoever gets them later writes
        its keys and values before reading them. (A limit of 0 leaves the projections' native copies,
        built for the pass, unused.)"""
        from kvflow.worker.autotune import LOAD_LIMIT, measure_pass_rows, store_pass_rows

        plan, fused = self.kernel_plan, self.model.native_decode
        # (a model served with a shorter context has no rotary angles past it)
        context = min(PASS_PROBE_CONTEXT, max_model_len)
        per_row = -(-context // block_size)

        def step(rows: int, use_pass: bool) -> None:
            fused.max_rows = rows if use_pass else 0
            self.run_model(
                [[1]] * rows,
                [context - 1] * rows,
                [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)],
            )

        t = time.perf_counter()
        rows, load = measure_pass_rows(step, min(plan.decode_pass_rows, num_blocks // per_row))
        fused.max_rows = plan.decode_pass_rows = rows
        plan.pass_unmeasured = False
        stored = load <= LOAD_LIMIT
        if stored:
            store_pass_rows(plan, rows)
        logger.info(
            "decode pass: %s (timed on the model in %.1f s%s)",
            f"up to {rows} rows" if rows else "off",
            time.perf_counter() - t,
            "" if stored else f"; other processes used {load:.2f} cores: used now, not stored",
        )

    def _choose_prefill_attention(self, model_config, num_blocks: int, block_size: int) -> None:
        """The path prefill rows take (the CPU attention's `prefill_path`): stored for this CPU and
        attention shape, else measured now on PREFILL_PROBE chunks written into the first blocks of
        layer 0's cache (nothing holds them yet) and stored."""
        from kvflow.worker.autotune import (
            LOAD_LIMIT,
            measure_prefill_attention,
            prefill_attention_key,
            store_prefill_attention,
            stored_prefill_attention,
        )

        heads, kv_heads, head_dim = model_config.num_heads, model_config.num_kv_heads, model_config.head_dim
        cache = self.kv_caches[0]
        key = prefill_attention_key(heads, kv_heads, head_dim, cache.data.dtype)
        path = stored_prefill_attention(self.kernel_plan, key)
        if path is None:
            seqs_n, length = PREFILL_PROBE
            per_seq = -(-length // block_size)
            if seqs_n * per_seq > num_blocks:
                return
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(seqs_n * length, heads, head_dim, generator=gen).to(self.dtype)
            kv = torch.randn(seqs_n * length, 2, kv_heads, head_dim, generator=gen).to(self.dtype)
            seqs = [SeqLayout(0, length, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(seqs_n)]

            def run(p: str) -> None:
                self.attention.prefill_path = p
                self.attention.forward(q, kv, cache, self.attention.build_metadata(seqs), head_dim**-0.5)

            t = time.perf_counter()
            with torch.inference_mode():
                path, load = measure_prefill_attention(run)
            if load <= LOAD_LIMIT:
                store_prefill_attention(self.kernel_plan, key, path)
            logger.info(
                "prefill attention: %s (timed in %.2f s%s)",
                path,
                time.perf_counter() - t,
                "" if load <= LOAD_LIMIT else f"; other processes used {load:.2f} cores: not stored",
            )
        else:
            logger.info("prefill attention: %s (stored for this CPU)", path)
        self.attention.prefill_path = path

    def kernel_summary(self) -> str:
        """The linear paths in use: the autotune's choices per shape and row count, or the backend."""
        if self.kernel_plan is not None:
            prefill = getattr(self.attention, "prefill_path", None)
            summary = self.kernel_plan.describe() + (f"; prefill attention: {prefill}" if prefill else "")
        else:
            summary = f"linear kernels: {self.linear_backend}"
        if self.model.cfg.is_moe:
            summary += "; " + "; ".join(MOE_PATHS[p] for p in self.model.experts_paths)
            why = native_decode_unsupported(self.model)
            if why is not None:  # (the plan's "decode pass: off" would not say why)
                summary += f"; decode steps on the per-layer path: {why}"
        return summary

    def decode_pass(self) -> DecodePass:
        """Which steps the model computes as its one-call decode pass (kvflow.models.decode_pass):
        every sequence with at most DECODE_LIKE_ROWS new tokens, in steps of at most its
        `max_rows`; none without a pass."""
        fused = getattr(self.model, "native_decode", None)
        if fused is None or fused.max_rows <= 0:
            return DecodePass()
        return DecodePass(rows_per_seq=DECODE_LIKE_ROWS, max_rows=fused.max_rows, tile_rows=fused.tile_rows)

    def moe_stats(self):
        """A Mixture-of-Experts model's routing counts so far (kvflow.layers.moe.MoeRoutingStats),
        or None (a dense model, or --moe-expert-metrics off)."""
        return self.model.routing_stats() if self.model.cfg.is_moe else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar: GrammarBitmask | None = None) -> RunnerOutput:
        """One step. An exception from here is the step's (the model pass): it fails everyone.
        `grammar`: the allowed tokens of constrained rows (structured outputs). (The KV connector's
        loads and saves around it are the executor's: they may involve every rank.)"""
        if out.kv_shifts:  # attention sinks: keys of blocks that moved down, before anything reads them
            for shift in out.kv_shifts:
                self.key_rerotation.apply_(self.kv_caches, shift.blocks, shift.delta)
        return self._forward(out, grammar) if out.seqs else RunnerOutput()

    def _key_rerotation(self, model_config: ModelConfig, max_model_len: int):
        from kvflow.worker.kv_rerotate import KeyRerotation

        rope = model_config.rope
        if rope.scaling_type == "longrope" and max_model_len > rope.original_max_position_embeddings:
            # (its frequencies change at that position: a rotation by a delta is no longer one)
            raise ValueError(
                f"attention sinks with LongRoPE need max_model_len <= original_max_position_embeddings "
                f"({rope.original_max_position_embeddings}), got {max_model_len}"
            )
        rotary = getattr(self.model, "rotary", None)
        if rotary is None or not hasattr(rotary, "sin_signed") or getattr(self.model, "rotary_local", None) is not None:
            raise ValueError(
                f"attention sinks need a model with one rotary table for every layer; "
                f"{model_config.architecture} has none kvflow can re-rotate keys with"
            )
        return KeyRerotation(rotary.cos, rotary.sin_signed, model_config.head_dim)

    def _forward(self, out: SchedulerOutput, grammar: GrammarBitmask | None) -> RunnerOutput:
        seqs = out.seqs
        traced = self.model.cfg.is_moe and any(s.params.return_expert_trace for s in seqs)
        if traced:  # (only then: the experts of the traced rows are read back after the pass)
            self.model.start_routing_capture()
        lora_rows = self.lora is not None and self.lora.batch_for([(s.lora, len(s.token_ids)) for s in seqs])
        saved = self.decode_graphs
        if lora_rows:  # adapter rows: eager (the captured graphs have no adapters; the decode pass has)
            self.decode_graphs = None
        try:
            hidden = self.run_model(
                # (positions in the cache: attention sinks drop tokens from it)
                [s.token_ids for s in seqs],
                [s.start_pos - s.num_dropped_tokens for s in seqs],
                [s.block_table for s in seqs],
                [s.group_block_tables for s in seqs],
            )
        finally:
            experts = self.model.take_routing_capture() if traced else None
            if lora_rows:
                self.decode_graphs = saved
                self.lora.end_step()
        trace = {} if experts is None else _expert_trace(seqs, experts)
        embeddings = self._pool(seqs, hidden) if any(s.params.pooling for s in seqs) else {}
        prompt_lps = (
            prompt_logprobs(seqs, hidden, self.model.compute_logits)
            if any(s.params.prompt_logprobs is not None for s in seqs)
            else {}
        )

        sampling = [s for s in seqs if s.sample and s.params.pooling is None]
        if not sampling:
            return RunnerOutput(expert_trace=trace, embeddings=embeddings, prompt_logprobs=prompt_lps)
        # (in the model's dtype: the sampler widens them where it needs more than an argmax)
        rows = logits_rows(seqs)
        if len(rows) < hidden.shape[0]:  # (every row samples in a step of decodes and drafts: no gather)
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden, float32=False)
        result = self._sample(self._constrain(logits, sampling, grammar), sampling)
        result.expert_trace = trace
        result.embeddings = embeddings
        result.prompt_logprobs = prompt_lps
        return result

    def _pool(self, seqs: list[ScheduledSeq], hidden: torch.Tensor) -> dict[str, list[float]]:
        """The embeddings of the pooling sequences whose prompt ends this step. Mean pooling sums
        each chunk's rows (float32) per request across chunked-prefill steps; a chunk from
        position 0 starts the sum afresh (a first chunk, or the recompute after a preemption: mean
        requests never take prefix-cache hits)."""
        out, end = {}, 0
        for s in seqs:
            start, end = end, end + len(s.token_ids)
            mode = s.params.pooling
            if mode is None:
                continue
            if mode == "mean":
                rows = hidden[start:end].float().sum(0)
                if s.start_pos == 0 or s.request_id not in self._pool_sums:
                    self._pool_sums[s.request_id] = rows
                else:
                    self._pool_sums[s.request_id] += rows
                if not s.sample:
                    continue
                vec = self._pool_sums.pop(s.request_id) / (s.start_pos + len(s.token_ids))
            elif s.sample:
                vec = hidden[end - 1].float()
            else:
                continue
            out[s.request_id] = torch.nn.functional.normalize(vec, dim=0).tolist()
        return out

    @torch.inference_mode()
    def run_model(
        self,
        token_ids: list[list[int]],
        start_pos: list[int],
        block_tables: list[list[int]],
        group_tables: list[list[list[int]]] | None = None,
    ) -> torch.Tensor:
        """The forward pass over these sequences' new tokens (writes their KV): hidden states [T, hidden].
        Under tensor parallelism every rank runs it on the same step, each over its own shard.
        `group_tables`: per sequence, its tables of KV groups 1.. (a hybrid layout). None: every
        group uses block_tables, which is right only for scratch passes whose chunks start at
        position 0 (layers of different groups then share slots, each writing before it reads)."""
        input_ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=self.device)
        meta = self.attention.build_metadata(
            [SeqLayout(p, len(ids), table) for ids, p, table in zip(token_ids, start_pos, block_tables)]
        )
        if self.kv_layout.num_groups > 1:
            metas = [meta]
            for g in range(1, self.kv_layout.num_groups):
                tables = block_tables if group_tables is None else [t[g - 1] for t in group_tables]
                metas.append(
                    self.attention.build_metadata(
                        [SeqLayout(p, len(ids), table) for ids, p, table in zip(token_ids, start_pos, tables)]
                    )
                )
            layer_meta = [metas[g] for g in self.layer_groups]
            return self.model(input_ids, meta.positions, self.kv_caches, meta, layer_meta=layer_meta)
        graphs = self.decode_graphs
        if (
            graphs is not None
            and input_ids.shape[0] == len(token_ids)
            and graphs.can_run(len(token_ids), max(map(len, block_tables)))
        ):
            return graphs.run(input_ids, meta)  # a decode-only step
        return self.model(input_ids, meta.positions, self.kv_caches, meta)

    @torch.inference_mode()
    def run_shard(
        self, token_ids: list[list[int]], start_pos: list[int], block_tables: list[list[int]], rows: list[int]
    ) -> None:
        """A tensor-parallel rank > 0's step: the same forward pass and logits rows as the first
        rank, over this rank's shard (its logits slice goes to the first rank, which samples)."""
        hidden = self.run_model(token_ids, start_pos, block_tables)
        if rows:
            self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

    def _constrain(
        self, logits: torch.Tensor, seqs: list[ScheduledSeq], grammar: GrammarBitmask | None
    ) -> torch.Tensor:
        """logit_bias, allowed_token_ids (the others get -inf), bad_words, then the grammar's mask (disallowed
        tokens get -inf), on every row a sequence samples from (draft positions included), before
        the sampler or the verifier: both then see the same distribution, so speculative decoding
        stays exact under them."""
        if grammar is not None or any(
            s.params.logit_bias or s.params.allowed_token_ids or s.params._bad_words_token_ids for s in seqs
        ):
            logits = logits.float()
        start = 0
        for s in seqs:
            n = 1 + len(s.spec_token_ids)
            if s.params.logit_bias:
                ids = torch.tensor(list(s.params.logit_bias), dtype=torch.long, device=logits.device)
                bias = torch.tensor(list(s.params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[start : start + n, ids] += bias
            if s.params.allowed_token_ids:
                ids = torch.tensor(s.params.allowed_token_ids, dtype=torch.long, device=logits.device)
                rows = logits[start : start + n]
                kept = rows[:, ids].clone()
                rows.fill_(float("-inf"))
                rows[:, ids] = kept
            if s.params._bad_words_token_ids:
                ban_bad_words(
                    logits[start : start + n], s.output_token_ids or (), s.spec_token_ids, s.params._bad_words_token_ids
                )
            start += n
        if grammar is not None:
            apply_bitmask(logits, grammar)
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> RunnerOutput:
        """Sampling belongs to each request: if the batch raises, every row is sampled alone and
        only the rows that still raise fail (a seeded row retried this way may draw a different
        token than it would have in the batch: only on this error path)."""
        try:
            return self._sample_rows(logits, seqs)
        except Exception as e:
            if len(seqs) == 1:
                return RunnerOutput(failed={seqs[0].request_id: _describe(e)})
        out = RunnerOutput()
        start = 0
        for s in seqs:
            n = 1 + len(s.spec_token_ids)
            try:
                one = self._sample_rows(logits[start : start + n], [s])
            except Exception as e:
                out.failed[s.request_id] = _describe(e)
            else:
                out.sampled.update(one.sampled)
                out.logprobs.update(one.logprobs)
            start += n
        return out

    def _sample_rows(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> RunnerOutput:
        """logits: 1 + k rows per sequence, in order. Sequences without drafts take the sampler;
        those with drafts the rejection sampler, which emits exactly what the sampler would have
        (greedy: the same tokens; random: the same distribution)."""
        spans, start = [], 0
        for s in seqs:
            spans.append((start, start + 1 + len(s.spec_token_ids)))
            start = spans[-1][1]
        out = RunnerOutput()
        plain = [i for i, s in enumerate(seqs) if not s.spec_token_ids]
        if plain:
            sub = [seqs[i] for i in plain]
            batch = SamplingBatch(
                params=[s.params for s in sub],
                generators=[self._generator(s.request_id, s.params.seed) for s in sub],
                prompt_ids=[s.prompt_token_ids for s in sub],
                output_ids=[s.output_token_ids for s in sub],
                num_output_tokens=[s.start_pos + len(s.token_ids) - s.num_prompt_tokens for s in sub],
            )
            rows = [spans[i][0] for i in plain]
            result = self.sampler(logits if len(rows) == logits.shape[0] else logits[rows], batch)
            ids = result.token_ids.tolist()
            for j, s in enumerate(sub):
                out.sampled[s.request_id] = [ids[j]]
                if result.logprobs[j] is not None:
                    out.logprobs[s.request_id] = [result.logprobs[j]]
        spec = [i for i, s in enumerate(seqs) if s.spec_token_ids]
        if spec:
            sub = [seqs[i] for i in spec]
            target = (logits[[r for i in spec for r in range(*spans[i])]] if plain else logits).float()
            verified = self.rejection_sampler(
                target,
                [s.spec_token_ids for s in sub],
                [None] * len(sub),
                [s.params for s in sub],
                [self._generator(s.request_id, s.params.seed) for s in sub],
            )
            offset = 0
            for s, tokens in zip(sub, verified.token_ids):
                out.sampled[s.request_id] = tokens
                if s.params.logprobs is not None:  # of the emitted tokens, from their own positions
                    rows = target[offset : offset + len(tokens)]
                    lps = self.sampler.logprobs(
                        rows, torch.tensor(tokens, device=rows.device), [s.params] * len(tokens)
                    )
                    out.logprobs[s.request_id] = lps
                offset += 1 + len(s.spec_token_ids)
        return out

    # ---- whole blocks, for KV connectors ------------------------------------------------------
    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """KV of whole blocks, [n, *kv_block_shape] of kv_block_dtype (a copy).

        Float KV dtypes: [n, layers, block_size, 2 (K, V), kv_heads, head_dim] in the cache's dtype.
        Quantized KV (int8, fp8, int4): [n, layers, bytes] uint8, each layer's codes followed by
        its float32 scales.
        """
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        if self.kv_caches[0].quantized:
            n = len(blocks)
            return torch.stack(
                [
                    torch.cat(
                        (
                            c.data.view(torch.uint8).index_select(0, idx).reshape(n, -1),
                            c.scale.index_select(0, idx).view(torch.uint8).reshape(n, -1),
                        ),
                        dim=1,
                    )
                    for c in self.kv_caches
                ],
                dim=1,
            )
        return torch.stack([c.data.index_select(0, idx) for c in self.kv_caches], dim=1)

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: data [n, *kv_block_shape] goes into `blocks`."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        for layer, c in enumerate(self.kv_caches):
            if c.quantized:  # (every quantized format's codes are 1-byte elements)
                split = c.data[0].numel()
                raw = data[:, layer]
                c.data.view(torch.uint8).index_copy_(0, idx, raw[:, :split].contiguous().view(-1, *c.data.shape[1:]))
                c.scale.index_copy_(
                    0, idx, raw[:, split:].contiguous().view(torch.float32).view(-1, *c.scale.shape[1:])
                )
            else:
                c.data.index_copy_(0, idx, data[:, layer].to(c.data.dtype))

    @torch.inference_mode()
    def _activation_amax(self, ids: list[int]) -> dict[str, torch.Tensor]:
        """Per input channel max |x| of every Linear (and of the lm_head, under "lm_head") over one
        forward pass of `ids`, with the float weights, through a scratch KV cache."""
        model, cfg = self.model, self.model.cfg
        amax: dict[str, torch.Tensor] = {}

        def record(name: str, x: torch.Tensor) -> None:
            a = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a

        class Recorder:  # the layers call kernels directly, so kernels are wrapped (no module hooks)
            def __init__(self, kernel, name: str) -> None:
                self.kernel, self.name, self.backend = kernel, name, kernel.backend

            def __call__(self, x, residual=None):
                record(self.name, x)
                return self.kernel(x, residual)

        linears = model.linear_inputs()
        for n, m in linears.items():
            m.kernel = Recorder(m.kernel, n)
        hooks = [model.norm.register_forward_hook(lambda m, inp, out: record("lm_head", out))]
        try:
            bs = self.attention.block_size
            blocks = list(range(-(-len(ids) // bs)))
            scratch = self.attention.allocate_kv_cache(
                cfg.num_layers, len(blocks), cfg.num_kv_heads, cfg.head_dim, self.dtype
            )
            meta = self.attention.build_metadata([SeqLayout(0, len(ids), blocks)])
            model(torch.tensor(ids, dtype=torch.long, device=self.device), meta.positions, scratch, meta)
        finally:
            for h in hooks:
                h.remove()
            for m in linears.values():
                m.kernel = m.kernel.kernel
        return amax

    def _quantized_block_bytes(self) -> int:
        c = self.kv_caches[0]
        return c.data[0].numel() + c.scale[0].numel() * 4

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(_seed32(seed))
            self._generators[request_id] = g
        return g

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._pool_sums.pop(rid, None)


def _seed32(seed: int) -> int:
    """torch's CPU generator keeps only 32 bits of its seed, so int64 seeds that differ only in
    their high half (-1 and 2**63 - 1) would collide: mix the high half in. Seeds in [0, 2**32)
    stay as they are."""
    u = seed % 2**64
    return ((u & 0xFFFFFFFF) + (u >> 32) * 0x9E3779B1) & 0xFFFFFFFF


def logits_rows(seqs: list[ScheduledSeq]) -> list[int]:
    """Rows of the step's hidden states that get logits: each sampling sequence's last position,
    or with drafts its last 1 + k."""
    rows, end = [], 0
    for s in seqs:
        end += len(s.token_ids)
        if s.sample and s.params.pooling is None:  # (an embedding request samples nothing)
            rows.extend(range(end - 1 - len(s.spec_token_ids), end))
    return rows


def _expert_trace(seqs: list[ScheduledSeq], experts: torch.Tensor) -> dict[str, tuple[int, list[list[list[int]]]]]:
    """The rows of the sequences that asked for an expert trace, out of the step's captured
    experts [MoE layers, rows, k]: request id -> (start position, [tokens][layers][k]), one host
    copy for all of them."""
    spans, start = [], 0
    for s in seqs:
        if s.params.return_expert_trace:
            spans.append((s, start, start + len(s.token_ids)))
        start += len(s.token_ids)
    rows = torch.tensor([r for _, lo, hi in spans for r in range(lo, hi)], device=experts.device)
    picked = experts.index_select(1, rows).transpose(0, 1).tolist()  # [rows][layers][k]
    out, at = {}, 0
    for s, lo, hi in spans:
        out[s.request_id] = (s.start_pos, picked[at : at + hi - lo])
        at += hi - lo
    return out


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _random_ids(vocab_size: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()
