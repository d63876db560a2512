"""Moving KV blocks: the connector interface (scheduler side + worker side) and its connectors.

- `offload`: the CPU-memory and disk tiers of the prefix cache (blocks the pool evicts).
- `pd`: prefill/decode disaggregation: a producer engine holds a finished prompt's blocks, a
  consumer engine fetches them over TCP (or shared memory on one host) and decodes.
"""

from kvflow.config import KVTransferConfig
from kvflow.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker

__all__ = ["KVConnectorMetadata", "KVConnectorOutput", "KVConnectorScheduler", "KVConnectorWorker", "KVTransferConfig"]
