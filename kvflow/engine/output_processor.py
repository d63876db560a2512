"""From sampled tokens to `RequestOutput`s: detokenization, stop strings, logprobs, timings.

One `ParentState` per user request, one `ChildState` per completion (n > 1 gives n children).
Outputs are cumulative. While a request with stop strings is running, the tail that could still
turn out to be the start of a stop string is held back, so streamed text is always a prefix of
the final text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvflow.core.request import Request, RequestStatus
from kvflow.engine.detokenizer import IncrementalDetokenizer, TokenBytes
from kvflow.outputs import CompletionOutput, ExpertTrace, Logprob, RequestMetrics, RequestOutput
from kvflow.sampling_params import SamplingParams


@dataclass
class ChildState:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    # return_expert_trace: position -> the experts its token was routed to, per MoE layer (a
    # position recomputed after preemption, or verified again, takes its latest routing).
    expert_trace: dict[int, list[list[int]]] | None = None
    expert_layers: list[int] = field(default_factory=list)

    def visible_text(self) -> str:
        if self.finish_reason is None and self.params.stop:
            hold = max(len(s) for s in self.params.stop) - 1
            return self.text[: max(0, len(self.text) - hold)]
        return self.text

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.visible_text(),
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            expert_trace=self._expert_trace() if self.finish_reason is not None else None,
        )

    def _expert_trace(self) -> ExpertTrace | None:
        """The trace of the positions whose token is final (all but the last output token, which
        the model never computed): the contiguous run of recorded positions ending there."""
        if self.expert_trace is None:
            return None
        end = self.num_prompt_tokens + len(self.token_ids) - 1
        start = end
        while start - 1 in self.expert_trace:
            start -= 1
        return ExpertTrace.from_experts(self.expert_layers, start, [self.expert_trace[p] for p in range(start, end)])


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    metrics: RequestMetrics
    error: str | None = None
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: prompt position -> its token's logprob and the top N
    # (whichever child computed the position; None: not asked for)
    prompt_logprobs: dict[int, dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.output() for c in self.children],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            prompt_logprobs=self._prompt_logprobs(),
        )

    def _prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's list (None for the first token), once every prompt position has been scored."""
        scored = self.prompt_logprobs
        if scored is None or len(scored) < len(self.prompt_token_ids) - 1:
            return None
        return [None, *(scored[p] for p in range(1, len(self.prompt_token_ids)))]


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, expert_layers: list[int] | None = None) -> None:
        """`expert_layers`: a Mixture-of-Experts model's MoE decoder layers (for expert traces)."""
        self.tokenizer = tokenizer
        self.token_bytes = None if tokenizer is None else TokenBytes(tokenizer)
        self.parents: dict[str, ParentState] = {}
        self.expert_layers = list(expert_layers or ())

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        child_params: list[SamplingParams],
        arrival_time: float,
        metrics: RequestMetrics | None = None,
    ) -> None:
        children = [
            ChildState(
                index=i,
                params=p,
                detokenizer=None
                if self.tokenizer is None
                else IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p.skip_special_tokens),
                logprobs=[] if p.logprobs is not None else None,
                num_prompt_tokens=len(prompt_token_ids),
                expert_trace={} if p.return_expert_trace else None,
                expert_layers=self.expert_layers,
            )
            for i, p in enumerate(child_params)
        ]
        self.parents[request_id] = ParentState(
            request_id, prompt, prompt_token_ids, children, metrics or RequestMetrics(arrival_time=arrival_time)
        )
        if any(p.prompt_logprobs is not None for p in child_params):
            self.parents[request_id].prompt_logprobs = {}

    def process(
        self, advanced: list[tuple[Request, list[int]]], finished: list[Request], logprobs: dict[str, list[tuple]]
    ) -> tuple[list[RequestOutput], list[str], dict[str, str]]:
        """`advanced`: each request that got tokens this step, with them (several with speculative
        decoding); `logprobs`: per request, one entry per token. Returns the outputs of parents
        that changed, the child ids a stop string ended, and the parents whose processing raised
        (parent id -> error; the caller ends them).

        Everything done here for one request (detokenizing, stop strings, logprobs, and whatever a
        later feature adds to `_advance`) runs inside one guard: its exception fails that request
        alone."""
        now = time.monotonic()
        done = {r.request_id for r in finished}
        changed: dict[str, ParentState] = {}
        stopped: list[str] = []
        failed: dict[str, str] = {}
        for req, tokens in advanced:
            if req.parent_id in failed:
                continue
            parent = self.parents[req.parent_id]
            try:
                if self._advance(parent, req, tokens, req.request_id in done, logprobs.get(req.request_id), now):
                    stopped.append(req.request_id)
            except Exception as e:
                failed[parent.request_id] = f"{type(e).__name__}: {e}"
                continue
            changed[parent.request_id] = parent
        outputs = []
        for parent in changed.values():
            if parent.request_id in failed:
                continue
            if parent.finished:
                parent.metrics.finished_time = now
                del self.parents[parent.request_id]
            outputs.append(parent.output())
        return outputs, stopped, failed

    def _advance(
        self,
        parent: ParentState,
        req: Request,
        tokens: list[int],
        is_done: bool,
        logprobs: list[tuple] | None,
        now: float,
    ) -> bool:
        """This step's new tokens of one child; True when a stop string ended it (the tokens after
        the one that completed the stop string are dropped)."""
        child = parent.children[req.index]
        m = parent.metrics
        if m.first_scheduled_time is None:
            m.first_scheduled_time = req.first_scheduled_time
            parent.num_cached_tokens = max(req.num_cached_tokens, 0)
            m.kv_load_times = req.kv_load_times
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        for i, token in enumerate(tokens):
            child.token_ids.append(token)
            if child.logprobs is not None and logprobs is not None:
                child.logprobs.append(self._logprob_dict(token, logprobs[i]))
            last = i == len(tokens) - 1
            ended_by_token = last and is_done and req.status == RequestStatus.FINISHED_STOPPED
            if child.detokenizer is not None and not ended_by_token:
                self._append_text(child, child.detokenizer.add(token))
            if child.finish_reason is not None:  # a stop string matched
                break
        if is_done:
            if child.finish_reason is None:  # a stop string takes precedence
                child.finish_reason = req.status.finish_reason
                child.stop_reason = req.stop_reason
            return False
        return child.finish_reason is not None

    @staticmethod
    def _append_text(child: ChildState, delta: str) -> None:
        if not delta:
            return
        old_len = len(child.text)
        child.text += delta
        if not child.params.stop:
            return
        longest = max(len(s) for s in child.params.stop)
        start = max(0, old_len - longest + 1)
        hits = [(child.text.find(s, start), s) for s in child.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            idx, stop = min(hits)
            child.text = child.text[: idx + (len(stop) if child.params.include_stop_str_in_output else 0)]
            child.finish_reason = "stop"
            child.stop_reason = stop

    def _logprob_dict(self, token: int, entry: tuple) -> dict[int, Logprob]:
        chosen, rank, top_ids, top_vals = entry
        decode = self.token_bytes.text if self.token_bytes is not None else (lambda t: None)
        result = {tid: Logprob(val, r + 1, decode(tid)) for r, (tid, val) in enumerate(zip(top_ids, top_vals))}
        if token not in result:
            result[token] = Logprob(chosen, rank, decode(token))
        return result

    def record_expert_trace(self, parent_id: str, index: int, start: int, experts: list[list[list[int]]]) -> None:
        """A step's routing of completion `index` of a request that asked for an expert trace: the
        experts per MoE layer of its tokens at positions start, start + 1, ..."""
        parent = self.parents.get(parent_id)
        trace = None if parent is None else parent.children[index].expert_trace
        if trace is not None:
            for i, per_layer in enumerate(experts):
                trace[start + i] = per_layer

    def record_prompt_logprobs(self, parent_id: str, start: int, entries: list[tuple]) -> None:
        """A step's prompt logprobs of a request: the entries of prompt positions start, start + 1, ..."""
        parent = self.parents.get(parent_id)
        if parent is None or parent.prompt_logprobs is None:
            return
        for i, entry in enumerate(entries):
            pos = start + i
            parent.prompt_logprobs[pos] = self._logprob_dict(parent.prompt_token_ids[pos], entry)

    def embedded(self, req: Request, embedding: list[float] | None) -> RequestOutput | None:
        """An embedding request (SamplingParams.pooling) finished with its prefill: its output."""
        parent = self.parents.pop(req.parent_id, None)
        if parent is None:
            return None
        now = time.monotonic()
        m = parent.metrics
        m.first_scheduled_time = req.first_scheduled_time
        parent.num_cached_tokens = max(req.num_cached_tokens, 0)
        m.first_token_time = m.last_token_time = m.finished_time = now
        for c in parent.children:
            c.finish_reason = "stop" if embedding is not None else "error"
        if embedding is None:
            parent.error = "request failed: the model returned no embedding"
        out = parent.output()
        out.embedding = embedding
        return out

    def finish(self, request_id: str, reason: str, error: str | None = None) -> RequestOutput | None:
        """End a whole user request from outside (abort, engine error)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        for c in parent.children:
            if c.finish_reason is None:
                c.finish_reason = reason
        parent.error = error
        parent.metrics.finished_time = time.monotonic()
        return parent.output()

    def has(self, request_id: str) -> bool:
        return request_id in self.parents
