"""A tensor-parallel rank > 0: join the group, load this rank's shard, then run every step rank 0
sends (a JSON frame on stdin) until told to stop or the pipe closes (rank 0 is gone)."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    os.sched_setaffinity(0, args["cpus"])
    import torch

    torch.set_num_threads(args["threads"])
    from kvflow.config import EngineConfig
    from kvflow.distributed.parallel import init_tp_group, local_config, select_all_reduce
    from kvflow.executor.mp import read_frame, write_frame
    from kvflow.models.loader import load_checkpoint
    from kvflow.worker.model_runner import ModelRunner

    out = sys.stdout.buffer
    tp = init_tp_group(args["rank"], args["size"], args["init_method"], args["collective_timeout_s"])
    select_all_reduce(tp, args["shm_path"], args["slot_bytes"], args["hidden_size"])
    try:
        config = EngineConfig(**args["config"])
        ckpt = load_checkpoint(config.model, config.tokenizer, with_tokenizer=False)
        runner = ModelRunner(local_config(ckpt.model_config, tp.size), config, args["max_model_len"],
                             args["num_blocks"], ckpt.weights, tp=tp)
    except Exception as e:
        write_frame(out, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        raise
    write_frame(out, {"ready": True})
    steps = sys.stdin.buffer
    while True:
        msg = read_frame(steps)
        if msg is None or msg.get("op") == "stop":
            tp.close()
            return 0
        runner.run_shard(msg["t"], msg["p"], msg["b"], msg["rows"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
