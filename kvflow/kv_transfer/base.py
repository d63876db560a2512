"""The connector interface: everything that moves KV blocks in or out of the pool.

Split like vLLM v1's: the scheduler side decides (which of a request's tokens a source outside the
pool can supply, what to move this step, whether a finished request's blocks must be held) and
never touches tensors; the worker side moves the bytes. The two talk only through the per-step
`KVConnectorMetadata` (in the `SchedulerOutput`) and the `KVConnectorOutput` the runner returns.

A load is either synchronous (done by the runner before the step's forward pass: the offload
tiers) or asynchronous (a remote fetch that may take several steps: the request waits, holding
its blocks, until the worker reports it in `finished_recving` or `failed_recving`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvflow.core.kv_cache_manager import KVCacheManager
    from kvflow.core.request import Request


@dataclass
class KVConnectorMetadata:
    """What the worker side must do this step; each connector extends it."""

    @property
    def is_empty(self) -> bool:
        return True


@dataclass
class KVConnectorOutput:
    """What the worker side finished since the last step."""

    finished_sending: set[str] = field(default_factory=set)  # held-block keys the scheduler may free
    finished_recving: set[str] = field(default_factory=set)  # request ids whose blocks are loaded
    failed_recving: dict[str, str] = field(default_factory=dict)  # request id -> why

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


class BlockIO(Protocol):
    """The worker's access to the KV cache tensors, one whole block (all layers) at a time."""

    kv_block_shape: tuple[int, ...]
    kv_block_dtype: torch.dtype
    # True when reads and writes are collectives (tensor parallelism): only the engine thread may
    # start them, between steps.
    collective: bool

    def read_blocks(self, blocks: list[int]) -> torch.Tensor: ...

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None: ...


class KVConnectorScheduler:
    """Scheduler side (no tensors). The defaults describe a connector that supplies nothing."""

    # An asynchronous load that fails: "recompute" the prompt, or "fail" the request.
    load_failure_policy: str = "recompute"

    def bind(self, kv_cache: KVCacheManager) -> None:
        """Called once with the pool's manager (e.g. to hear of evictions)."""

    def check_request(self, kv_transfer_params: dict[str, Any] | None) -> None:
        """Raise ValueError (the client's error) for params this connector cannot act on."""
        if kv_transfer_params and (
            kv_transfer_params.get("do_remote_decode") or kv_transfer_params.get("do_remote_prefill")
        ):
            raise ValueError("kv_transfer_params asks for a KV transfer, but this engine has no --kv-transfer-config")

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens after the `num_computed_tokens` found in the pool this connector can
        supply (a multiple of the block size), and whether the load is asynchronous."""
        return 0, False

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The blocks allocated for the external tokens returned above (in order)."""

    def build_connector_meta(self) -> KVConnectorMetadata:
        """The step's work for the worker side; resets what was collected."""
        return KVConnectorMetadata()

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[str | None, dict[str, Any] | None]:
        """A request ended (any reason). Returns (key, kv_transfer_params): a key means "hold the
        blocks under this key until `finished_sending` names it"; the params go to the client."""
        return None, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the worker finished (called before the scheduler acts on it)."""

    def has_pending(self) -> bool:
        """Transfers in flight or blocks held: the engine must keep polling even when idle."""
        return False

    def build_shutdown_meta(self) -> KVConnectorMetadata | None:
        """Work for the worker side before the engine stops (e.g. persisting the cache)."""
        return None


class KVConnectorWorker:
    """Worker side: moves bytes between the KV cache and wherever the connector keeps them."""

    def register_kv_caches(self, io: BlockIO) -> None:
        self.io = io

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Before the forward pass: synchronous loads done, asynchronous ones started."""

    def wait_for_save(self) -> None:
        """After the forward pass: the step's saves are complete (or safely handed off)."""

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def shutdown(self) -> None:
        pass

    def stats(self) -> Any:
        """A snapshot of this connector's counters (None: it keeps none)."""
        return None

    def take_transfer_times(self) -> list[float]:
        """Transfer durations (s) since the last call, for the metrics histogram."""
        return []
