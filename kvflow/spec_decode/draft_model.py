"""Draft tokens from a smaller model (or the target's own weights in int8), greedy, batched.

The draft model has its own `ModelRunner` and its own paged KV cache, managed by the same block
machinery as the target's (a `KVCacheManager` without prefix caching). Per request the proposer
keeps how many leading tokens have their KV in the draft cache. A step first catches the draft up
on what the target accepted since (one batched pass: for a new request that is its whole prompt),
sampling the first draft, then runs one single-token pass per further draft depth.

Drafts are the draft model's argmax, so the verifier sees a deterministic draft (q one-hot): the
rejection sampler is exact for it at any temperature (it accepts x with probability p(x)).

After verification only the positions the target kept are valid in the draft cache too: the
proposer falls back to the target's `num_computed_tokens` (`observe`), so the KV of rejected
drafts is overwritten on the next catch-up, as in the target.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvflow.config import EngineConfig, SpeculativeConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request
from kvflow.core.scheduler import ScheduledSeq, SchedulerOutput
from kvflow.core.step_cost import StepCostModel
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.proposer import Drafts

logger = logging.getLogger("kvflow")
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass(eq=False)
class _DraftSeq:
    """What the draft cache's manager needs of a sequence (it never hashes: no prefix caching)."""

    request_id: str
    num_computed_tokens: int = 0
    num_tokens: int = 0


class DraftModelProposer:
    def __init__(self, runner, num_blocks: int, block_size: int) -> None:
        self.runner = runner  # a ModelRunner over the draft weights
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self.seqs: dict[str, _DraftSeq] = {}
        self.cost = StepCostModel()  # of one draft pass: the speculator weighs it against the gain

    @classmethod
    def create(
        cls,
        target: EngineConfig,
        spec: SpeculativeConfig,
        vocab_size: int,
        max_model_len: int,
        num_blocks: int,
        tokenizer: Any | None,
    ) -> DraftModelProposer:
        """`tokenizer`: the target's (drafts share its vocabulary), for an int8 draft's calibration."""
        from kvflow.models.loader import load_checkpoint
        from kvflow.worker.model_runner import ModelRunner, calibration_ids

        ckpt = load_checkpoint(spec.model or target.model)
        mc = ckpt.model_config
        if mc.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({mc.vocab_size} tokens) differs from the target's "
                f"({vocab_size}): drafts must use the same tokenizer"
            )
        if mc.max_position_embeddings < max_model_len:
            raise ValueError(
                f"the draft model's context ({mc.max_position_embeddings}) is shorter than "
                f"max_model_len ({max_model_len})"
            )
        # The draft runs whole in the engine process (rank 0 under tensor parallelism: a small model
        # is not worth splitting, as vLLM's draft_tensor_parallel_size=1).
        cfg = dataclasses.replace(
            target,
            model=spec.model or target.model,
            quantization=spec.quantization,
            speculative_config=None,
            kv_offload_cpu_gb=0.0,
            kv_offload_disk_dir=None,
            tensor_parallel_size=1,
            distributed_executor_backend=None,
            cpu_threads_per_rank=None,
            # (its KV manager keeps one table per sequence: every block of every layer)
            disable_hybrid_kv_cache_manager=True,
        )
        calibration = calibration_ids(tokenizer, mc.vocab_size) if cfg.quantization == "int8" else None
        runner = ModelRunner(mc, cfg, max_model_len, num_blocks, ckpt.weights, calibration=calibration)
        logger.info(
            "speculative decoding: draft model %s (%s), %d KV blocks",
            ckpt.name,
            spec.quantization or cfg.dtype,
            num_blocks,
        )
        proposer = cls(runner, num_blocks, target.block_size)
        proposer.calibrate()
        return proposer

    def calibrate(self, passes: int = 3) -> None:
        """Time a draft pass before any request: the speculator weighs a draft's pass against the
        target's step from the first step on, so a draft model slower than the target (an int8
        copy of a model whose target runs 4-bit blocks) is never run, instead of being found out
        by the catch-up prefills of the first requests. A one-token sequence, its blocks
        returned after; the first pass (one-time set-up) is not counted."""
        probe = _DraftSeq("__draft-calibration__", 0, 1)
        if not self.kv.allocate_slots(probe, 1):
            return
        out = SchedulerOutput(
            seqs=[ScheduledSeq(probe.request_id, [0], 0, self.kv.block_table(probe), True, _GREEDY, 1)]
        )
        try:
            for i in range(passes):
                t0 = time.perf_counter()
                self.runner.execute(out)
                if i > 0:
                    self.cost.observe(1, time.perf_counter() - t0)
        finally:
            self.kv.free(probe)
            self.runner.release([probe.request_id])

    def propose(self, requests: list[Request], plan: dict[str, int]) -> dict[str, Drafts]:
        wanted = [r for r in requests if plan.get(r.request_id, 0) > 0]
        drafts: dict[str, list[int]] = {r.request_id: [] for r in wanted}
        seqs = []
        for r in wanted:
            ds = self.seqs.setdefault(r.request_id, _DraftSeq(r.request_id))
            ds.num_computed_tokens = min(ds.num_computed_tokens, r.num_tokens - 1)
            ds.num_tokens = r.num_tokens
            n = r.num_tokens - ds.num_computed_tokens
            # room for the catch-up and every later depth (k - 1 more single-token passes)
            if not self.kv.allocate_slots(ds, n + plan[r.request_id] - 1):
                self.release([r.request_id])  # the draft pool is full: no drafts for it this step
                continue
            seqs.append((r, ds, r.token_ids_between(ds.num_computed_tokens, r.num_tokens)))
        depth = 0
        while seqs:
            out = SchedulerOutput(
                seqs=[
                    ScheduledSeq(
                        r.request_id,
                        ids,
                        ds.num_computed_tokens,
                        self.kv.block_table(ds),
                        True,
                        _GREEDY,
                        len(r.prompt_token_ids),
                    )
                    for r, ds, ids in seqs
                ]
            )
            t0 = time.perf_counter()
            sampled = self.runner.execute(out).sampled
            if out.num_tokens == len(out.seqs):
                # A one-token-per-row pass is what each further draft depth costs; catch-up passes
                # (a new request's whole prompt) would make drafting look dearer than it is.
                self.cost.observe(out.num_tokens, time.perf_counter() - t0)
            depth += 1
            nxt = []
            for r, ds, ids in seqs:
                ds.num_computed_tokens += len(ids)
                token = sampled[r.request_id][0]
                drafts[r.request_id].append(token)
                if depth < plan[r.request_id]:
                    nxt.append((r, ds, [token]))
            seqs = nxt
        return {rid: Drafts(tokens) for rid, tokens in drafts.items()}

    def observe(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Keep only the draft KV of positions the target kept."""
        for seq in sched.seqs:
            ds = self.seqs.get(seq.request_id)
            if ds is None or not seq.sample:
                continue
            tokens = sampled.get(seq.request_id) or [None]
            kept = seq.start_pos + len(seq.token_ids) - len(seq.spec_token_ids) + len(tokens) - 1
            ds.num_computed_tokens = min(ds.num_computed_tokens, kept)

    def release(self, request_ids) -> None:
        for rid in request_ids:
            ds = self.seqs.pop(rid, None)
            if ds is not None:
                self.kv.free(ds)
        self.runner.release(request_ids)
