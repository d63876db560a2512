"""What the engine returns, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class ExpertTrace:
    """Which experts a Mixture-of-Experts model routed each token of one completion to
    (`SamplingParams.return_expert_trace`), and how far back each was last active.

    Token t of the trace is the token at position `start + t` of the sequence (the prompt, then
    the output): every token the model computed for this completion, from the first one it
    computed (positions before `start` came from the prefix cache) to the one before the last
    output token (the last one is never fed to the model). `experts[t][l]`: the top-k experts of
    MoE layer l (decoder layer `layers[l]`), best first; `distances[t][l][j]`: tokens since expert
    `experts[t][l][j]` of that layer was last chosen by a token of the trace (1: by the previous
    token), None where it had not been (ProfInfer's reuse distance, per layer and expert)."""

    layers: list[int]
    start: int
    experts: list[list[list[int]]]
    distances: list[list[list[int | None]]]

    @classmethod
    def from_experts(cls, layers: list[int], start: int, experts: list[list[list[int]]]) -> ExpertTrace:
        last: dict[tuple[int, int], int] = {}  # (MoE layer, expert) -> the last token that chose it
        distances = []
        for t, per_layer in enumerate(experts):
            row = []
            for layer, chosen in enumerate(per_layer):
                row.append([None if (layer, e) not in last else t - last[(layer, e)] for e in chosen])
                for e in chosen:
                    last[(layer, e)] = t
            distances.append(row)
        return cls(layers, start, experts, distances)

    def to_dict(self) -> dict:
        return {"layers": self.layers, "start": self.start, "experts": self.experts, "distances": self.distances}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None
    # With return_expert_trace, on the finished completion: the experts each token was routed to.
    expert_trace: ExpertTrace | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps on one monotonic clock (time.monotonic)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    # P/D consumer: the fetch of the prompt's KV from the producer engine (start, end; end None: failed)
    kv_load_times: tuple[float, float | None] | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # What the request asked for (seconds; None: no SLO), for SLO attainment and goodput.
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    priority: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = field(default=None)
    # Prefill/decode disaggregation: what a producer engine returns for the decode engine
    kv_transfer_params: dict | None = None
    # An embedding request (SamplingParams.pooling), once finished: the pooled, L2-normalised
    # final hidden state of its prompt (its one completion holds no tokens).
    embedding: list[float] | None = None
    # SamplingParams.prompt_logprobs: per prompt token, its logprob and the top N (None for the
    # first token, which nothing predicts), as vLLM returns them; set once the prompt is computed.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class EmbeddingOutput:
    """vLLM's `EmbeddingOutput`: the pooled, L2-normalised final hidden state (hidden_size floats)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, shaped like vLLM's `EmbeddingRequestOutput`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    """vLLM's `ScoringOutput`: a text pair's score (kvflow.entrypoints.scoring)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair, shaped like vLLM's: for an embedding model,
    `prompt_token_ids` are the first text's tokens followed by the second's."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
