"""`kvflow router`: an HTTP proxy in front of kvflow servers, choosing a backend per request by a
policy (`policies.py`): `pd` (prefill/decode disaggregation), or over data-parallel replicas
`round_robin`, `least_loaded` or `cache_aware` (prefix affinity, `prefix_tree.py`).

The modules, each importing only those before it:
- `pd` (the prefill/decode protocol), `prefix_tree`, `kv_view` (a replica's cache from its KV
  events, `--router-kv-events`), `metrics` (the router's own counters);
- `policies` (the registry; built from plain `PolicyOptions`), `config` (`RouterConfig`, the flags
  checked), `app` (the HTTP proxy);
- the replicas of `kvflow serve --data-parallel-size N`: `replica` (the `Replica` protocol and its
  spec), `local_replica` (a process here), `ray_replica` (a process a Ray actor runs), `replica_set`
  (start, watch, restart, stop), `data_parallel` (the entry point: replicas plus the router).

Names are imported lazily: `kvflow --help` reads `config` and `policies` without the web stack."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Router": "app",
    "build_router_app": "app",
    "serve_router": "app",
    "RouterConfig": "config",
    "RouterMetrics": "metrics",
    "POLICIES": "policies",
    "Backend": "policies",
    "Route": "policies",
    "RouteRequest": "policies",
    "RoutingPolicy": "policies",
    "RoundRobinPolicy": "policies",
    "PrefillDecodePolicy": "policies",
    "ReplicaPolicy": "policies",
    "LeastLoadedPolicy": "policies",
    "CacheAwarePolicy": "policies",
    "make_policy": "policies",
    "DATA_PARALLEL_POLICIES": "policies",
    "PolicyOptions": "policies",
    "PrefixTree": "prefix_tree",
    "ReplicaKVView": "kv_view",
    "prompt_texts": "prefix_tree",
    "Replica": "replica",
    "ReplicaSpec": "replica",
    "ReplicaStartError": "replica",
    "LocalReplica": "local_replica",
    "ReplicaSet": "replica_set",
    "serve_data_parallel": "data_parallel",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kvflow.router.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kvflow.router' has no attribute {name!r}")
