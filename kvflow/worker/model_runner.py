"""Turns a `SchedulerOutput` into tensors, runs the model, samples.

Owns the device state: the model's weights, the KV cache tensors and the per-request random
generators. Knows sequences only as (tokens, start position, block table, sampling params).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvflow.config import EngineConfig, ModelConfig
from kvflow.core.scheduler import SchedulerOutput
from kvflow.layers.attention import SeqLayout, TorchPagedAttention
from kvflow.models.llama import LlamaForCausalLM
from kvflow.sample.sampler import Sampler, SamplingBatch
from kvflow.worker.kv_offload import KVOffloadStore

LogprobEntry = tuple[float, int, list[int], list[float]]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, max_model_len: int,
                 num_blocks: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.attention = TorchPagedAttention(config.block_size, model_config.sliding_window, self.device)
        self.model = LlamaForCausalLM(model_config, self.attention, max_model_len, self.dtype, self.device)
        self.model.load_weights(weights)
        self.model.eval()
        shape = (num_blocks, config.block_size, model_config.num_kv_heads, model_config.head_dim)
        # Zeroed, not empty: masked-out slots are still multiplied by 0 and NaN garbage would leak.
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(model_config.num_layers)
        ]
        self.sampler = Sampler(config.seed, self.device)
        self.offload: KVOffloadStore | None = None  # set by the engine when tiers are configured
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, LogprobEntry]]:
        if self.offload is not None:
            self._transfer_kv(out)
        seqs = out.seqs
        if not seqs:
            return {}, {}
        tokens = [t for s in seqs for t in s.token_ids]
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        meta = self.attention.build_metadata(
            [SeqLayout(s.start_pos, len(s.token_ids), s.block_table) for s in seqs]
        )
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)

        sampling = [s for s in seqs if s.sample]
        if not sampling:
            return {}, {}
        ends = torch.cumsum(torch.tensor([len(s.token_ids) for s in seqs]), 0) - 1
        rows = ends[torch.tensor([s.sample for s in seqs])].to(self.device)
        logits = self.model.compute_logits(hidden[rows])
        batch = SamplingBatch(
            params=[s.params for s in sampling],
            generators=[self._generator(s.request_id, s.params.seed) for s in sampling],
            prompt_ids=[s.prompt_token_ids for s in sampling],
            output_ids=[s.output_token_ids for s in sampling],
            num_output_tokens=[s.start_pos + len(s.token_ids) - s.num_prompt_tokens for s in sampling],
        )
        result = self.sampler(logits, batch)
        ids = result.token_ids.tolist()
        sampled = {s.request_id: ids[i] for i, s in enumerate(sampling)}
        logprobs = {s.request_id: lp for s, lp in zip(sampling, result.logprobs) if lp is not None}
        return sampled, logprobs

    # ---- KV offload tiers ------------------------------------------------------------------
    def _transfer_kv(self, out: SchedulerOutput) -> None:
        """Save evicted blocks to the tiers, then load tier hits into their new blocks."""
        if out.kv_saves:
            data = self.read_blocks([b for b, _ in out.kv_saves])
            for (_, h), block in zip(out.kv_saves, data):
                self.offload.store(h, block)
        if out.kv_loads:
            self.write_blocks([b for b, _ in out.kv_loads], torch.stack([self.offload.load(h) for _, h in out.kv_loads]))
        self.offload.end_step()

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """KV of whole blocks, [n, layers, 2, block_size, kv_heads, head_dim] (a copy)."""
        idx = torch.tensor(blocks, device=self.device)
        return torch.stack([torch.stack((k[idx], v[idx]), dim=1) for k, v in self.kv_caches], dim=1)

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(blocks, device=self.device)
        data = data.to(self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k[idx] = data[:, layer, 0]
            v[idx] = data[:, layer, 1]

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[request_id] = g
        return g

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
