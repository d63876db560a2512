"""Iteration-level scheduler: which requests run this step, and how many tokens each.

Every step has a token budget. Decoding requests are served first (a token each, plus drafts),
then prompts get prefill chunks that fill the rest of the budget (Sarathi-style stall-free
chunked prefill): running requests part-way through their prompt and waiting ones, in the
policy's prefill order (fcfs: the started prompts first). When the pool runs out
of blocks, the last running request (in the policy's order) is preempted: its blocks are freed and
it is recomputed later from its prompt plus the tokens it had already generated.

The policy (core/sched/: fcfs, priority, slo) orders running and waiting requests, sizes the
budget and may refuse a request at arrival; fairness (VTC) interleaves clients. The scheduler keeps
the mechanics. It never touches tensors; it hands the model runner a `SchedulerOutput`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.core.attention_sinks import KVShift, StreamingKV
from kvflow.core.kv_cache_manager import ComputedBlocks, KVCacheManager, cdiv
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched.fairness import VirtualTokenCounter
from kvflow.core.sched.policy import QueueView, SchedulingPolicy
from kvflow.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import SamplingParams


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the sequence: sample a next token
    params: SamplingParams
    num_prompt_tokens: int
    # For penalties: what the sequence holds so far (only filled when a penalty is on).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # Draft tokens at the end of token_ids, to verify (speculative decoding): the runner returns
    # the accepted ones and one token of its own.
    spec_token_ids: list[int] = field(default_factory=list)
    # Attention sinks: tokens of the sequence dropped from its cache before these; the model sees
    # them at cache positions start_pos - num_dropped_tokens onwards (kvflow.core.attention_sinks).
    num_dropped_tokens: int = 0
    lora: LoRARequest | None = None  # the adapter its rows run under (None: the base model)
    # With a hybrid KV layout (kvflow.core.kv_groups): the block tables of KV groups 1.. (group 0's
    # is block_table); empty otherwise.
    group_block_tables: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # The KV connector's work this step (loads, saves, transfers), for its worker side.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Attention sinks: keys to re-rotate before this step's forward pass (blocks that moved down).
    kv_shifts: list[KVShift] = field(default_factory=list)
    # Requests that waited past max_queue_time_s (removed from the scheduler; the engine fails them).
    timed_out: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        meta = self.kv_connector_metadata
        return not self.seqs and (meta is None or meta.is_empty)


@dataclass
class KVMemoryStats:
    blocks_in_use: int
    blocks_cached_free: int
    blocks_free: int
    tokens_stored: int  # distinct token positions with KV in held blocks
    token_slots_held: int
    # What pre-PagedAttention systems would have reserved for the same running requests:
    # one contiguous region of prompt + max_tokens tokens each.
    tokens_reserved_contiguous: int

    @property
    def utilization(self) -> float:
        """Tokens stored / slots in held blocks: 1 - internal fragmentation."""
        return self.tokens_stored / self.token_slots_held if self.token_slots_held else 1.0


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        policy: SchedulingPolicy | None = None,
        fairness: VirtualTokenCounter | None = None,
        max_queue_time_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        connector: KVConnectorScheduler | None = None,
        streaming: StreamingKV | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy or SchedulingPolicy()
        self.fairness = fairness
        self.max_queue_time_s = max_queue_time_s
        self.clock = clock
        self.connector = connector
        self.max_loras = max_loras  # most distinct LoRA adapters among the running (None: no adapters)
        self.streaming = streaming  # attention sinks + a recent window (None: a request keeps all its KV)
        if connector is not None:
            connector.bind(kv_cache)
        self.waiting: deque[Request] = deque()
        # Admitted to an asynchronous KV load (a remote prefill): holding blocks, not yet runnable.
        self.waiting_for_kv: dict[str, Request] = {}
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- intake -------------------------------------------------------------------------
    def check_admission(self, request: Request) -> None:
        """Raises AdmissionRejected when the policy refuses the request at arrival."""
        self.policy.check_admission(request, self._view(), self.clock())

    def add_request(self, request: Request) -> None:
        if self.fairness is not None:
            self.fairness.on_arrival(request, [*self.waiting, *self.running])
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _view(self) -> QueueView:
        return QueueView(self.running, self.waiting, self.max_num_batched_tokens)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests wherever they are (abort, stop string, error); frees their blocks."""
        done = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_kv[rid]
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Free a finished request's blocks, or hold them for a KV transfer the connector asks for."""
        req.status = status
        key = None
        if self.connector is not None:
            key, req.kv_transfer_params = self.connector.request_finished(
                req, self.kv_cache.block_tables.get(req.request_id, [])
            )
        if key is None:
            self.kv_cache.free(req)
        else:
            self.kv_cache.hold(req, key)

    def has_work(self) -> bool:
        """Something to compute (requests waiting for their KV to arrive are not)."""
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def kv_memory_stats(self) -> KVMemoryStats:
        """Where the KV pool's blocks are, and how full the held ones are."""
        pool, bs = self.kv_cache.pool, self.kv_cache.block_size
        held = pool.num_blocks - pool.num_reserved - pool.num_free_blocks
        empty_slots = sum(self.kv_cache.empty_slots(r) for r in self.running)
        cached_free = pool.num_cached_free_blocks
        return KVMemoryStats(
            blocks_in_use=held,
            blocks_cached_free=cached_free,
            blocks_free=pool.num_free_blocks - cached_free,
            tokens_stored=held * bs - empty_slots,
            token_slots_held=held * bs,
            tokens_reserved_contiguous=sum(len(r.prompt_token_ids) + r.max_tokens for r in self.running),
        )

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(timed_out=self._expire_waiting(now))
        self.running = self.policy.running_order(self.running, now)
        self._displace(out, now)
        budget = self.policy.token_budget(self._view(), now)
        scheduled: set[str] = set()

        # Decodes first (a token each; drafts ride along as extra tokens inside the same budget).
        pressure = False  # blocks ran out for the running requests
        for req in [r for r in self.running if not r.prefilling]:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted for an earlier one
                continue
            n = self._make_room(
                req, min(req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids), budget), out
            )
            fits, squeezed = self._allocate_running(req, n, scheduled, out)
            pressure |= squeezed
            if fits:
                budget -= self._schedule(out, scheduled, req, n)

        # Then prefill chunks, running ones and new admissions in the policy's order (fcfs: the
        # running ones first). New work is admitted only when the running requests did not run
        # out of blocks this step.
        partial = [r for r in self.running if r.prefilling and r.request_id not in scheduled]
        partial_ids = {r.request_id for r in partial}
        admitting = not pressure
        for req in self.policy.prefill_order(partial, self._admission_order(now), now):
            if budget <= 0:
                break
            if req.request_id in partial_ids:
                if req.status != RequestStatus.RUNNING:  # preempted for an earlier one
                    continue
                n = self._make_room(req, min(req.num_tokens - req.num_computed_tokens, budget), out)
                fits, squeezed = self._allocate_running(req, n, scheduled, out)
                admitting &= not squeezed
                if fits:
                    budget -= self._schedule(out, scheduled, req, n)
            elif admitting and req.status != RequestStatus.RUNNING:
                if len(self.running) >= self.max_num_seqs:
                    admitting = False
                    continue
                if not self._lora_fits(req):
                    continue  # its adapter would be one too many this step: later ones may fit
                n = self._admit(req, budget, now)
                if n is None:
                    admitting = False
                elif n:
                    budget -= self._schedule(out, scheduled, req, n)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        return out

    def _schedule(self, out: SchedulerOutput, scheduled: set[str], req: Request, n: int) -> int:
        out.seqs.append(self._scheduled(req, n))
        scheduled.add(req.request_id)
        return n

    def _lora_fits(self, req: Request) -> bool:
        """Whether admitting req keeps the running requests within max_loras distinct adapters
        (every step then is: decodes and prefill chunks are all of running requests)."""
        if req.lora is None or self.max_loras is None:
            return True
        ids = {r.lora.lora_int_id for r in self.running if r.lora is not None}
        return req.lora.lora_int_id in ids or len(ids) < self.max_loras

    def _make_room(self, req: Request, n: int, out: SchedulerOutput) -> int:
        """Attention sinks: drop the blocks the policy says must go before req computes n more
        tokens (their successors' keys are re-rotated by the runner); returns the tokens to compute
        (a prefill chunk may be cut to the room the window leaves)."""
        if self.streaming is None:
            return n
        drop, n = self.streaming.plan(req.num_computed_tokens - self.kv_cache.dropped_tokens(req), n)
        if drop:
            moved = self.kv_cache.drop_blocks(req, self.streaming.sink_blocks, drop)
            if moved:
                out.kv_shifts.append(KVShift(list(moved), drop * self.kv_cache.block_size))
        return n

    def _allocate_running(self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput) -> tuple[bool, bool]:
        """Slots for n more tokens of a running request, preempting the last running request not
        yet scheduled this step (in the policy's order) while blocks run out. Returns (req got
        them, something was preempted or req itself was)."""
        squeezed = False
        while not self.kv_cache.allocate_slots(req, n):
            squeezed = True
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False, True
        return True, squeezed

    def _admit(self, req: Request, budget: int, now: float) -> int | None:
        """Admit a waiting request with a first chunk of at most `budget` tokens: the chunk's size,
        0 when it went to wait for its KV from outside (no compute), None when it did not fit."""
        if req.params.pooling == "mean" or req.params.prompt_logprobs is not None:
            # every prompt position's hidden state is needed (mean pooling, prompt logprobs)
            cached, num_external, is_async = ComputedBlocks(), 0, False
        else:
            cached = self.kv_cache.get_computed_blocks(req)
            num_external, is_async = self._external_tokens(req, cached)
        if is_async:
            return 0 if self._start_async_load(req, cached) else None
        num_cached = cached.num_blocks * self.kv_cache.block_size
        n = min(req.num_tokens - num_cached, budget)
        if self.streaming is not None:  # a prompt longer than the cache holds streams through it
            n = self.streaming.plan(num_cached, n)[1]
        if not self.kv_cache.allocate_slots(req, n, cached):
            return None
        if num_external:
            self.connector.update_state_after_alloc(req, self._external_blocks(req, cached), num_external)
        self.waiting.remove(req)
        self.kv_cache.record_lookup(req.num_tokens, num_cached)
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            req.num_cached_tokens = num_cached
        self.running.append(req)
        return n

    # ---- KV from outside the pool (connector) ------------------------------------------------
    def _external_tokens(self, req: Request, cached: ComputedBlocks) -> tuple[int, bool]:
        """Tokens after the pool's hits that the connector supplies (recorded in `cached`)."""
        if self.connector is None:
            return 0, False
        bs = self.kv_cache.block_size
        num, is_async = self.connector.get_num_new_matched_tokens(req, len(cached.blocks) * bs)
        cached.num_external_blocks = num // bs
        return num, is_async

    def _external_blocks(self, req: Request, cached: ComputedBlocks) -> list[int]:
        start = len(cached.blocks)  # an admitted request's table: pool hits, external blocks, new ones
        return self.kv_cache.block_table(req)[start : start + cached.num_external_blocks]

    def _start_async_load(self, req: Request, cached: ComputedBlocks) -> bool:
        """Give req the blocks its remote KV will land in; it waits (no compute) until the
        worker reports them loaded. Their hashes enter the prefix cache only then."""
        if not self.kv_cache.allocate_slots(req, 0, cached, register=False):
            return False
        self.connector.update_state_after_alloc(
            req, self._external_blocks(req, cached), cached.num_external_blocks * self.kv_cache.block_size
        )
        self.waiting.remove(req)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.kv_load_times = (self.clock(), None)
        self.waiting_for_kv[req.request_id] = req
        return True

    def update_kv_transfers(self, output: KVConnectorOutput | None) -> list[tuple[Request, str]]:
        """Act on the connector's finished transfers: free held blocks that were sent, requeue
        requests whose KV arrived (their blocks become prefix-cache hits for the re-admission)
        or whose load failed (recomputed, or returned as (request, why) to fail under the
        `fail` policy)."""
        if self.connector is None or output is None or output.is_empty:
            return []
        self.connector.update_connector_output(output)
        for key in output.finished_sending:
            self.kv_cache.release_held(key)
        for rid in output.finished_recving:
            req = self.waiting_for_kv.pop(rid, None)
            if req is not None:
                if req.kv_load_times is not None:
                    req.kv_load_times = (req.kv_load_times[0], self.clock())
                self.kv_cache.register_loaded(req)
                self._requeue(req)
        failed = []
        for rid, why in output.failed_recving.items():
            req = self.waiting_for_kv.pop(rid, None)
            if req is None:
                continue
            if self.connector.load_failure_policy == "recompute":
                self._requeue(req)
            else:
                del self.requests[rid]
                self._finish(req, RequestStatus.FINISHED_ERROR)
                failed.append((req, why))
        return failed

    def _requeue(self, req: Request) -> None:
        self.kv_cache.free(req)  # loaded blocks stay cached-free: found again at admission
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _admission_order(self, now: float) -> list[Request]:
        order = self.policy.waiting_order(self.waiting, now)
        return self.fairness.order(order) if self.fairness is not None else order

    def _displace(self, out: SchedulerOutput, now: float) -> None:
        """Before anything is allocated this step: while the first waiting request cannot get in
        (max_num_seqs reached, or too few free blocks for its prompt) and the policy lets it
        displace the last running request, preempt that one."""
        while self.waiting and self.running:
            cand = self.policy.waiting_order(self.waiting, now)[0]
            victim = self.running[-1]
            need = cdiv(min(cand.num_tokens, self.max_num_batched_tokens), self.kv_cache.block_size)
            need *= self.kv_cache.num_groups  # a first chunk needs its blocks in every KV group
            blocked = len(self.running) >= self.max_num_seqs or self.kv_cache.num_free_blocks < need
            if not blocked or not self.policy.may_displace(cand, victim, now):
                return
            self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim.request_id)

    def _expire_waiting(self, now: float) -> list[Request]:
        """Requests that have waited past max_queue_time_s without ever being scheduled."""
        limit = self.max_queue_time_s
        if limit is None:
            return []
        late = [r for r in self.waiting if r.first_scheduled_time is None and now - r.arrival_time > limit]
        for req in late:
            self.waiting.remove(req)
            del self.requests[req.request_id]
            req.status = RequestStatus.FINISHED_ERROR
        return late

    def _scheduled(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        p = req.params
        wants_history = p.has_penalties or p.prompt_logprobs is not None or bool(p._bad_words_token_ids)
        own = min(n, req.num_tokens - start)
        spec = req.spec_token_ids[: n - own]  # the budget may cut the drafts short
        if self.fairness is not None:
            self.fairness.charge(req, max(0, min(start + own, len(req.prompt_token_ids)) - start), 0)
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.token_ids_between(start, start + own) + spec,
            start_pos=start,
            num_dropped_tokens=self.kv_cache.dropped_tokens(req),
            block_table=self.kv_cache.block_table(req),
            sample=start + own == req.num_tokens,
            params=p,
            num_prompt_tokens=len(req.prompt_token_ids),
            prompt_token_ids=req.prompt_token_ids if wants_history else None,
            output_token_ids=req.output_token_ids if wants_history else None,
            spec_token_ids=spec,
            lora=req.lora,
            group_block_tables=self.kv_cache.group_block_tables(req),
        )

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids = []
        self.kv_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> tuple[list[tuple[Request, list[int]]], list[Request]]:
        """Advance requests by what the step computed: (each request that got tokens, with them),
        and the finished requests. With drafts, `sampled` holds the accepted drafts then the
        verifier's own token; the KV of rejected drafts is left to be overwritten (only positions
        below num_computed_tokens count)."""
        advanced, finished = [], []
        now = self.clock()
        for seq in out.seqs:
            req = self.requests.get(seq.request_id)
            if req is None:  # aborted while the step ran
                continue
            req.spec_token_ids = []
            tokens = sampled.get(seq.request_id) if seq.sample else None
            accepted = len(tokens) - 1 if tokens else 0
            req.num_computed_tokens += len(seq.token_ids) - len(seq.spec_token_ids) + accepted
            if seq.sample and req.params.pooling is not None:  # an embedding: done after its prefill
                self.requests.pop(req.request_id)
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                finished.append(req)
                continue
            if tokens is None:  # a prefill chunk, or its sampling failed (the engine ends it)
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            if self.fairness is not None:
                self.fairness.charge(req, 0, len(tokens))
            new = []
            for token in tokens:
                req.output_token_ids.append(token)
                new.append(token)
                status = self._check_stop(req, token)
                if status is not None:  # a stop inside an accepted run ends the request there
                    self.requests.pop(req.request_id)
                    self.running.remove(req)
                    self._finish(req, status)
                    finished.append(req)
                    break
            advanced.append((req, new))
        return advanced, finished

    @staticmethod
    def _check_stop(req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in p._eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
