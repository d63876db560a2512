"""Routing policies: which backend serves a request (and, for pd, which engine prefills it).

A policy sees the request (path and parsed body) and the backends with their live in-flight counts,
and answers a `Route`; the app does the HTTP. So a data-parallel policy is one small class:
`least_loaded` reads `Backend.inflight`, `cache_aware` hashes the prompt from `RouteRequest.body`.
Register it in `POLICIES` and `kvflow router --policy NAME --backend URL...` serves it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from kvflow.router.pd import takes_prefill_step

if TYPE_CHECKING:
    from kvflow.router.config import RouterConfig

Role = Literal["prefill", "decode", "backend"]


@dataclass(eq=False)
class Backend:
    """One upstream kvflow server. `inflight` is kept by the app (requests sent and not yet
    answered, streams included) for load-aware policies."""

    url: str
    role: Role
    inflight: int = 0


@dataclass(frozen=True)
class RouteRequest:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # the client's JSON body, as sent


@dataclass(frozen=True)
class Route:
    target: Backend  # answers the client (a decode engine, or a replica)
    prefill: Backend | None = None  # computes the prompt first (pd); None: target does it all


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

    @classmethod
    @abstractmethod
    def from_config(cls, config: RouterConfig) -> RoutingPolicy: ...

    @abstractmethod
    def route(self, request: RouteRequest) -> Route: ...

    @abstractmethod
    def backends(self) -> list[Backend]:
        """Every backend (for /health), in the order given."""

    @abstractmethod
    def primary(self) -> Backend:
        """The backend that answers what is the same everywhere (GET /v1/models)."""


class RoundRobinPolicy(RoutingPolicy):
    """Equal replicas, each request to the next one: the plain proxy."""

    name = "round_robin"

    def __init__(self, urls: Sequence[str]) -> None:
        self._backends = [Backend(url, "backend") for url in urls]
        self._rr = RoundRobin(self._backends)

    @classmethod
    def from_config(cls, config: RouterConfig) -> RoundRobinPolicy:
        return cls(config.backends)

    def route(self, request: RouteRequest) -> Route:
        return Route(self._rr.next())

    def backends(self) -> list[Backend]:
        return list(self._backends)

    def primary(self) -> Backend:
        return self._backends[0]


class PrefillDecodePolicy(RoutingPolicy):
    """Prefill/decode disaggregation: a prefill engine computes the prompt, a decode engine fetches
    its KV and generates; each chosen round robin among its own kind."""

    name = "pd"

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> None:
        self._prefill = [Backend(url, "prefill") for url in prefill_urls]
        self._decode = [Backend(url, "decode") for url in decode_urls]
        self._prefill_rr = RoundRobin(self._prefill)
        self._decode_rr = RoundRobin(self._decode)

    @classmethod
    def from_config(cls, config: RouterConfig) -> PrefillDecodePolicy:
        return cls(config.prefill, config.decode)

    def route(self, request: RouteRequest) -> Route:
        decode = self._decode_rr.next()
        if not takes_prefill_step(request.path, request.body):
            return Route(decode)  # e.g. n > 1: see takes_prefill_step
        return Route(decode, prefill=self._prefill_rr.next())

    def backends(self) -> list[Backend]:
        return [*self._prefill, *self._decode]

    def primary(self) -> Backend:
        return self._decode[0]


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (RoundRobinPolicy, PrefillDecodePolicy)}


def make_policy(config: RouterConfig) -> RoutingPolicy:
    assert config.policy is not None  # RouterConfig resolved it
    return POLICIES[config.policy].from_config(config)
