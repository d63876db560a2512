"""Tensor parallelism on one machine: ranks 1..N-1 as worker processes (`tp_worker.py`), rank 0 in
the engine process. The ranks meet in a gloo group for the all-reduces; each step's sequences go to
the workers as a declared JSON frame over their stdin (never pickle), and a worker that dies, or
fails to start, ends the engine with an error naming it, never a hang."""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from kvflow.distributed.parallel import TPGroup, init_tp_group, select_all_reduce
from kvflow.distributed.shm_all_reduce import ShmAllReduce
from kvflow.worker.model_runner import logits_rows

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.scheduler import ScheduledSeq

_LEN = struct.Struct("<I")
START_TIMEOUT_S = 600.0  # loading the checkpoint on every rank
COLLECTIVE_TIMEOUT_S = 120.0  # one all-reduce (a rank that stops answering ends the engine after this)


def write_frame(f, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def read_frame(f) -> dict | None:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None  # the other side closed the pipe
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    if len(data) < n:
        return None
    return json.loads(data)


def rank_cpus(size: int, threads_per_rank: int | None) -> tuple[list[list[int]], int]:
    """Each rank's CPUs (an even split of this process's) and its thread count."""
    cpus = sorted(os.sched_getaffinity(0))
    per = threads_per_rank or max(1, len(cpus) // size)
    return [cpus[(r * per) % len(cpus) :][:per] or cpus[:per] for r in range(size)], per


class RankPlan:
    """What every rank is told: the group's address, its CPUs and threads, the shared segment."""

    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        num_blocks: int,
        hidden_size: int,
        calibration: list[int] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.size = config.tensor_parallel_size
        self.cpus, self.threads = rank_cpus(self.size, config.cpu_threads_per_rank)
        self.init_method = f"tcp://{host}:{_free_port()}"
        self.hidden_size = hidden_size
        # What join_as_rank0 changes in this process, for leave() to put back.
        self._threads_before = torch.get_num_threads()
        self._affinity_before = os.sched_getaffinity(0)
        # The shared-memory all-reduce's segment: slots big enough for a full step's hidden states.
        self.shm_path = ShmAllReduce.new_path()
        self.slot_bytes = config.max_num_batched_tokens * hidden_size * 8
        ShmAllReduce(self.shm_path, 0, self.size, self.slot_bytes, create=True).close()
        self._common = {
            "size": self.size,
            "init_method": self.init_method,
            "threads": self.threads,
            "max_model_len": max_model_len,
            "num_blocks": num_blocks,
            "config": asdict(config),
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
            "shm_path": self.shm_path,
            "slot_bytes": self.slot_bytes,
            "hidden_size": hidden_size,
            "calibration": calibration,
        }

    def args(self, rank: int, **extra) -> dict:
        return {**self._common, "rank": rank, "cpus": self.cpus[rank], **extra}

    def join_as_rank0(self, check_peers, force: str | None = None) -> tuple[TPGroup, str]:
        """This process becomes rank 0 (its threads on its own cores, like every worker's)."""
        os.sched_setaffinity(0, self.cpus[0])
        torch.set_num_threads(self.threads)
        group = init_tp_group(0, self.size, self.init_method, COLLECTIVE_TIMEOUT_S)
        return group, select_all_reduce(
            group,
            self.shm_path,
            self.slot_bytes,
            self.hidden_size,
            check_peers=check_peers,
            timeout_s=COLLECTIVE_TIMEOUT_S,
            force=force,
        )

    def leave(self, group: TPGroup | None) -> None:
        """Rank 0 leaves the group (its shared segment removed) and gets its threads and CPUs back."""
        if group is not None:
            group.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(self._threads_before)
        os.sched_setaffinity(0, self._affinity_before)


def step_message(seqs: list[ScheduledSeq]) -> dict:
    """One step as the other ranks get it: tokens, positions, block tables, logits rows."""
    return {
        "op": "step",
        "t": [s.token_ids for s in seqs],
        "p": [s.start_pos for s in seqs],
        "b": [s.block_table for s in seqs],
        "rows": logits_rows(seqs),
    }


class TPWorkers:
    """The worker processes of ranks 1..N-1, and rank 0's membership of the group."""

    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        num_blocks: int,
        hidden_size: int,
        calibration: list[int] | None = None,
    ) -> None:
        self.plan = plan = RankPlan(config, max_model_len, num_blocks, hidden_size, calibration)
        self.group: TPGroup | None = None
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        for rank in range(1, plan.size):
            log = tempfile.NamedTemporaryFile(prefix=f"kvflow-tp-rank{rank}-", suffix=".log", delete=False)
            self.logs.append(log.name)
            args = plan.args(rank)
            env = {**os.environ, "OMP_NUM_THREADS": str(plan.threads)}
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "kvflow.executor.tp_worker", json.dumps(args)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                )
            )
            log.close()
        try:
            self.group, self.all_reduce = plan.join_as_rank0(self.check_alive)
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """Until every worker has built its runner (after rank 0 built its own: a runner's start-up
        may be collective, as int8's calibration pass is)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, proc in enumerate(self.procs, 1):
            while True:
                self._check(rank, proc)
                ready, _, _ = select.select([proc.stdout], [], [], 0.2)
                if ready:
                    msg = read_frame(proc.stdout)
                    if msg is None or not msg.get("ready"):
                        self._check(rank, proc, wait=5)
                        raise RuntimeError(
                            f"tensor-parallel rank {rank} failed to start: {msg}; log: {self.logs[rank - 1]}"
                        )
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} did not start within {START_TIMEOUT_S:g} s; "
                        f"log: {self.logs[rank - 1]}"
                    )

    def _check(self, rank: int, proc: subprocess.Popen, wait: float = 0) -> None:
        try:
            code = proc.wait(wait) if wait else proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            raise RuntimeError(
                f"tensor-parallel rank {rank} exited with code {code}; its log "
                f"{self.logs[rank - 1]} ends: {_tail(self.logs[rank - 1])}"
            )

    def check_alive(self) -> None:
        """Raises if a worker has exited (called while rank 0 waits in a collective)."""
        for rank, proc in enumerate(self.procs, 1):
            self._check(rank, proc)

    def step(self, seqs: list[ScheduledSeq]) -> None:
        self._send(step_message(seqs))

    def kv_op(self, op: str, blocks: list[int]) -> None:
        """Tell every worker to take part in rank 0's next block read ("kv_read") or write."""
        self._send({"op": op, "blocks": blocks})

    def _send(self, message: dict) -> None:
        for rank, proc in enumerate(self.procs, 1):
            self._check(rank, proc)
            try:
                write_frame(proc.stdin, message)
            except (BrokenPipeError, OSError):
                self._check(rank, proc, wait=5)
                raise RuntimeError(f"tensor-parallel rank {rank} stopped reading its steps") from None

    def shutdown(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    write_frame(proc.stdin, {"op": "stop"})
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        self.plan.leave(self.group)
        self.group = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:])
    except OSError:
        return "(unreadable)"
