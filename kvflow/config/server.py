"""`ServerConfig`: the options of `kvflow serve` beyond the engine's (each is a `--dashed-flag`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config.options import check_choices, check_otlp_endpoint, option, positive

# The tool-call formats kvflow/entrypoints/openai/tool_parsers.py implements, and the router
# policies kvflow/router/policies.py implements (each registers under one of these names).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "generic")
# The reasoning formats kvflow/entrypoints/openai/reasoning_parsers.py implements.
REASONING_PARSERS = ("qwen3", "deepseek_r1")
ROUTER_POLICIES = ("round_robin", "least_loaded", "cache_aware")
DATA_PARALLEL_BACKENDS = ("mp", "ray")


@dataclass
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind; 0.0.0.0 exposes the server to the network")
    port: int = option(8000, "TCP port")
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every API route (/health and /metrics stay open); "
        "also read from $KVFLOW_API_KEY",
    )
    served_model_name: list[str] | None = option(
        None,
        "the model name(s) clients send and /v1/models lists (space- or comma-separated; default: the "
        "model's name); a request may name any of them, responses name the first (as vLLM)",
    )
    max_waiting_requests: int = option(
        512, "admission control: past this many waiting sequences, requests get 503 + Retry-After"
    )
    max_request_body_bytes: int = option(4 * 2**20, "larger request bodies get 413")
    log_interval_s: float = option(5.0, "seconds between stats log lines while busy")
    shutdown_grace_s: float = option(
        30.0, "on SIGTERM, seconds in-flight requests get to finish before they are aborted"
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "OpenTelemetry: send a span per request (queueing, prefill chunks, preemptions, KV transfer, "
        "first token) over OTLP/HTTP to this collector URL (e.g. http://127.0.0.1:4318); a client's "
        "W3C traceparent header is honoured. Off when unset",
    )
    allowed_origins: list[str] | None = option(
        None,
        "CORS: origins that browsers may call the API from (comma-separated; '*' for any); without "
        "it no CORS headers are sent",
    )
    tool_call_parser: str = option(
        "auto",
        "how the chat template writes tool calls: auto (from the template), hermes, llama3_json, "
        "mistral, or generic (kvflow's JSON protocol, for templates without tool support)",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = option(
        None,
        "split a thinking model's output: the text between think tags goes to reasoning_content, the "
        "rest to content; a response_format or tool grammar then applies after the reasoning. qwen3 "
        "(<think>...</think> written by the model) or deepseek_r1 (the template opens <think> in the "
        "prompt); unset: the output is all content",
        choices=(None, *REASONING_PARSERS),
    )
    trust_request_chat_template: bool = option(
        False,
        "accept a chat request's own `chat_template` (vLLM's extra); off, such a request is refused (400): "
        "a template is code the server runs (in Jinja's sandbox)",
    )
    responses_store_size: int = option(
        1024,
        "Responses API: how many responses (those with store: true) are kept in memory for "
        "previous_response_id and GET /v1/responses/{id}, the least recently used dropped first (0: none)",
    )
    data_parallel_size: int = option(
        1,
        "data parallelism: start this many engine replicas (processes on 127.0.0.1 ports, each pinned "
        "to an even share of this process's CPUs, OMP_NUM_THREADS = that share) behind one router on "
        "--host/--port; every other flag applies to each replica. GET /replicas lists them",
    )
    router_policy: str = option(
        "cache_aware",
        "with --data-parallel-size > 1: how requests are spread over the replicas: "
        "round_robin, least_loaded (fewest running + waiting requests) or cache_aware (the best score of "
        "expected prefix-cache hit against load)",
        choices=ROUTER_POLICIES,
    )
    router_kv_events: bool = option(
        False,
        "with --data-parallel-size > 1 and --router-policy cache_aware: the replicas publish their KV cache "
        "events (on 127.0.0.1 ports of their own, unless --kv-events-config says where: its ports are "
        "then offset by the replica's index) and the router follows them, routing on what each "
        "replica's prefix cache really holds",
    )
    # A replica that keeps crashing stays out of rotation rather than restarting forever.
    replica_max_restarts: int = option(
        3,
        "with --data-parallel-size > 1: a replica that exits while serving is restarted (same port, "
        "CPUs and flags), at most this many times within --replica-restart-window-s; past that it stays "
        "out of rotation (0: never restarted)",
    )
    replica_restart_window_s: float = option(300.0, "the window of --replica-max-restarts, in seconds")
    data_parallel_backend: str = option(
        "mp",
        "with --data-parallel-size > 1: mp (replica processes on this machine) or ray (each replica a "
        "Ray actor running its server on a node of the cluster named by RAY_ADDRESS, or of a local Ray "
        "started for it)",
        choices=DATA_PARALLEL_BACKENDS,
    )

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and (
            not self.served_model_name or not all(isinstance(n, str) and n for n in self.served_model_name)
        ):
            raise ValueError(f"served_model_name must be one or more non-empty names, got {self.served_model_name!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        positive("data_parallel_size", self.data_parallel_size)
        check_choices(self)
        check_otlp_endpoint(self.otlp_traces_endpoint)
        if self.replica_max_restarts < 0 or not 0 < self.replica_restart_window_s < float("inf"):
            raise ValueError(
                f"replica_max_restarts must be >= 0 and replica_restart_window_s a finite number > 0, "
                f"got {self.replica_max_restarts} and {self.replica_restart_window_s}"
            )
        if self.router_kv_events and self.data_parallel_size == 1:
            raise ValueError(
                "router_kv_events is for data_parallel_size > 1 (the router in front of the replicas); "
                "a single server publishes its KV events with kv_events_config"
            )
        if self.router_kv_events and self.router_policy != "cache_aware":
            raise ValueError(f"router_kv_events is for router_policy cache_aware, not {self.router_policy}")
        positive("max_waiting_requests", self.max_waiting_requests)
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        positive("max_request_body_bytes", self.max_request_body_bytes)
        if self.log_interval_s <= 0 or self.shutdown_grace_s < 0:
            raise ValueError("log_interval_s must be > 0 and shutdown_grace_s >= 0")
