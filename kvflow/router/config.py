"""`RouterConfig`: what `kvflow router` was asked to do, checked once at start-up.

Messages name the command-line flags, because that is where a wrong value comes from; the same
checks hold for a router built in Python (tests, embedding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvflow.config.options import check_otlp_endpoint, option
from kvflow.router.policies import POLICIES, PolicyOptions
from kvflow.utils.validation import is_int, is_number

# Policies that split a request between prefill and decode engines (--prefill/--decode); every
# other policy spreads whole requests over equal replicas (--backend).
PD_POLICIES = frozenset({"pd"})


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"  # 0.0.0.0 exposes the router to the network: opt in
    port: int = 8000
    policy: str | None = None  # None: pd when prefill/decode engines are given, else round_robin
    backends: list[str] = field(default_factory=list)  # replicas, for data-parallel policies
    prefill: list[str] = field(default_factory=list)  # kv_producer engines (pd)
    decode: list[str] = field(default_factory=list)  # kv_consumer engines (pd)
    # An engine may take minutes to answer a long generation; only an upstream that sends nothing
    # for this long (or takes this long to answer a prefill) is given up on.
    timeout_s: float = 600.0
    # Separate and short: a dead host must fail over in seconds, not after timeout_s.
    connect_timeout_s: float = 5.0
    health_timeout_s: float = 5.0  # per backend, for GET /health (and the background probes)
    # Data-parallel policies (--backend): replicas whose /health fails leave the rotation until
    # it passes again; probed this often.
    health_interval_s: float = 2.0
    # least_loaded / cache_aware: each replica's /metrics is scraped this often for its load.
    load_poll_s: float = 0.5
    # cache_aware: a match below this share of the prompt counts as none (see CacheAwarePolicy) ...
    cache_threshold: float = 0.0
    # ... and the loads are imbalanced (the least loaded gets the request, whatever it holds) when
    # max - min > abs AND max > rel x min (sglang-router's guard)
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    cache_max_chars: int = 1_000_000  # per replica, for its prefix tree (LRU leaves evicted beyond)
    # cache_aware's score: expected prefix hit (tokens) - the work queued there (tokens): requests
    # counted at load_cost_tokens each, or with KV events sized (see CacheAwarePolicy)
    load_cost_tokens: float = option(
        128.0,
        "cache_aware: the prefix-cache hit, in prompt tokens, that one more request on a replica costs: "
        "each replica scores the tokens it would not compute minus this many per request it runs or "
        "queues, so a shared prefix shorter than this never outweighs a replica with one request "
        "less. With --router-kv-events the router sizes the requests it sent (their prompt blocks "
        "still to compute, their tails and outputs) and counts only the others this way",
    )
    kv_usage_weight: float = option(
        4.0,
        "cache_aware: how many requests a replica's full KV pool counts as in its load "
        "(kvflow:kv_cache_usage_perc x this is added to its running + waiting requests)",
    )
    max_local_prefill_length: int = option(
        0,
        "pd (conditional disaggregation, Dynamo's max_local_prefill_length): a request whose prompt "
        "tokens the decode engine would compute (the prompt's length minus the decode engine's expected "
        "prefix-cache hit, both estimated by the router from the prompt text, about 4 characters per "
        "token) are at most this many is sent to the decode engine alone, which prefills it itself: "
        "no prefill hop, no KV transfer; longer ones go through a prefill engine. 0: every request "
        "through a prefill engine",
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "OpenTelemetry: a span per routed request (a child span per engine call, whose traceparent the "
        "engines continue) over OTLP/HTTP to this collector URL (e.g. http://127.0.0.1:4318)",
    )
    router_kv_events: list[str] = field(
        default_factory=list,
        metadata={
            "help": "cache_aware: follow each replica's KV cache events (as its kv_events_config publishes "
            "them) and route on what it really holds: one ZMQ address per --backend, in order, PUB or PUB,REPLAY (e.g. "
            "tcp://10.0.0.1:5557,tcp://10.0.0.1:5558); the router hashes prompts as the engines do, "
            "with token ids from a replica's /tokenize"
        },
    )

    def __post_init__(self) -> None:
        check_otlp_endpoint(self.otlp_traces_endpoint)
        self.backends = _urls("--backend", self.backends)
        self.prefill = _urls("--prefill", self.prefill)
        self.decode = _urls("--decode", self.decode)
        pd_given = bool(self.prefill or self.decode)
        if self.policy is None and not pd_given and not self.backends:
            raise ValueError(
                "no servers to route to: give --prefill URL... --decode URL... (prefill/decode "
                "disaggregation) or --backend URL... (replicas)"
            )
        if self.backends and pd_given:
            raise ValueError(
                "--backend cannot be combined with --prefill/--decode: --prefill/--decode route "
                "by the pd policy, --backend by a data-parallel one (--policy); give one kind"
            )
        if self.policy is None:
            self.policy = "pd" if pd_given else "round_robin"
        if self.policy not in POLICIES:  # the registry decides which names exist
            raise ValueError(f"--policy must be one of {', '.join(sorted(POLICIES))}, got {self.policy!r}")
        if self.policy in PD_POLICIES:
            if self.backends:
                raise ValueError(
                    f"--backend is for data-parallel policies, not --policy {self.policy}: "
                    "give the engines as --prefill URL... --decode URL..."
                )
            if not self.prefill and not self.decode:
                raise ValueError(f"--policy {self.policy} needs --prefill URL... and --decode URL...")
            if not self.prefill:
                raise ValueError(
                    "--prefill is required with --decode (pd): give at least one prefill "
                    "(kv_producer) engine URL, or use --backend URL... for a plain proxy"
                )
            if not self.decode:
                raise ValueError(
                    "--decode is required with --prefill (pd): give at least one decode (kv_consumer) engine URL"
                )
        else:
            if pd_given:
                flag = "--prefill" if self.prefill else "--decode"
                raise ValueError(
                    f"{flag} is only for --policy pd, not --policy {self.policy}: "
                    "drop --policy (pd is implied) or give the engines as --backend URL..."
                )
            if not self.backends:
                raise ValueError(
                    f"--backend is required for --policy {self.policy}: give at least one "
                    "kvflow server URL, e.g. --backend http://127.0.0.1:8100"
                )
        if not 0 <= self.port < 65536:  # 0: any free port (tests)
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        for name in ("timeout_s", "connect_timeout_s", "health_timeout_s", "health_interval_s", "load_poll_s"):
            value = getattr(self, name)
            periodic = name in ("health_interval_s", "load_poll_s")
            if not value > 0 or (periodic and value == float("inf")):
                raise ValueError(
                    f"--{name.replace('_', '-')} must be {'finite and ' if periodic else ''}> 0 seconds, got {value}"
                )
        if not is_number(self.cache_threshold) or not 0 <= self.cache_threshold <= 1:
            raise ValueError(
                f"--cache-threshold must be in [0, 1] (a share of the prompt's characters), got {self.cache_threshold}"
            )
        if not is_int(self.balance_abs_threshold) or self.balance_abs_threshold < 0:
            raise ValueError(
                f"--balance-abs-threshold must be an integer >= 0 (requests), got {self.balance_abs_threshold}"
            )
        if not is_number(self.balance_rel_threshold) or not 1 <= self.balance_rel_threshold < float("inf"):
            raise ValueError(
                f"--balance-rel-threshold must be >= 1 (a ratio of loads), got {self.balance_rel_threshold}"
            )
        if not is_int(self.cache_max_chars) or self.cache_max_chars < 1:
            raise ValueError(f"--cache-max-chars must be an integer >= 1, got {self.cache_max_chars}")
        for name in ("load_cost_tokens", "kv_usage_weight"):
            value = getattr(self, name)
            if not is_number(value) or not 0 <= value < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
        if not is_int(self.max_local_prefill_length) or self.max_local_prefill_length < 0:
            raise ValueError(
                "--max-local-prefill-length must be an integer >= 0 (prompt tokens the decode engine "
                f"prefills itself; 0: every request through a prefill engine), got {self.max_local_prefill_length!r}"
            )
        if self.max_local_prefill_length and not self.is_pd:
            raise ValueError(
                f"--max-local-prefill-length is for --policy pd (--prefill/--decode), not --policy {self.policy}"
            )
        self.router_kv_events = list(self.router_kv_events or [])
        if self.router_kv_events:
            if self.policy != "cache_aware":
                raise ValueError(f"--router-kv-events is for --policy cache_aware, not {self.policy}")
            if len(self.router_kv_events) != len(self.backends):
                raise ValueError(
                    f"--router-kv-events needs one address per --backend, in the same order: got "
                    f"{len(self.router_kv_events)} for {len(self.backends)} backends"
                )
            for spec in self.router_kv_events:
                parts = spec.split(",")
                if len(parts) > 2 or not all(p.strip().startswith(("tcp://", "ipc://", "inproc://")) for p in parts):
                    raise ValueError(
                        f"--router-kv-events: {spec!r} is not PUB or PUB,REPLAY (ZMQ addresses, e.g. "
                        "tcp://127.0.0.1:5557,tcp://127.0.0.1:5558)"
                    )

    @property
    def is_pd(self) -> bool:
        return self.policy in PD_POLICIES

    def policy_options(self) -> PolicyOptions:
        """What `policies.make_policy(self.policy, ...)` builds the policy from."""
        return PolicyOptions(
            backends=tuple(self.backends),
            prefill=tuple(self.prefill),
            decode=tuple(self.decode),
            cache_threshold=self.cache_threshold,
            balance_abs_threshold=self.balance_abs_threshold,
            balance_rel_threshold=self.balance_rel_threshold,
            cache_max_chars=self.cache_max_chars,
            load_cost_tokens=self.load_cost_tokens,
            kv_usage_weight=self.kv_usage_weight,
            kv_events=bool(self.router_kv_events),
            max_local_prefill_length=self.max_local_prefill_length,
        )

    def kv_event_endpoints(self) -> list[tuple[str, str | None]]:
        """Per backend (in order): its KV events' PUB address and replay address (or None)."""
        out: list[tuple[str, str | None]] = []
        for spec in self.router_kv_events:
            pub, _, replay = (p.strip() for p in spec.partition(","))
            out.append((pub, replay or None))
        return out


def _urls(flag: str, urls: list[str]) -> list[str]:
    """Base URLs of kvflow servers, normalised (no trailing slash) and each given once (a
    duplicate would skew round robin silently and merge two backends' metrics)."""
    out: list[str] = []
    for raw in urls:
        url = raw.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"{flag}: {raw!r} is not an http(s) URL; give a server's base URL, e.g. http://127.0.0.1:8100"
            )
        if parts.query or parts.fragment:
            raise ValueError(f"{flag}: {raw!r} has a query or fragment; give the server's base URL only")
        try:
            parts.port  # noqa: B018 (raises on a bad port)
        except ValueError:
            raise ValueError(f"{flag}: {raw!r} has an invalid port") from None
        if url in out:
            raise ValueError(f"{flag} lists {url} twice; give each server once")
        out.append(url)
    return out
