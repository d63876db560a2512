"""`--kv-events-config`: vLLM's `KVEventsConfig` field names, validated at start-up.

One difference from vLLM: the default `endpoint` binds the loopback interface
(`tcp://127.0.0.1:5557`), not every interface (vLLM's `tcp://*:5557`): the events carry the token
ids of every cached prompt block, so publishing them to the network is an explicit choice, as
`--host 0.0.0.0` is for the HTTP API. kvflow's publisher always binds its sockets (subscribers
connect); vLLM's connect mode for non-wildcard endpoints is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from kvflow.config.options import json_object_fields

# The publishers kvflow/kv_events/publisher.py implements (it registers each under one of these names).
KV_EVENT_PUBLISHERS = ("null", "zmq")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # None: zmq when events are enabled, else null (vLLM's rule).
    publisher: str | None = None
    endpoint: str = "tcp://127.0.0.1:5557"  # PUB socket, bound; subscribers connect to it
    replay_endpoint: str | None = None  # ROUTER socket, bound: missed batches by sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket (messages queued per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond, dropped (a gap)
    topic: str = ""  # first frame of every message; subscribers filter on it

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"kv_events_config: enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(
                f"kv_events_config: publisher must be one of {', '.join(KV_EVENT_PUBLISHERS)}, got {self.publisher!r}"
            )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(_SCHEMES):
                raise ValueError(
                    f"kv_events_config: {name} must be a ZMQ address ({', '.join(s + '...' for s in _SCHEMES)}), "
                    f"e.g. tcp://127.0.0.1:5557, got {value!r}"
                )
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError("kv_events_config: endpoint and replay_endpoint must differ")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config: topic must be a string, got {self.topic!r}")

    @property
    def enabled(self) -> bool:
        """Whether the engine collects and publishes events (off costs nothing per step)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def for_replica(self, index: int) -> KVEventsConfig:
        """Replica `index` of `kvflow serve --data-parallel-size N`: both endpoints' TCP ports
        offset by the index (vLLM offsets them by the data-parallel rank); an ipc/inproc path
        gets a `_dpK` suffix."""
        return replace(
            self,
            endpoint=offset_endpoint(self.endpoint, index),
            replay_endpoint=offset_endpoint(self.replay_endpoint, index),
        )

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str) -> KVEventsConfig:
        if isinstance(value, KVEventsConfig):
            return value
        value = json_object_fields(cls, value, "kv_events_config")
        return cls(**value)


def endpoint_port(endpoint: str) -> int | None:
    """The TCP port of a `tcp://host:port` address (None for ipc/inproc, or no port)."""
    if not endpoint.startswith("tcp://"):
        return None
    _, _, port = endpoint.rpartition(":")
    try:
        return int(port)
    except ValueError:
        return None


def offset_endpoint(endpoint: str | None, index: int) -> str | None:
    if endpoint is None or index == 0:
        return endpoint
    port = endpoint_port(endpoint)
    if port is not None:
        return f"{endpoint.rpartition(':')[0]}:{port + index}"
    if endpoint.startswith("tcp://"):
        raise ValueError(f"kv_events_config: {endpoint!r} has no port to offset per replica")
    return f"{endpoint}_dp{index}"
