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
    return [cpus[(r * per) % len(cpus):][:per] or cpus[:per] for r in range(size)], per


class TPWorkers:
    """The worker processes of ranks 1..N-1, and rank 0's membership of the group."""

    def __init__(self, config: "EngineConfig", max_model_len: int, num_blocks: int, hidden_size: int) -> None:
        size = config.tensor_parallel_size
        cpus, threads = rank_cpus(size, config.cpu_threads_per_rank)
        port = _free_port()
        init = f"tcp://127.0.0.1:{port}"
        self._threads_before = torch.get_num_threads()
        self._affinity_before = os.sched_getaffinity(0)
        # The shared-memory all-reduce's segment: slots big enough for a full step's hidden states.
        shm_path = ShmAllReduce.new_path()
        slot_bytes = config.max_num_batched_tokens * hidden_size * 8
        ShmAllReduce(shm_path, 0, size, slot_bytes, create=True).close()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        for rank in range(1, size):
            log = tempfile.NamedTemporaryFile(prefix=f"kvflow-tp-rank{rank}-", suffix=".log", delete=False)
            self.logs.append(log.name)
            args = {"rank": rank, "size": size, "init_method": init, "cpus": cpus[rank], "threads": threads,
                    "max_model_len": max_model_len, "num_blocks": num_blocks,
                    "config": asdict(config), "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
                    "shm_path": shm_path, "slot_bytes": slot_bytes, "hidden_size": hidden_size}
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "kvflow.executor.tp_worker", json.dumps(args)],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                               env=env, start_new_session=True))
            log.close()
        try:
            # Rank 0 is this process: its torch threads on its own cores, like every worker's.
            os.sched_setaffinity(0, cpus[0])
            torch.set_num_threads(threads)
            self.group: TPGroup = init_tp_group(0, size, init, COLLECTIVE_TIMEOUT_S)
            self.all_reduce = select_all_reduce(self.group, shm_path, slot_bytes, hidden_size)
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, proc in enumerate(self.procs, 1):
            while True:
                self._check(rank, proc)
                ready, _, _ = select.select([proc.stdout], [], [], 0.2)
                if ready:
                    msg = read_frame(proc.stdout)
                    if msg is None or not msg.get("ready"):
                        self._check(rank, proc, wait=5)
                        raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {msg}; log: "
                                           f"{self.logs[rank - 1]}")
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within {START_TIMEOUT_S:g} s; "
                                       f"log: {self.logs[rank - 1]}")

    def _check(self, rank: int, proc: subprocess.Popen, wait: float = 0) -> None:
        try:
            code = proc.wait(wait) if wait else proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} exited with code {code}; its log "
                               f"{self.logs[rank - 1]} ends: {_tail(self.logs[rank - 1])}")

    def step(self, seqs: list["ScheduledSeq"]) -> None:
        from kvflow.worker.model_runner import logits_rows

        message = {"op": "step", "t": [s.token_ids for s in seqs], "p": [s.start_pos for s in seqs],
                   "b": [s.block_table for s in seqs], "rows": logits_rows(seqs)}
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
        if getattr(self, "group", None) is not None:
            self.group.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(self._threads_before)
        os.sched_setaffinity(0, self._affinity_before)


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
