"""Prometheus metrics of a serving engine (names as in vLLM, prefix `kvflow:`) and the periodic
stats log line.

Everything is recorded from the engine thread, right after a step: per-request latencies from the
`RequestMetrics` timestamps of each `RequestOutput`, gauges and token counters from
`LLMEngine.get_stats()`. Each `EngineMetrics` owns its own `CollectorRegistry`, so several servers
in one process (tests) do not collide; `/metrics` renders that registry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvflow.outputs import RequestOutput

logger = logging.getLogger("kvflow")

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_MASK_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineMetrics:
    """The `kvflow:*` metrics. Methods are called from the engine thread (prometheus_client is
    thread-safe, so `/metrics` may render at any time)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kvflow:{name}", doc, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.", _TTFT_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds", "Time between successive output steps of a request.", _ITL_BUCKETS
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Per finished request with two or more output tokens: (last token - first token) / (output tokens - 1), "
            "the TPOT its SLO is measured by.",
            _ITL_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to last token.", _REQUEST_BUCKETS)
        self.num_running = Gauge("kvflow:num_requests_running", "Sequences in the running batch.", registry=r)
        self.num_waiting = Gauge("kvflow:num_requests_waiting", "Sequences waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("kvflow:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", registry=r)
        self.kv_blocks = Gauge(
            "kvflow:kv_cache_blocks",
            "KV blocks by state: in_use (held by requests), cached_free (free, still a prefix-cache hit), free. "
            "With sliding-window layers holding only their window, a block is one block of a group of layers "
            "(see the start-up log).",
            ["state"],
            registry=r,
        )
        self.kv_capacity = Gauge(
            "kvflow:kv_cache_capacity_tokens",
            "Tokens the KV pool holds at most: its block slots, or with sliding-window layers holding only their "
            "window, max_model_len requests decoding at once x max_model_len.",
            registry=r,
        )
        self.prompt_tokens = Counter("kvflow:prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter("kvflow:generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter(
            "kvflow:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.preemptions = Counter("kvflow:num_preemptions", "Sequences preempted (recomputed later).", registry=r)
        self.rejected = Counter(
            "kvflow:request_rejected",
            "Requests refused by admission control (HTTP 503), by "
            "reason: queue_full (max_waiting_requests), slo (predicted TTFT past the SLO).",
            ["reason"],
            registry=r,
        )
        self.prefix_queries = Counter(
            "kvflow:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hits = Counter("kvflow:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r)
        self.spec_drafts = Counter(
            "kvflow:spec_decode_num_drafts", "Request-steps that verified draft tokens.", registry=r
        )
        self.spec_draft_tokens = Counter("kvflow:spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.spec_accepted = Counter("kvflow:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.spec_accepted_pos = Counter(
            "kvflow:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by depth in the draft (0 = first).",
            ["position"],
            registry=r,
        )
        self._seen_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self.grammar_compile = hist(
            "structured_output_compile_seconds",
            "Time to compile one grammar (JSON schema, regex, choice, EBNF, tool calls).",
            _COMPILE_BUCKETS,
        )
        self.grammar_mask = hist(
            "structured_output_mask_seconds",
            "Time per step to fill the constrained rows' token bitmasks.",
            _MASK_BUCKETS,
        )
        self.grammar_requests = Counter(
            "kvflow:structured_output_requests", "Sequences constrained by a grammar.", registry=r
        )
        self.grammar_cache_hits = Counter(
            "kvflow:structured_output_cache_hits",
            "Constrained sequences whose grammar was already compiled.",
            registry=r,
        )
        self._seen_grammar = (0, 0)
        self.slo_attained = Counter(
            "kvflow:request_slo_attained",
            "Finished requests that met their SLO (ttft, tpot, all: both).",
            ["slo"],
            registry=r,
        )
        self.slo_missed = Counter(
            "kvflow:request_slo_missed",
            "Finished requests that missed their SLO (ttft, tpot, all), failed ones included.",
            ["slo"],
            registry=r,
        )
        self.goodput = Gauge(
            "kvflow:goodput_requests_per_second",
            "Requests per second that met all their SLOs, over the last minute.",
            registry=r,
        )
        self.queue_time_by_priority = Histogram(
            "kvflow:request_queue_time_by_priority_seconds",
            "Arrival to first scheduled, by request priority.",
            ["priority"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self._seen_slo: dict[str, dict[str, int]] = {"attained": {}, "missed": {}}
        self.step_cost_error = Gauge(
            "kvflow:step_cost_prediction_error",
            "Median relative error of the step-time model's predictions (scheduling, speculation), over recent steps.",
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "kvflow:kv_transfer_bytes",
            "KV bytes moved to or from another engine (P/D disaggregation), by direction.",
            ["direction"],
            registry=r,
        )
        self.kv_transfer_blocks = Counter(
            "kvflow:kv_transfer_blocks",
            "KV blocks moved to or from another engine, by direction.",
            ["direction"],
            registry=r,
        )
        self.kv_transfer_time = hist(
            "kv_transfer_seconds",
            "Time to fetch one request's KV blocks from the producer engine (connect, manifest, payload, checksum).",
            _TRANSFER_BUCKETS,
        )
        self.kv_transfer_failures = Counter(
            "kvflow:kv_transfer_failures",
            "KV fetches that failed (then recomputed or failed per kv_load_failure_policy), by reason.",
            ["reason"],
            registry=r,
        )
        self.kv_leases_expired = Counter(
            "kvflow:kv_transfer_leases_expired",
            "Held KV transfers freed because no consumer fetched them within the lease.",
            registry=r,
        )
        self._seen_transfer: dict[str, int] = {}
        # LoRA adapters (--enable-lora), as vLLM's vllm:lora_requests_info; set only when LoRA is on.
        self.lora_info = Gauge(
            "kvflow:lora_requests_info",
            "LoRA adapters of the running and waiting requests (labels); the value is when it was set.",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=r,
        )
        self.lora_loads = Counter("kvflow:lora_adapter_loads", "LoRA adapters read from their folder.", registry=r)
        self.lora_evictions = Counter(
            "kvflow:lora_adapter_evictions",
            "LoRA adapters evicted: from a resident slot to CPU memory (tier=slot), or from CPU memory (tier=cpu).",
            ["tier"],
            registry=r,
        )
        self._seen_lora = (0, 0, 0)  # loads, slot evictions, CPU evictions already counted
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(finished_reason=reason)  # export zeros from the start
        for reason in ("queue_full", "slo"):
            self.rejected.labels(reason=reason)
        for kind in ("ttft", "tpot", "all"):  # kvflow.engine.slo_tracker.SLO_KINDS
            self.slo_attained.labels(slo=kind)
            self.slo_missed.labels(slo=kind)
        self._last_token_time: dict[str, float] = {}
        self._seen = (0, 0, 0)  # prompt tokens, generation tokens, preemptions already counted
        self._seen_prefix = (0, 0)  # prefix-cache queries, hits
        self._moe: dict | None = None  # the Mixture-of-Experts metrics (record_moe), made on first use
        self._seen_moe: dict = {}

    # ---- engine thread --------------------------------------------------------------------------
    def record_outputs(self, outputs: Iterable[RequestOutput]) -> None:
        for out in outputs:
            m = out.metrics
            rid = out.request_id
            last = m.last_token_time
            prev = self._last_token_time.get(rid)
            if last is not None and last != prev:
                if prev is None:
                    if m.first_token_time is not None:
                        self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                else:
                    self.itl.observe(max(0.0, last - prev))
                self._last_token_time[rid] = last
            if out.finished:
                self._last_token_time.pop(rid, None)
                self._record_finished(out)

    def _record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.success.labels(finished_reason=reason or "abort").inc()
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        self.e2e.observe(max(0.0, end - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            self.queue_time_by_priority.labels(priority=str(m.priority)).observe(
                max(0.0, m.first_scheduled_time - m.arrival_time)
            )
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None and m.last_token_time is not None:
            self.decode_time.observe(max(0.0, m.last_token_time - m.first_token_time))
            tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            if tokens > 1:  # as kvflow.engine.slo_tracker counts TPOT
                self.tpot.observe(max(0.0, (m.last_token_time - m.first_token_time) / (tokens - 1)))

    def record_stats(self, stats) -> None:
        """`stats` is an `EngineStats`: gauges are set, counters advance by what is new."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        mem = getattr(stats, "kv_memory", None)
        if mem is not None:
            self.kv_blocks.labels(state="in_use").set(mem.blocks_in_use)
            self.kv_blocks.labels(state="cached_free").set(mem.blocks_cached_free)
            self.kv_blocks.labels(state="free").set(mem.blocks_free)
        self.kv_capacity.set(getattr(stats, "kv_capacity_tokens", 0))
        seen_p, seen_g, seen_pre = self._seen
        if stats.prompt_tokens_total > seen_p:
            self.prompt_tokens.inc(stats.prompt_tokens_total - seen_p)
        if stats.generation_tokens_total > seen_g:
            self.generation_tokens.inc(stats.generation_tokens_total - seen_g)
        if stats.num_preemptions > seen_pre:
            self.preemptions.inc(stats.num_preemptions - seen_pre)
        self._seen = (
            max(seen_p, stats.prompt_tokens_total),
            max(seen_g, stats.generation_tokens_total),
            max(seen_pre, stats.num_preemptions),
        )
        queries, hits = getattr(stats, "prefix_cache_queries", 0), getattr(stats, "prefix_cache_hits", 0)
        if queries > self._seen_prefix[0]:
            self.prefix_queries.inc(queries - self._seen_prefix[0])
        if hits > self._seen_prefix[1]:
            self.prefix_hits.inc(hits - self._seen_prefix[1])
        self._seen_prefix = (max(queries, self._seen_prefix[0]), max(hits, self._seen_prefix[1]))
        slo = getattr(stats, "slo", None)
        if slo is not None:
            for name, totals, counter in (
                ("attained", slo.attained, self.slo_attained),
                ("missed", slo.missed, self.slo_missed),
            ):
                seen = self._seen_slo[name]
                for kind, n in totals.items():
                    counter.labels(slo=kind).inc(max(0, n - seen.get(kind, 0)))
                    seen[kind] = max(n, seen.get(kind, 0))
            self.goodput.set(slo.goodput)
        error = getattr(stats, "step_cost_error", None)
        if error is not None:
            self.step_cost_error.set(error)
        moe = getattr(stats, "moe", None)
        if moe is not None:
            self.record_moe(moe)
        lora = getattr(stats, "lora", None)
        if lora is not None:
            self.record_lora(lora)
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            drafts, tokens, accepted, per_pos = self._seen_spec
            self.spec_drafts.inc(max(0, spec.num_drafts - drafts))
            self.spec_draft_tokens.inc(max(0, spec.num_draft_tokens - tokens))
            self.spec_accepted.inc(max(0, spec.num_accepted_tokens - accepted))
            for j, n in enumerate(spec.accepted_per_pos):
                self.spec_accepted_pos.labels(position=str(j)).inc(max(0, n - (per_pos[j] if j < len(per_pos) else 0)))
            self._seen_spec = (
                spec.num_drafts,
                spec.num_draft_tokens,
                spec.num_accepted_tokens,
                list(spec.accepted_per_pos),
            )

    def record_lora(self, stats) -> None:
        """`stats`: a LoRAStats. The info gauge as vLLM's: one series, its labels the adapters of
        the running and waiting requests (comma-separated names), its value the time it was set."""
        self.lora_info.clear()  # (only the current set of adapters is a series)
        self.lora_info.labels(
            running_lora_adapters=",".join(stats.running),
            waiting_lora_adapters=",".join(stats.waiting),
            max_lora=str(stats.max_loras),
        ).set(time.time())
        loads, slot, cpu = self._seen_lora
        self.lora_loads.inc(max(0, stats.loads - loads))
        self.lora_evictions.labels(tier="slot").inc(max(0, stats.evictions - slot))
        self.lora_evictions.labels(tier="cpu").inc(max(0, stats.cpu_evictions - cpu))
        self._seen_lora = (max(loads, stats.loads), max(slot, stats.evictions), max(cpu, stats.cpu_evictions))

    def record_structured(self, stats, timings: tuple[list[float], list[float]]) -> None:
        """`stats`: a StructuredOutputStats; `timings`: (compile, mask) durations since the last call."""
        requests, hits = self._seen_grammar
        self.grammar_requests.inc(max(0, stats.requests_total - requests))
        self.grammar_cache_hits.inc(max(0, stats.cache_hits_total - hits))
        self._seen_grammar = (max(requests, stats.requests_total), max(hits, stats.cache_hits_total))
        compiles, masks = timings
        for dt in compiles:
            self.grammar_compile.observe(dt)
        for dt in masks:
            self.grammar_mask.observe(dt)

    def record_kv_transfer(self, stats, times: list[float]) -> None:
        """`stats`: a KVTransferStats snapshot; `times`: fetch durations since the last call."""
        seen = self._seen_transfer

        def advance(key: str, total: int, counter) -> None:
            counter.inc(max(0, total - seen.get(key, 0)))
            seen[key] = max(total, seen.get(key, 0))

        advance("bytes_sent", stats.bytes_sent, self.kv_transfer_bytes.labels(direction="sent"))
        advance("bytes_received", stats.bytes_received, self.kv_transfer_bytes.labels(direction="received"))
        advance("blocks_sent", stats.blocks_sent, self.kv_transfer_blocks.labels(direction="sent"))
        advance("blocks_received", stats.blocks_received, self.kv_transfer_blocks.labels(direction="received"))
        advance("leases", stats.leases_expired, self.kv_leases_expired)
        for reason, n in stats.failures.items():
            advance("failure:" + reason, n, self.kv_transfer_failures.labels(reason=reason))
        for dt in times:
            self.kv_transfer_time.observe(dt)

    def record_moe(self, stats) -> None:
        """`stats`: a MoeRoutingStats (cumulative, from the model): the counters advance by what is
        new; the imbalance gauges take the mean, over the steps since the last call, of each step's
        max / mean tokens per expert. Created on the first call, so a dense model exports none.

        Cardinality: one series per MoE layer (`layer` label), plus layers x experts series for
        `kvflow:moe_expert_tokens_total` when the engine counts per expert (--moe-expert-metrics
        per_expert)."""
        if self._moe is None:
            r = self.registry
            self._moe = {
                "tokens": Counter(
                    "kvflow:moe_layer_tokens",
                    "Mixture-of-Experts: (token, expert) pairs routed in the layer (tokens x top-k).",
                    ["layer"],
                    registry=r,
                ),
                "busiest": Counter(
                    "kvflow:moe_busiest_expert_tokens",
                    "Mixture-of-Experts: per step, the tokens of the layer's busiest expert, summed over steps "
                    "(/ (moe_layer_tokens / experts): the load imbalance over any window, weighted by step size).",
                    ["layer"],
                    registry=r,
                ),
                "imbalance": Gauge(
                    "kvflow:moe_load_imbalance",
                    "Mixture-of-Experts: max / mean tokens per expert in a step (1 = balanced; experts / top-k for "
                    "one token), averaged over the steps since the last update.",
                    ["layer"],
                    registry=r,
                ),
                "imbalance_max": Gauge(
                    "kvflow:moe_load_imbalance_max",
                    "Mixture-of-Experts: kvflow:moe_load_imbalance's max over layers.",
                    registry=r,
                ),
                "experts": Counter(
                    "kvflow:moe_expert_tokens",
                    "Mixture-of-Experts: tokens routed to each expert of each layer (--moe-expert-metrics per_expert).",
                    ["layer", "expert"],
                    registry=r,
                ),
            }
            self._seen_moe = {"steps": 0, "tokens": [0] * len(stats.layers), "busiest": [0] * len(stats.layers)}
            self._seen_moe["imbalance"] = [0.0] * len(stats.layers)
            self._seen_moe["experts"] = [[0] * stats.num_experts for _ in stats.layers]
        m, seen = self._moe, self._seen_moe
        steps = stats.num_steps - seen["steps"]
        means = []
        for i, layer in enumerate(stats.layers):
            name = str(layer)
            m["tokens"].labels(layer=name).inc(max(0, stats.tokens[i] - seen["tokens"][i]))
            m["busiest"].labels(layer=name).inc(max(0, stats.busiest[i] - seen["busiest"][i]))
            if steps > 0:
                means.append((stats.imbalance_sum[i] - seen["imbalance"][i]) / steps)
                m["imbalance"].labels(layer=name).set(means[-1])
            if stats.expert_tokens is not None:
                row, seen_row = stats.expert_tokens[i], seen["experts"][i]
                for e, n in enumerate(row):
                    if n > seen_row[e]:
                        m["experts"].labels(layer=name, expert=str(e)).inc(n - seen_row[e])
                seen["experts"][i] = list(row)
        if means:
            m["imbalance_max"].set(max(means))
        self._seen_moe.update(
            steps=stats.num_steps,
            tokens=list(stats.tokens),
            busiest=list(stats.busiest),
            imbalance=list(stats.imbalance_sum),
        )

    def record_rejected(self, reason: str = "queue_full") -> None:
        self.rejected.labels(reason=reason).inc()

    # ---- any thread -----------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatLogger:
    """One INFO line every `interval_s` while the engine is busy."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last = (0, 0)  # prompt tokens, generation tokens at the last line

    def maybe_log(self, stats, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return False
        p, g = stats.prompt_tokens_total, stats.generation_tokens_total
        hit_rate = getattr(stats, "prefix_cache_hit_rate", None)
        slo = getattr(stats, "slo", None)
        slo_text = (
            "" if slo is None else (f", goodput: {slo.goodput:.2f} req/s, SLO attainment: {100 * slo.attainment:.1f}%")
        )
        spec = getattr(stats, "spec_decode", None)
        spec_text = ""
        if spec is not None and spec.num_drafts:
            per_pos = ", ".join(f"{n / spec.num_drafts:.2f}" for n in spec.accepted_per_pos)
            spec_text = (
                f", spec decode: mean acceptance length {spec.mean_acceptance_length:.2f}, "
                f"acceptance rate {100 * spec.acceptance_rate:.1f}%, per position [{per_pos}]"
            )
        logger.info(
            "running: %d reqs, waiting: %d reqs, prompt throughput: %.1f tok/s, generation throughput: "
            "%.1f tok/s, KV cache usage: %.1f%%, preemptions: %d%s%s%s",
            stats.num_running,
            stats.num_waiting,
            (p - self._last[0]) / elapsed,
            (g - self._last[1]) / elapsed,
            100 * stats.kv_cache_usage,
            stats.num_preemptions,
            "" if hit_rate is None else f", prefix cache hit rate: {100 * hit_rate:.1f}%",
            slo_text,
            spec_text,
        )
        self._last_time, self._last = now, (p, g)
        return True

    def reset(self, stats, now: float | None = None) -> None:
        """Start a new interval (the engine just became busy after idling)."""
        self._last_time = time.monotonic() if now is None else now
        self._last = (stats.prompt_tokens_total, stats.generation_tokens_total)
