"""q/k rows reordered at load for families whose HF code rotates features other than rotate-half's
pairs (i, i + head_dim / 2) over the whole head: interleaved pairs (2i, 2i + 1; GLM-4, ERNIE 4.5)
and partial rotary (Phi-4-mini, GLM-4). After `to_partial_rotary_rows` every attention path
(torch, native, the fused decode pass, Triton) rotates them with its usual tables
(kvflow.layers.rotary); q . k is the same sum over the features in another order."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from kvflow.config import ModelConfig
from kvflow.layers.rotary import to_partial_rotary_rows
from kvflow.quantization.gguf_blocks import BlockQuantized

_QK_ROWS = re.compile(r"(?:model\.)?layers\.\d+\.self_attn\.[qk]_proj\.(?:weight|bias)")


def qk_rows(cfg: ModelConfig, rows: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """A q or k projection's rows (weight or bias, or a LoRA update's B) in the rotary's order."""
    d = cfg.head_dim
    return to_partial_rotary_rows(rows, d, cfg.rope.rotary_dim(d), interleaved)


def with_qk_rows(
    cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], interleaved: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` (HF names) with every q_proj / k_proj weight and bias in the rotary's order: float
    tensors, or GGUF blocks (whole rows moved). Quantized HF checkpoints' packed rows are refused
    by the loader before this (kvflow.models.loader)."""
    for name, tensor in weights:
        if _QK_ROWS.fullmatch(name):
            if isinstance(tensor, BlockQuantized):
                tensor = tensor.with_rows(qk_rows(cfg, tensor.data, interleaved))
            elif type(tensor) is torch.Tensor:
                tensor = qk_rows(cfg, tensor, interleaved)
            else:
                raise ValueError(
                    f"{name}: kvflow reorders {cfg.architecture}'s q/k rows in float or GGUF-block weights only"
                )
        yield name, tensor


class InterleavedRotaryRows:
    """For a decoder class whose HF family rotates interleaved pairs (GLM-4, ERNIE 4.5, Cohere):
    q/k rows reordered at load, and a LoRA update's q/k rows alike. Put before the decoder class
    it extends (`class X(InterleavedRotaryRows, LlamaForCausalLM)`)."""

    cfg: ModelConfig

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(with_qk_rows(self.cfg, weights, interleaved=True))  # type: ignore[misc]

    def adapter_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        return qk_rows(self.cfg, b, interleaved=True) if module in ("q_proj", "k_proj") else b
