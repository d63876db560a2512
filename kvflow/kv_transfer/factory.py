"""Which connector an engine gets, from its configuration."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from kvflow.config import KVTransferConfig
from kvflow.kv_transfer.base import BlockIO, KVConnectorScheduler, KVConnectorWorker

if TYPE_CHECKING:
    from kvflow.config import EngineConfig


def make_kv_connector(
    config: EngineConfig, identity: bytes, io: BlockIO, num_layers: int
) -> tuple[KVConnectorScheduler | None, KVConnectorWorker | None]:
    """`identity`: what makes blocks interchangeable (weights, dtypes, block geometry)."""
    if config.kv_transfer_config is not None:
        from kvflow.kv_transfer.pd import PDConnectorScheduler, PDConnectorWorker

        kv = KVTransferConfig.parse(config.kv_transfer_config)
        worker = PDConnectorWorker(kv, hashlib.sha256(identity).hexdigest(), config.kv_cache_dtype, num_layers)
        worker.register_kv_caches(io)
        return PDConnectorScheduler(kv, config.block_size, worker.address if kv.is_producer else None), worker
    if config.kv_offload_cpu_gb > 0 or config.kv_offload_disk_dir:
        from kvflow.kv_transfer.offload import OffloadConnectorScheduler, OffloadConnectorWorker
        from kvflow.kv_transfer.offload_store import KVOffloadStore

        store = KVOffloadStore(
            identity,
            io.kv_block_shape,
            io.kv_block_dtype,
            int(config.kv_offload_cpu_gb * 2**30),
            config.kv_offload_disk_dir,
            int(config.kv_offload_disk_gb * 2**30),
        )
        worker = OffloadConnectorWorker(store)
        worker.register_kv_caches(io)
        return OffloadConnectorScheduler(store, config.block_size), worker
    return None, None
