"""The scheduler's view of one sequence being generated."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # holds blocks while a KV connector fills them
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(eq=False)
class Request:
    """One sequence. A user request with n > 1 becomes n of these (see `parent_id`)."""

    request_id: str
    parent_id: str
    index: int  # which of the parent's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never past max_model_len
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV is in the cache. Drops to 0 on preemption (recompute).
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    # P/D consumer: when the fetch of its prompt's KV from the producer began and ended (monotonic)
    kv_load_times: tuple[float, float | None] | None = None
    # Content hashes of the full blocks so far (prefix caching); tokens never change, so they stay
    # valid across preemption.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first scheduling
    # Draft tokens (speculative decoding) to verify with the next step; never part of the sequence
    # until verified.
    spec_token_ids: list[int] = field(default_factory=list)
    # Scheduling: lower priority first (priority policy); the client (fairness); SLOs in seconds
    # (None: none), resolved from the request and the server's defaults.
    priority: int = 0
    client: str | None = None
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    first_token_time: float | None = None  # when the first output token came (scheduler clock)
    # Set when it finishes on a KV producer: where a decode engine can fetch its KV (to the client).
    kv_transfer_params: dict | None = None
    # The LoRA adapter it runs under (None: the base model); part of its blocks' prefix-cache keys.
    lora: LoRARequest | None = None
    # vLLM's cache_salt: part of its blocks' prefix-cache keys, so only requests with the same salt
    # share cached KV (a tenant's prompts cannot be probed by another's time to first token).
    cache_salt: str | None = None

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def cache_key(self) -> bytes:
        """What its blocks' prefix-cache hashes add: the adapter's identity (nothing for the base
        model) and the cache salt (nothing without one)."""
        key = b"" if self.lora is None else self.lora.cache_key
        return key if self.cache_salt is None else key + b"\0salt:" + self.cache_salt.encode()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefilling(self) -> bool:
        """More than its next token left to compute: a prompt (or a preempted request's recompute)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
