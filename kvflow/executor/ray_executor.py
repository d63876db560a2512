"""Tensor parallelism with Ray placing the ranks: ranks 1..N-1 are Ray actors in a placement group
(one bundle of CPUs each), rank 0 stays in the engine process. It joins the cluster named by
RAY_ADDRESS, or the one this process already started, or starts a local one. The ranks meet in the
same gloo group as under `mp` (over the engine host's address), with the shared-memory all-reduce
only when every rank is on this host. Steps go to the actors as plain dicts of lists (the same
message as `mp`'s), one actor call each, in order; an actor that dies ends the engine with an error
naming its rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.executor.mp import START_TIMEOUT_S, RankPlan, step_message
from kvflow.utils.ray import import_ray, join_ray

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.scheduler import ScheduledSeq


class RayTPWorkers:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        num_blocks: int,
        hidden_size: int,
        calibration: list[int] | None = None,
    ) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._started_ray = join_ray()
        self.plan = plan = RankPlan(
            config, max_model_len, num_blocks, hidden_size, calibration, host=ray.util.get_node_ip_address()
        )
        self.group = None
        self.pg = placement_group([{"CPU": plan.threads}] * (plan.size - 1), strategy="PACK")
        self.actors: list = []
        self._inflight: list = []
        try:
            ready, _ = ray.wait([self.pg.ready()], timeout=60)
            if not ready:
                raise RuntimeError(
                    f"Ray could not place {plan.size - 1} tensor-parallel rank(s) of {plan.threads} "
                    "CPU(s) each within 60 s: the cluster lacks free CPUs"
                )
            node = ray.get_runtime_context().get_node_id()
            local = set(placement_group_table(self.pg)["bundles_to_node_id"].values()) <= {node}
            force = None if local else "gloo"
            from kvflow.executor.tp_worker import RankWorker

            actor_cls = ray.remote(RankWorker)
            for rank in range(1, plan.size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank - 1
                )
                args = plan.args(rank, force=force, cpus=plan.cpus[rank] if local else None)
                self.actors.append(
                    actor_cls.options(num_cpus=plan.threads, scheduling_strategy=strategy, max_restarts=0).remote(args)
                )
            self.group, self.all_reduce = plan.join_as_rank0(self.check_alive, force=force)
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """Until every actor has built its runner (after rank 0's: see TPWorkers.wait_ready)."""
        try:
            import_ray().get([a.ready.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        except Exception as e:
            raise RuntimeError(
                f"a tensor-parallel rank (a Ray actor) failed to start: {type(e).__name__}: {e}"
            ) from None

    def check_alive(self) -> None:
        """Raises if an actor's last step failed or the actor died."""
        ray = import_ray()
        if not self._inflight:
            return
        done, _ = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
        for ref in done:
            rank = self._inflight.index(ref) + 1
            try:
                ray.get(ref)
            except Exception as e:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} (a Ray actor) exited: {type(e).__name__}: {e}"
                ) from None

    def step(self, seqs: list[ScheduledSeq]) -> None:
        self.check_alive()
        message = step_message(seqs)
        self._inflight = [a.step.remote(message) for a in self.actors]

    def kv_op(self, op: str, blocks: list[int]) -> None:
        """Every actor takes part in rank 0's next block read ("kv_read") or write (actor calls run
        in the order they were made: before the next step's)."""
        self.check_alive()
        self._inflight = [a.block_io.remote(op, blocks) for a in self.actors]

    def shutdown(self) -> None:
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors, self._inflight = [], []
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass
        self.plan.leave(self.group)
        self.group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
