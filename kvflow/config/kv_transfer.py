"""`--kv-transfer-config`: vLLM's field names, validated at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.config.options import json_object_fields

CONNECTORS = ("tcp", "shm")  # shm: same host; control over TCP, blocks through a /dev/shm file
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    # Producer: address it listens on and advertises in kv_transfer_params (another host's decode
    # engine needs a routable one, e.g. the machine's LAN address); port 0 = any free port.
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    # Producer: how long a finished prompt's blocks stay held for a consumer that never comes.
    kv_lease_s: float = 30.0
    # Consumer: a fetch slower than this counts as failed.
    kv_transfer_timeout_s: float = 10.0
    # Consumer: what a failed fetch (timeout, corrupt payload, producer gone) does to the request.
    kv_load_failure_policy: str = "recompute"
    engine_id: str | None = None  # names this engine in kv_transfer_params; default: random
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(
                f"kv_transfer_config: kv_connector must be one of {', '.join(CONNECTORS)}, got {self.kv_connector!r}"
            )
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_config: kv_load_failure_policy must be one of "
                f"{', '.join(FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}"
            )
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_transfer_config: kv_port must be an integer in [0, 65535], got {self.kv_port!r}")
        for name in ("kv_lease_s", "kv_transfer_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"kv_transfer_config: {name} must be a number > 0, got {value!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: KVTransferConfig | dict | str) -> KVTransferConfig:
        if isinstance(value, KVTransferConfig):
            return value
        value = json_object_fields(cls, value, "kv_transfer_config")
        for key in ("kv_connector", "kv_role"):
            if key not in value:
                raise ValueError(
                    f'kv_transfer_config needs {key!r} (e.g. {{"kv_connector": "tcp", "kv_role": "kv_producer"}})'
                )
        return cls(**value)
