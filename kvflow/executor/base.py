"""The engine's only way to the model: one `execute` per step."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.core.scheduler import SchedulerOutput
    from kvflow.executor.mp import TPWorkers
    from kvflow.structured_output.manager import GrammarBitmask
    from kvflow.worker.model_runner import ModelRunner, RunnerOutput


class Executor:
    """Rank 0's runner in this process (it samples), plus the other tensor-parallel ranks when
    there are any: they get each step's sequences first and run the same forward pass over their
    shards, meeting rank 0 in the all-reduces."""

    def __init__(self, runner: "ModelRunner", workers: "TPWorkers | None" = None) -> None:
        self.runner = runner
        self.workers = workers

    def execute(self, sched: "SchedulerOutput", grammar: "GrammarBitmask | None" = None) -> "RunnerOutput":
        if self.workers is not None and sched.seqs:
            self.workers.step(sched.seqs)
        return self.runner.execute(sched, grammar)

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
