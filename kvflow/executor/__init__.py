"""Where the model runs: this process's runner (rank 0), and under tensor parallelism one worker
process per other rank, each driven with every step (see mp.py)."""

from kvflow.executor.base import Executor

__all__ = ["Executor"]
