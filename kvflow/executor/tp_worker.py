"""A tensor-parallel rank > 0: join the group, load this rank's shard, then run every step rank 0
sends. Under the `mp` executor it is a process reading JSON frames on stdin until told to stop or
the pipe closes (rank 0 is gone); under `ray` the same `RankWorker` is a Ray actor."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from kvflow.executor.tp_block_io import serve_block_io


class RankWorker:
    def __init__(self, args: dict[str, Any], check_peers: Callable[[], None] | None = None) -> None:
        if args.get("cpus"):
            os.sched_setaffinity(0, args["cpus"])
        import torch

        torch.set_num_threads(args["threads"])
        from kvflow.config import EngineConfig
        from kvflow.distributed.parallel import init_tp_group, local_config, select_all_reduce
        from kvflow.models.loader import load_checkpoint
        from kvflow.worker.model_runner import ModelRunner

        self.tp = init_tp_group(args["rank"], args["size"], args["init_method"], args["collective_timeout_s"])
        select_all_reduce(
            self.tp,
            args["shm_path"],
            args["slot_bytes"],
            args["hidden_size"],
            check_peers=check_peers,
            timeout_s=args["collective_timeout_s"],
            force=args.get("force"),
        )
        config = EngineConfig(**args["config"])
        ckpt = load_checkpoint(config.model, config.tokenizer, with_tokenizer=False)
        self.runner = ModelRunner(
            local_config(ckpt.model_config, self.tp.size, config.enable_expert_parallel),
            config,
            args["max_model_len"],
            args["num_blocks"],
            ckpt.weights,
            calibration=args.get("calibration"),
            tp=self.tp,
        )

    def ready(self) -> bool:
        return True

    def step(self, msg: dict[str, Any]) -> None:
        self.runner.run_shard(msg["t"], msg["p"], msg["b"], msg["rows"])

    def block_io(self, op: str, blocks: list[int]) -> None:
        """This rank's part of rank 0's block read ("kv_read") or write ("kv_write")."""
        serve_block_io(self.runner, op, blocks)

    def close(self) -> None:
        self.tp.close()


def main(argv: list[str]) -> int:
    from kvflow.executor.mp import read_frame, write_frame

    args = json.loads(argv[0])
    out = sys.stdout.buffer
    parent = os.getppid()

    def check_parent() -> None:
        if os.getppid() != parent:  # rank 0 (the engine) is gone: nobody will finish this collective
            raise SystemExit("tensor-parallel rank 0 exited")

    try:
        worker = RankWorker(args, check_parent)
    except Exception as e:
        write_frame(out, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        raise
    write_frame(out, {"ready": True})
    steps = sys.stdin.buffer
    while True:
        msg = read_frame(steps)
        if msg is None or msg.get("op") == "stop":
            worker.close()
            return 0
        if msg["op"] == "step":
            worker.step(msg)
        else:  # a KV block read or write of rank 0's (kvflow.executor.tp_block_io)
            worker.block_io(msg["op"], msg["blocks"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
