"""ERNIE 4.5 dense (HF `Ernie4_5ForCausalLM`: ERNIE-4.5-0.3B): the Llama decoder whose rotary
turns interleaved pairs of each head's features (2i and 2i + 1 at frequency i, over the whole
head; HF transformers' modeling_ernie4_5.py). Its q and k rows are reordered per head at load
(kvflow.models.qk_layout), so every Llama path -- the native decode pass included -- runs it as
it is."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.qk_layout import qk_rows, with_qk_rows


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(with_qk_rows(self.cfg, weights, interleaved=True))

    def adapter_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        return qk_rows(self.cfg, b, interleaved=True) if module in ("q_proj", "k_proj") else b
