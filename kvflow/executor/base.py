"""The engine's only way to the model: the KV sizing it needs before the model is loaded
(`kv_cache_spec`), the runners and workers it builds (`create`), one `execute` per step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from kvflow.executor.tp_block_io import TPBlockIO

if TYPE_CHECKING:
    from kvflow.config import EngineConfig, ModelConfig
    from kvflow.core.scheduler import SchedulerOutput
    from kvflow.core.step_cost import DecodePass
    from kvflow.executor.mp import TPWorkers
    from kvflow.executor.ray_executor import RayTPWorkers
    from kvflow.kv_transfer.base import KVConnectorWorker
    from kvflow.models.loader import Checkpoint
    from kvflow.structured_output.manager import GrammarBitmask
    from kvflow.worker.model_runner import KVCacheSpec, ModelRunner, RunnerOutput


class Executor:
    """Rank 0's runner in this process (it samples), plus the other tensor-parallel ranks when
    there are any: they get each step's sequences first and run the same forward pass over their
    shards, meeting rank 0 in the all-reduces."""

    def __init__(self, runner: ModelRunner, workers: TPWorkers | RayTPWorkers | None = None) -> None:
        self.runner = runner
        self.workers = workers
        # Whole KV blocks as the KV connectors move them: rank 0's runner, or under tensor
        # parallelism every rank's share of the heads gathered / scattered (TPBlockIO).
        self.kv_io = runner if workers is None else TPBlockIO(runner, workers)
        self.kv_connector: KVConnectorWorker | None = None  # set by the engine (offload tiers, P/D)

    @staticmethod
    def kv_cache_spec(model_config: ModelConfig, config: EngineConfig) -> KVCacheSpec:
        """One rank's KV bytes per token (the worker's answer): the engine sizes its block pool
        from it, and that size is what `create` then allocates on every rank."""
        from kvflow.worker.model_runner import kv_cache_spec

        return kv_cache_spec(model_config, config)

    @classmethod
    def create(cls, config: EngineConfig, ckpt: Checkpoint, max_model_len: int, num_blocks: int) -> Executor:
        """Rank 0's runner over `ckpt`'s weights (its tokenizer only for the int8 calibration
        text, whose ids every rank gets), after the other ranks' workers when tensor-parallel: rank 0 shards its weights in
        their group, so the group comes first, and the workers are waited for last."""
        from kvflow.distributed.parallel import local_config
        from kvflow.worker.model_runner import ModelRunner, calibration_ids

        # this rank's share
        mc = local_config(ckpt.model_config, config.tensor_parallel_size, config.enable_expert_parallel)
        # int8's calibration tokens: tokenized here, the same for every rank.
        calibration = calibration_ids(ckpt.tokenizer, mc.vocab_size) if config.quantization == "int8" else None
        workers = _start_workers(config, max_model_len, num_blocks, mc.hidden_size, calibration)
        try:
            runner = ModelRunner(
                mc,
                config,
                max_model_len,
                num_blocks,
                ckpt.weights,
                calibration=calibration,
                tp=None if workers is None else workers.group,
            )
            if workers is not None:
                workers.wait_ready()
        except BaseException:
            if workers is not None:
                workers.shutdown()
            raise
        return cls(runner, workers)

    def execute(self, sched: SchedulerOutput, grammar: GrammarBitmask | None = None) -> RunnerOutput:
        """One step: the KV connector's loads (before the forward pass: under TP their block writes
        reach the workers ahead of the step), the forward pass on every rank, then the connector's
        saves and finished transfers."""
        connector = self.kv_connector
        if connector is not None and sched.kv_connector_metadata is not None:
            with torch.inference_mode():
                connector.start_load_kv(sched.kv_connector_metadata)
        if self.workers is not None and sched.seqs:
            self.workers.step(sched.seqs)
        result = self.runner.execute(sched, grammar)
        if connector is not None:
            with torch.inference_mode():
                connector.wait_for_save()
            result.kv_connector_output = connector.get_finished()
        return result

    def kernel_summary(self) -> str:
        """Rank 0's linear kernel choice (the other ranks tune their own shapes alike)."""
        return self.runner.kernel_summary()

    def decode_pass(self) -> DecodePass:
        """Which steps rank 0's model computes as its one-call decode pass (the step-cost model's)."""
        return self.runner.decode_pass()

    def moe_stats(self):
        """Rank 0's Mixture-of-Experts routing counts (kvflow.layers.moe.MoeRoutingStats), or None."""
        return self.runner.moe_stats()

    def release(self, request_ids: Iterable[str]) -> None:
        """Finished requests: rank 0 drops their random generators (only rank 0 samples)."""
        self.runner.release(request_ids)

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()


def _start_workers(
    config: EngineConfig, max_model_len: int, num_blocks: int, hidden_size: int, calibration: list[int] | None
) -> TPWorkers | RayTPWorkers | None:
    """Ranks 1..N-1 under tensor parallelism (processes, or Ray actors); None for one rank."""
    if config.tensor_parallel_size <= 1:
        return None
    if config.distributed_executor_backend == "ray":
        from kvflow.executor.ray_executor import RayTPWorkers as Workers
    else:
        from kvflow.executor.mp import TPWorkers as Workers
    return Workers(config, max_model_len, num_blocks, hidden_size, calibration)
