"""Routing policies: which backend serves a request (and, for pd, which engine prefills it).

A policy sees the request (path and parsed body) and the backends with their live state (in-flight
count, the load last scraped from their /metrics, health), and answers a `Route`; the app does the
HTTP, the health checks and the scraping. Data-parallel policies (`--backend`) share
`ReplicaPolicy`, which keeps unhealthy replicas out and answers where to retry:
- `round_robin`: each healthy replica in turn;
- `least_loaded`: the replica with the least `Backend.load`;
- `cache_aware`: the best score of expected prefix hit (tokens the replica would not compute: from
  its prefix tree of the prompts sent there, `prefix_tree.py`, or from its KV events,
  `kv_view.py`) against load (requests, KV usage); see `CacheAwarePolicy`.
Register a policy in `POLICIES` and `kvflow router --policy NAME --backend URL...` serves it.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from kvflow.core.block_hash import prompt_block_hashes
from kvflow.router.kv_view import ReplicaKVView
from kvflow.router.pd import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    EMBEDDINGS_PATH,
    MESSAGES_PATH,
    RESPONSES_PATH,
    SCORE_PATHS,
    takes_prefill_step,
)
from kvflow.router.prefix_tree import PrefixTree, prompt_texts_scaled
from kvflow.utils.validation import is_int

Role = Literal["prefill", "decode", "backend"]
# pd: how a request that could take the prefill step was served (kvflow_router:pd_decisions_total).
PDDecision = Literal["local_prefill", "remote_prefill"]

logger = logging.getLogger("kvflow.router")

# cache_aware without KV events: a text match saves less than a block (kvflow's default block size,
# in tokens) is no hit; the engine reuses whole blocks only.
TEXT_MIN_HIT_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class PolicyOptions:
    """What a policy is built from, as plain values: the servers it routes over and the cache_aware
    knobs (`RouterConfig.policy_options()` gives them, checked, with their defaults)."""

    backends: Sequence[str] = ()  # replicas, for data-parallel policies
    prefill: Sequence[str] = ()  # kv_producer engines (pd)
    decode: Sequence[str] = ()  # kv_consumer engines (pd)
    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float
    cache_max_chars: int
    load_cost_tokens: float = 128.0
    kv_usage_weight: float = 4.0
    kv_events: bool = False  # cache_aware follows the replicas' KV events (--router-kv-events)
    # pd: a prompt the decode engine would compute at most this many tokens of is prefilled there
    # (0: every prompt goes through a prefill engine)
    max_local_prefill_length: int = 0


@dataclass(eq=False)
class Backend:
    """One upstream kvflow server. The app keeps its state: `inflight` (requests sent and not yet
    answered, streams included), `healthy` (its /health, probed in the background), and what the
    last scrape of its /metrics said (`record_scrape`)."""

    url: str
    role: Role
    inflight: int = 0
    # The work of those requests, in tokens, as the policy sized them (`Route.work`): cache_aware
    # weighs a replica's queue by it rather than by its length.
    inflight_work: float = 0.0
    healthy: bool = True
    engine_load: int | None = None  # kvflow:num_requests_running + _waiting at the last scrape; None: none
    kv_usage: float = 0.0  # kvflow:kv_cache_usage_perc at the last scrape (0..1)
    inflight_at_scrape: int = 0  # `inflight` when that scrape arrived

    def record_scrape(self, running: float, waiting: float, kv_usage: float) -> None:
        self.engine_load = int(running + waiting)
        self.kv_usage = float(kv_usage)
        self.inflight_at_scrape = self.inflight

    def begin(self, work: float = 0.0) -> None:
        """A request was sent here, `work` tokens of it (`Route.work`)."""
        self.inflight += 1
        self.inflight_work += work

    def end(self, work: float = 0.0) -> None:
        """A request sent here was answered, failed or abandoned: the same `work` as its `begin`."""
        self.inflight -= 1
        # (exactly zero when nothing is in flight: no float residue from the sums)
        self.inflight_work = self.inflight_work - work if self.inflight > 0 else 0.0

    def forget_scrape(self) -> None:
        """No (fresh) metrics: the load is the router's in-flight count alone."""
        self.engine_load = None
        self.kv_usage = 0.0

    @property
    def load(self) -> int:
        """Requests on this replica: those its engine reported at the last scrape (running +
        waiting sequences, whoever sent them), plus what the router sent since minus what it saw
        finish since (its in-flight count now minus then), and never less than the router's own
        in-flight count (a request just sent is not in the engine's numbers yet). So a burst
        between two scrapes spreads instead of all landing on the replica that looked idlest.
        Without a scrape (no /metrics, or it failed): the router's in-flight count."""
        if self.engine_load is None:
            return self.inflight
        return max(self.inflight, self.engine_load + self.inflight - self.inflight_at_scrape)

    @property
    def other_load(self) -> int:
        """Requests its engine runs or queues beyond the router's in flight there (sent by another
        client, or sequences of one request's n choices): `load` - `inflight`."""
        return self.load - self.inflight


@dataclass(frozen=True)
class RouteRequest:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # the client's JSON body, as sent
    # The token ids of each prompt the engine will compute, when the router got them (a policy's
    # `wants_token_ids`): cache_aware then looks the prompt's block hashes up in the KV events.
    prompt_token_ids: list[list[int]] | None = None


@dataclass(frozen=True)
class Route:
    target: Backend  # answers the client (a decode engine, or a replica)
    prefill: Backend | None = None  # computes the prompt first (pd); None: target does it all
    # cache_aware only (None otherwise): whether the target was expected to hold part of the
    # prompt (a hit) or not, and the best match over the candidates, as a share of the prompt
    # (its tokens with KV events, else its characters).
    cache_hit: bool | None = None
    match_ratio: float | None = None
    # pd only (None otherwise, and for requests that cannot take the prefill step): whether the
    # decode engine prefills the prompt itself or a prefill engine does; with the tokens the decode
    # engine was expected to compute (the estimate the choice was made on; None without a threshold).
    pd_decision: PDDecision | None = None
    local_prefill_tokens: float | None = None
    # cache_aware only (0 otherwise): the tokens the target takes on, its prompt tokens less the
    # expected hit plus the output asked for; the app holds them in `Backend.inflight_work` until
    # the answer ends.
    work: float = 0.0


class RoundRobin:
    """Each of `items` in turn. The router runs on one event loop, so no lock is needed."""

    def __init__(self, items: Sequence[Backend]) -> None:
        if not items:
            raise ValueError("round robin over no backends")
        self.items = list(items)
        self._next = 0

    def next(self) -> Backend:
        item = self.items[self._next]
        self._next = (self._next + 1) % len(self.items)
        return item


class RoutingPolicy(ABC):
    name: ClassVar[str]
    # Whether the app scrapes each backend's /metrics for `Backend.load` (every --load-poll-s).
    uses_load: ClassVar[bool] = False
    # Whether the app probes each backend's /health (every --health-interval-s) and calls
    # `set_healthy` when its state changes; `reroute` is then asked where to retry.
    health_checked: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_options(cls, options: PolicyOptions) -> RoutingPolicy: ...

    @abstractmethod
    def route(self, request: RouteRequest) -> Route: ...

    @abstractmethod
    def backends(self) -> list[Backend]:
        """Every backend (for /health), in the order given."""

    @abstractmethod
    def primary(self) -> Backend:
        """The backend that answers what is the same everywhere (GET /v1/models)."""

    def reroute(self, request: RouteRequest, failed: Backend) -> Route | None:
        """Where to send a request again whose target failed before answering (unreachable, or
        a 5xx); None: nowhere, the client gets that failure. No retry unless a policy says so."""
        return None

    def set_healthy(self, backend: Backend, healthy: bool) -> None:
        """The app's health checker changed `backend`'s state."""
        backend.healthy = healthy

    def wants_token_ids(self, request: RouteRequest) -> bool:
        """Whether `route` would use the prompts' token ids (the app then asks a replica's
        /tokenize first and passes them in `RouteRequest.prompt_token_ids`)."""
        return False

    def kv_view(self, backend: Backend) -> ReplicaKVView | None:
        """The view of `backend`'s cache its KV events feed (None: the policy follows none)."""
        return None


class ReplicaPolicy(RoutingPolicy):
    """Data parallelism: equal replicas (--backend), a request goes whole to one of them. Only
    healthy replicas are candidates; when none is healthy, all are (the client then gets a real
    attempt's error, quickly, rather than a refusal made up by the router). A request whose
    replica failed before answering is retried once on another healthy replica."""

    health_checked = True

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"--policy {self.name} needs at least one --backend URL")
        self._backends = [Backend(url, "backend") for url in urls]
        self._tick = 0  # rotates ties, so equal candidates take turns

    @classmethod
    def from_options(cls, options: PolicyOptions) -> ReplicaPolicy:
        return cls(options.backends)

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: list[Backend]) -> Route:
        """The route among `candidates` (non-empty, in the order the backends were given)."""

    def route(self, request: RouteRequest) -> Route:
        return self.choose(request, self.candidates())

    def reroute(self, request: RouteRequest, failed: Backend) -> Route | None:
        candidates = self.candidates(exclude=failed, healthy_only=True)
        return self.choose(request, candidates) if candidates else None

    def candidates(self, exclude: Backend | None = None, healthy_only: bool = False) -> list[Backend]:
        healthy = [b for b in self._backends if b.healthy and b is not exclude]
        if healthy or healthy_only:
            return healthy
        return [b for b in self._backends if b is not exclude]

    def backends(self) -> list[Backend]:
        return list(self._backends)

    def primary(self) -> Backend:
        return next((b for b in self._backends if b.healthy), self._backends[0])

    def least_loaded(self, candidates: list[Backend], key: Callable[[Backend], Any] | None = None) -> Backend:
        """The candidate with the smallest `key` (default: `Backend.load`); ties take turns (the
        turn moves on only when there is a tie, so decisions without one do not skew it)."""
        key = key or _load
        keys = [key(b) for b in candidates]
        best = min(keys)
        tied = [b for b, k in zip(candidates, keys) if k == best]
        if len(tied) == 1:
            return tied[0]
        choice = tied[self._tick % len(tied)]
        self._tick += 1
        return choice


def _load(b: Backend) -> int:
    return b.load


class RoundRobinPolicy(ReplicaPolicy):
    """Equal replicas, each request to the next healthy one: the plain proxy."""

    name = "round_robin"

    def __init__(self, urls: Sequence[str]) -> None:
        super().__init__(urls)
        self._next = 0

    def choose(self, request: RouteRequest, candidates: list[Backend]) -> Route:
        n = len(self._backends)
        for step in range(n):  # the next backend in the given order that is a candidate
            i = (self._next + step) % n
            if self._backends[i] in candidates:
                self._next = (i + 1) % n
                return Route(self._backends[i])
        raise AssertionError("no candidate among the backends")


class LeastLoadedPolicy(ReplicaPolicy):
    """Each request to the replica with the least `Backend.load`: its engine's running + waiting
    requests at the last /metrics scrape (every --load-poll-s), corrected by the router's own
    in-flight changes since (see `Backend.load`). Equal loads: the lower KV cache usage
    (kvflow:kv_cache_usage_perc); still equal: round robin."""

    name = "least_loaded"
    uses_load = True

    def choose(self, request: RouteRequest, candidates: list[Backend]) -> Route:
        return Route(self.least_loaded(candidates, key=lambda b: (b.load, b.kv_usage)))


# cache_aware's estimate of a request's output tokens: what it asks for (max_tokens and the like),
# at most OUTPUT_TOKENS_CAP (a limit set far above what a reply uses is a limit, not a length), and
# DEFAULT_OUTPUT_TOKENS where it asks for none (the engine then stops at the context's end or EOS).
DEFAULT_OUTPUT_TOKENS = 256
OUTPUT_TOKENS_CAP = 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions, and the server's
_MAX_TOKENS_FIELDS = {
    CHAT_PATH: ("max_completion_tokens", "max_tokens"),  # the first wins, as the server reads them
    COMPLETIONS_PATH: ("max_tokens",),
    MESSAGES_PATH: ("max_tokens",),
    RESPONSES_PATH: ("max_output_tokens",),
}


def expected_output_tokens(path: str, body: dict[str, Any], prompts: int = 1) -> float:
    """The output tokens a request will make, as cache_aware counts them: per prompt and choice
    (`n`), its max_tokens (or max_completion_tokens, max_output_tokens) at most
    `OUTPUT_TOKENS_CAP`, else `DEFAULT_OUTPUT_TOKENS`; none for embeddings, scores and reranks.
    Completions without max_tokens get OpenAI's default, 16."""
    if path == EMBEDDINGS_PATH or path in SCORE_PATHS:
        return 0.0
    per = (
        COMPLETIONS_DEFAULT_MAX_TOKENS
        if path == COMPLETIONS_PATH and "max_tokens" not in body
        else DEFAULT_OUTPUT_TOKENS
    )
    for name in _MAX_TOKENS_FIELDS.get(path, ()):
        value = body.get(name)
        if is_int(value) and value >= 0:
            per = min(int(value), OUTPUT_TOKENS_CAP)
            break
    n = body.get("n")
    choices = int(n) if is_int(n) and n >= 1 else 1
    return float(per * choices * max(1, prompts))


class CacheAwarePolicy(ReplicaPolicy):
    """Prefix affinity weighed against load: a short shared prefix never outweighs an idle replica.

    For each candidate replica r the policy estimates `saved(r)`, the prompt tokens r would not
    compute (its expected prefix-cache hit), and `queued(r)`, the work queued there, both in tokens,
    and scores

        score(r) = saved(r) - queued(r)

    Without KV events the queue is counted: queued(r) = load_cost_tokens x (load(r) + kv_usage_weight
    x kv_usage(r)), where load(r) is `Backend.load` (running + waiting requests, the router's
    in-flight corrections included) and kv_usage(r) the share of r's KV pool in use at the last
    scrape (0..1). So one more request queued on a replica costs `load_cost_tokens` (128) tokens of
    prefix hit, and a full KV pool `kv_usage_weight` (4) requests more.

    With KV events (and the prompts' token ids) the queue is sized: queued(r) = the prompt blocks
    routed to r and not reported computed yet (its pending blocks, less those this request shares:
    their computation is its hit, not its wait) x block size + the rest of the work of the requests
    the router sent r and has not seen answered (`Backend.inflight_work`: the output tokens each
    asked for, `expected_output_tokens`, and its prompt's tokens after its last full block) +
    load_cost_tokens x (other(r) + kv_usage_weight x kv_usage(r)), other(r) being the requests r's
    engine runs beyond those (`Backend.other_load`, which the router cannot size). So a replica busy
    with requests that hit its cache (a few tokens each, and their outputs) keeps the prefix it
    holds, where a queue of uncached prompts or long outputs sends the request on, to compute the
    prefix again elsewhere (new prefill blocks weighed against active work, as Dynamo's KV router
    weighs them); a burst sharing a new prefix follows the first one, whose prefill it shares; and
    a short shared prefix never outweighs a replica with one request less whose own uncached prompt
    and output are longer than the prefix.

    The request goes to the best score (ties: the lower load, then turns), unless the loads are
    imbalanced (max - min > `balance_abs` AND max > `balance_rel` x min requests, sglang-router's
    guard): then to the least loaded, whatever it holds.

    saved(r), per prompt of the request:
    - with KV events (`kv_events`, and the token ids of the prompt, `RouteRequest.prompt_token_ids`):
      the prompt's full blocks hashed as the engine hashes them, the longest run held in r's pool
      (or routed there and not reported yet), then in its offload tiers, in tokens, as the engine's
      own lookup counts them (at least one token is left to compute);
      When no candidate holds any of it, the text estimate below decides instead, so a prefix
      nobody holds (evicted everywhere, or still queued where it was sent before the first events
      arrived) stays with the replica that computed it before rather than spreading to a second;
    - else from r's `PrefixTree` of the prompt text the router sent it (bounded to `max_chars`,
      least recently used leaves evicted): the characters matched, / 4 for text (about four
      characters per token), / 1 for token-id prompts (one character per id); less than a block
      (16 tokens) counts as none, since the engine reuses whole blocks only.
    A match below `threshold` of the prompt counts as none (0 by default: the score already
    weighs what a match saves). The prompt goes into the chosen replica's tree (and, with events,
    its blocks are pending there). A replica taken out of rotation (unhealthy) forgets its tree
    and its events' view: it may come back restarted, its cache empty."""

    name = "cache_aware"
    uses_load = True

    def __init__(
        self,
        urls: Sequence[str],
        *,
        threshold: float = 0.0,
        balance_abs: float = 32,
        balance_rel: float = 1.5,
        max_chars: int = 1_000_000,
        load_cost_tokens: float = 128.0,
        kv_usage_weight: float = 4.0,
        kv_events: bool = False,
    ) -> None:
        super().__init__(urls)
        self.threshold = threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.load_cost_tokens = load_cost_tokens
        self.kv_usage_weight = kv_usage_weight
        self.trees: dict[Backend, PrefixTree] = {b: PrefixTree(max_chars) for b in self._backends}
        self.views: dict[Backend, ReplicaKVView] | None = (
            {b: ReplicaKVView() for b in self._backends} if kv_events else None
        )
        # The last decision's saved tokens and score per candidate URL (the debug log prints them).
        self.last_scores: dict[str, tuple[float, float]] = {}

    @classmethod
    def from_options(cls, options: PolicyOptions) -> CacheAwarePolicy:
        return cls(
            options.backends,
            threshold=options.cache_threshold,
            balance_abs=options.balance_abs_threshold,
            balance_rel=options.balance_rel_threshold,
            max_chars=options.cache_max_chars,
            load_cost_tokens=options.load_cost_tokens,
            kv_usage_weight=options.kv_usage_weight,
            kv_events=options.kv_events,
        )

    def imbalanced(self, candidates: list[Backend]) -> bool:
        loads = [b.load for b in candidates]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def kv_view(self, backend: Backend) -> ReplicaKVView | None:
        return None if self.views is None else self.views.get(backend)

    def block_size(self) -> int | None:
        """The replicas' block size, once their events told it (and their hashes are the router's)."""
        if self.views is None or any(v.compatible is False for v in self.views.values()):
            return None
        return next((v.block_size for v in self.views.values() if v.block_size is not None), None)

    def wants_token_ids(self, request: RouteRequest) -> bool:
        return self.block_size() is not None

    def effective_load(self, b: Backend) -> float:
        """Requests, plus `kv_usage_weight` per full KV pool."""
        return b.load + self.kv_usage_weight * b.kv_usage

    def expected_hits(
        self, request: RouteRequest, candidates: list[Backend], texts: list[tuple[str, float]]
    ) -> tuple[dict[Backend, float], float, list[list[bytes]] | None]:
        """saved(r) in tokens per candidate (see the class), the prompt's size in tokens (estimated
        from its characters without events), and, with events, the prompts' block hashes.
        `texts`: the request's `prompt_texts_scaled`."""
        saved = dict.fromkeys(candidates, 0.0)
        bs = self.block_size()
        if bs is not None and request.prompt_token_ids is not None:
            now = time.monotonic()
            hashes = [prompt_block_hashes(ids, bs) for ids in request.prompt_token_ids]
            for ids, h in zip(request.prompt_token_ids, hashes):
                lookup = h[: (len(ids) - 1) // bs]  # the engine leaves one token to compute
                for b in candidates:
                    saved[b] += self.views[b].matched_blocks(lookup, now) * bs
            if not any(saved.values()):
                # No replica holds any of it (never computed, evicted everywhere, or routed before
                # the replicas' first events and still queued): keep the prefix where the router
                # sent it before, as without events, rather than compute it on a second replica.
                saved = self.text_hits(candidates, texts, bs)
            return saved, float(sum(map(len, request.prompt_token_ids))), hashes
        return self.text_hits(candidates, texts, bs), sum(len(t) / cpt for t, cpt in texts), None

    def text_hits(
        self, candidates: list[Backend], texts: list[tuple[str, float]], block_size: int | None
    ) -> dict[Backend, float]:
        """saved(r) in tokens estimated from r's `PrefixTree` of the prompt text sent there."""
        saved = {}
        for b in candidates:
            tree = self.trees[b]
            saved[b] = sum(tree.match(t) / chars_per_token for t, chars_per_token in texts)
            if saved[b] < (block_size or TEXT_MIN_HIT_TOKENS):
                saved[b] = 0.0  # less than a block: the engine reuses whole blocks only
        return saved

    def queued(self, b: Backend, blocks: set[bytes] | None) -> float:
        """queued(r) of the score, in tokens (see the class). `blocks`: the request's own block
        hashes, with events (their pending computation is the request's hit, not its wait)."""
        kv = self.kv_usage_weight * b.kv_usage
        if blocks is None:
            return self.load_cost_tokens * (b.load + kv)
        pending = self.views[b].pending_blocks(exclude=blocks) * (self.block_size() or 0)
        return pending + b.inflight_work + self.load_cost_tokens * (b.other_load + kv)

    def choose(self, request: RouteRequest, candidates: list[Backend]) -> Route:
        texts = prompt_texts_scaled(request.path, request.body)
        saved, total, hashes = self.expected_hits(request, candidates, texts)
        ratio = max(saved.values()) / total if total else None
        if self.threshold > 0 and total:
            saved = {b: (s if s >= self.threshold * total else 0.0) for b, s in saved.items()}
        # With events the queue is sized (pending blocks and the work in flight), else counted.
        blocks = None if self.block_size() is None else {x for h in hashes or () for x in h}
        score = {b: saved[b] - self.queued(b, blocks) for b in candidates}
        if self.imbalanced(candidates):
            target = self.least_loaded(candidates)
        else:
            target = self.least_loaded(candidates, key=lambda b: (-score[b], self.effective_load(b)))
        self.last_scores = {b.url: (saved[b], score[b]) for b in candidates}
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "cache_aware: %s -> %s (saved tokens, score: %s)",
                request.path,
                target.url,
                "; ".join(f"{u} {v[0]:.0f}, {v[1]:.0f}" for u, v in self.last_scores.items()),
            )
        tree = self.trees[target]
        for t, _ in texts:
            tree.insert(t)
        work = expected_output_tokens(request.path, request.body, len(texts))
        if hashes is not None:
            for h in hashes:
                self.views[target].note_routed(h)
            # its full blocks are pending there now: the work beyond them is each prompt's tail
            work += total - self.block_size() * sum(map(len, hashes))
        else:
            work += max(0.0, total - saved[target])
        return Route(target, cache_hit=saved[target] > 0, match_ratio=ratio, work=work)

    def set_healthy(self, backend: Backend, healthy: bool) -> None:
        super().set_healthy(backend, healthy)
        if not healthy and backend in self.trees:
            self.trees[backend].clear()
            if self.views is not None:
                self.views[backend].reset()


class PrefillDecodePolicy(RoutingPolicy):
    """Prefill/decode disaggregation: a prefill engine computes the prompt, a decode engine fetches
    its KV and generates; each chosen round robin among its own kind.

    Conditional disaggregation (`max_local_prefill_length` > 0, Dynamo's `max_local_prefill_length`):
    a prompt that costs the decode engine little is not worth a prefill hop, a transfer, and a place
    in the prefill engine's queue behind long documents. The decode engine is chosen first (round
    robin); the tokens it would compute itself are estimated as the prompt's tokens minus its
    expected prefix-cache hit, the way `CacheAwarePolicy` estimates them without KV events: from
    the characters of the prompt text (about `CHARS_PER_TOKEN` per token; token-id prompts exactly)
    and from a `PrefixTree` per decode engine of the prompts sent there (a prefilled prompt's KV is
    fetched into the decode engine's prefix cache too, so every prompt routed there is inserted),
    a match under one block counting as none. At most `max_local_prefill_length`: the request goes
    to the decode engine alone, which serves it as a plain aggregated request (no
    kv_transfer_params); above it, through a prefill engine as always. 0 (the default): always
    through a prefill engine, and no tree is kept."""

    name = "pd"

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        *,
        max_local_prefill_length: int = 0,
        max_chars: int = 1_000_000,
    ) -> None:
        self._prefill = [Backend(url, "prefill") for url in prefill_urls]
        self._decode = [Backend(url, "decode") for url in decode_urls]
        self._prefill_rr = RoundRobin(self._prefill)
        self._decode_rr = RoundRobin(self._decode)
        self.max_local_prefill_length = max_local_prefill_length
        self.trees: dict[Backend, PrefixTree] | None = (
            {b: PrefixTree(max_chars) for b in self._decode} if max_local_prefill_length > 0 else None
        )

    @classmethod
    def from_options(cls, options: PolicyOptions) -> PrefillDecodePolicy:
        return cls(
            options.prefill,
            options.decode,
            max_local_prefill_length=options.max_local_prefill_length,
            max_chars=options.cache_max_chars,
        )

    def local_prefill_tokens(self, decode: Backend, texts: list[tuple[str, float]]) -> float:
        """The prompt tokens `decode` would compute for a request with these `prompt_texts_scaled`:
        the estimated prompt length minus the expected prefix hit (a hit under one block counts as
        none), at least one token per prompt (the engine always computes the last)."""
        tree = self.trees[decode]
        out = 0.0
        for text, chars_per_token in texts:
            total = len(text) / chars_per_token
            hit = tree.match(text) / chars_per_token
            if hit < TEXT_MIN_HIT_TOKENS:
                hit = 0.0
            out += max(total - hit, 1.0)
        return out

    def route(self, request: RouteRequest) -> Route:
        decode = self._decode_rr.next()
        if not takes_prefill_step(request.path, request.body):
            return Route(decode)  # e.g. n > 1: see takes_prefill_step
        if self.trees is None:
            return Route(decode, prefill=self._prefill_rr.next(), pd_decision="remote_prefill")
        texts = prompt_texts_scaled(request.path, request.body)
        tokens = self.local_prefill_tokens(decode, texts)
        for text, _ in texts:  # served either way, its KV ends in the decode engine's prefix cache
            self.trees[decode].insert(text)
        if texts and tokens <= self.max_local_prefill_length:
            return Route(decode, pd_decision="local_prefill", local_prefill_tokens=tokens)
        return Route(decode, prefill=self._prefill_rr.next(), pd_decision="remote_prefill", local_prefill_tokens=tokens)

    def backends(self) -> list[Backend]:
        return [*self._prefill, *self._decode]

    def primary(self) -> Backend:
        return self._decode[0]


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobinPolicy, LeastLoadedPolicy, CacheAwarePolicy, PrefillDecodePolicy)
}


def make_policy(name: str, options: PolicyOptions) -> RoutingPolicy:
    """The policy registered as `name` (one of `POLICIES`), built from `options`."""
    return POLICIES[name].from_options(options)


# The policies that spread whole requests over equal replicas (`kvflow router --backend`,
# `kvflow serve --data-parallel-size N --router-policy NAME`), in the order help texts list them.
DATA_PARALLEL_POLICIES: tuple[str, ...] = tuple(name for name, p in POLICIES.items() if issubclass(p, ReplicaPolicy))
