"""One tensor-parallel group: its rank, its size, and the all-reduce the row-parallel projections
call. Weights are split by rank at load time (`shard_weight`): column-parallel q/k/v and gate/up
(each rank its heads / its slice of the FFN), row-parallel o and down (each rank its input slice,
partial outputs summed by one all-reduce); embeddings, norms and the lm_head stay whole. A
Mixture-of-Experts model's experts are split the same way inside (kvflow.models.moe), or, with
expert parallelism, whole experts are assigned to the ranks (`expert_range`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from kvflow.config import ModelConfig
from kvflow.distributed.shm_all_reduce import ShmAllReduce

logger = logging.getLogger("kvflow")
ALL_REDUCE_IMPLS = ("auto", "gloo", "shm")


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # the torch.distributed process group (None: one rank)
    shm: ShmAllReduce | None = None  # the shared-memory all-reduce, when it measured faster

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.shm is not None and self.shm.fits(t):
                return self.shm(t)
            torch.distributed.all_reduce(t, group=self.group)
        return t

    def gather_first(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """The ranks' [rows, widths[r]] slices side by side on the first rank; None on the others."""
        if self.shm is not None and self.shm.fits(t):
            parts = self.shm.gather(t, widths, self.is_first)
        else:
            parts = [torch.empty(t.shape[0], w, dtype=t.dtype) for w in widths] if self.is_first else None
            if max(widths) != min(widths):  # gloo gathers equal shapes: pad to the widest
                t = torch.nn.functional.pad(t, (0, max(widths) - t.shape[1]))
                full = [torch.empty(t.shape[0], max(widths), dtype=t.dtype) for _ in widths] if self.is_first else None
                torch.distributed.gather(t.contiguous(), full, dst=0, group=self.group)
                parts = None if full is None else [f[:, :w] for f, w in zip(full, widths)]
            else:
                torch.distributed.gather(t.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=1) if self.is_first else None

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close(unlink=self.is_first)
            self.shm = None


def select_all_reduce(
    tp: TPGroup,
    shm_path: str,
    slot_bytes: int,
    hidden_size: int,
    rounds: int = 30,
    check_peers=None,
    timeout_s: float = 120.0,
    force: str | None = None,
) -> str:
    """Every rank calls this at the same point: time gloo and the shared-memory all-reduce on a
    decode-sized tensor, keep the faster (rank 0 decides, so all ranks agree). KVFLOW_TP_ALL_REDUCE
    = gloo | shm (or `force`, the same on every rank) forces one."""
    if force == "gloo":  # ranks on several hosts: there is no shared segment to open
        if tp.is_first:
            logger.info("tensor parallel all-reduce: gloo (ranks on more than one host)")
        return "gloo"
    shm = ShmAllReduce(shm_path, tp.rank, tp.size, slot_bytes, create=False, timeout_s=timeout_s)
    shm.check_peers = check_peers
    # A decode step's size (32 rows), or the most a step can hold (slot_bytes follows
    # max_num_batched_tokens): the sample must fit the shared-memory slot it is timed through.
    rows = max(1, min(32, slot_bytes // (4 * hidden_size)))
    sample = torch.ones(rows, hidden_size)

    def timed(fn) -> float:
        torch.distributed.barrier(group=tp.group)
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn(sample.clone())
        return time.perf_counter() - t0

    forced = force or os.environ.get("KVFLOW_TP_ALL_REDUCE", "auto")
    if forced not in ALL_REDUCE_IMPLS:
        raise ValueError(f"KVFLOW_TP_ALL_REDUCE must be one of {', '.join(ALL_REDUCE_IMPLS)}, got {forced!r}")
    t_gloo = timed(lambda x: torch.distributed.all_reduce(x, group=tp.group))
    t_shm = timed(shm)
    choice = torch.tensor([{"gloo": 0, "shm": 1}.get(forced, int(t_shm < t_gloo))])
    torch.distributed.broadcast(choice, src=0, group=tp.group)
    name = "shm" if int(choice) else "gloo"
    if name == "shm":
        tp.shm = shm
    else:
        shm.close()
    if tp.is_first:
        logger.info(
            "tensor parallel all-reduce: %s (measured [%d, %d] fp32: gloo %.3f ms, shared memory %.3f ms)",
            name,
            rows,
            hidden_size,
            1000 * t_gloo / rounds,
            1000 * t_shm / rounds,
        )
    return name


def init_tp_group(rank: int, size: int, init_method: str, timeout_s: float) -> TPGroup:
    """Join the gloo group of `size` ranks at `init_method` (tcp://host:port); bounded by timeout_s."""
    torch.distributed.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
    )
    return TPGroup(rank, size, torch.distributed.group.WORLD)


def check_divisible(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Refuse a split the model's shapes do not allow, naming the shape and the TP size. A MoE
    model's experts are split inside (their width divided) unless `expert_parallel` assigns whole
    experts to the ranks instead (`expert_range`); its dense FFN width counts only where some
    layer is dense."""
    moe = cfg.moe
    dense_layers = moe is None or any(not moe.is_sparse(i) for i in range(cfg.num_layers))
    shapes = [("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads)]
    if dense_layers:
        shapes.append(("FFN width (intermediate_size)", cfg.intermediate_size))
    if moe is not None and not expert_parallel:
        shapes.append(
            ("expert width (moe_intermediate_size; or pass enable_expert_parallel)", moe.moe_intermediate_size)
        )
    if moe is not None and moe.shared_expert_intermediate_size:
        shapes.append(("shared expert width (shared_expert_intermediate_size)", moe.shared_expert_intermediate_size))
    for name, value in shapes:
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's {name} ({value})")
    if expert_parallel:
        if moe is None:
            raise ValueError(
                f"enable_expert_parallel partitions the experts of a Mixture-of-Experts model; {cfg.architecture} "
                "has none: unset enable_expert_parallel"
            )
        if moe.num_experts < size:
            raise ValueError(
                f"enable_expert_parallel with tensor_parallel_size={size} needs at least one expert per rank; "
                f"the model has {moe.num_experts} experts: use a smaller tensor_parallel_size or unset "
                "enable_expert_parallel"
            )


def expert_range(num_experts: int, rank: int, size: int) -> range:
    """The experts rank `rank` of `size` holds under expert parallelism: a contiguous range, the
    first `num_experts % size` ranks one expert more than the others (as vLLM assigns them)."""
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def local_config(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> ModelConfig:
    """The architecture one rank holds: its share of the heads and of the FFN; for a MoE model its
    share of every expert's width (and of the shared expert's), or with `expert_parallel` whole
    experts, a range of them per rank (`MoeConfig.expert_parallel_size`)."""
    if size == 1:
        if expert_parallel:
            raise ValueError("enable_expert_parallel needs tensor_parallel_size > 1 (got 1)")
        return cfg
    check_divisible(cfg, size, expert_parallel)
    moe = cfg.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            moe_intermediate_size=moe.moe_intermediate_size if expert_parallel else moe.moe_intermediate_size // size,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size // size,
            expert_parallel_size=size if expert_parallel else 1,
        )
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
        moe=moe,
    )


# HF projection name -> (which dimension is split, 0 = output rows / 1 = input columns)
_SPLIT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


def shard_weight(proj: str, tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of an HF projection weight (or bias) named `proj`; others unchanged. Heads
    are contiguous rows of q/k/v (and columns of o), so an even split keeps whole heads."""
    dim = _SPLIT.get(proj)
    if tp.size == 1 or dim is None or (dim == 1 and tensor.dim() == 1):
        return tensor  # a row-parallel bias would be added once per rank: o/down have none
    return tensor.chunk(tp.size, dim=dim)[tp.rank].contiguous()
