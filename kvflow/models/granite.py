"""IBM Granite (HF `GraniteForCausalLM`): the Llama decoder with four scalars (`GraniteConfig`).

Two of them fold into weights at load, so Granite runs every Llama path (the native decode pass,
the int8 and bf16 kernels) unchanged: each sublayer's output is scaled by `residual_multiplier`
before its residual add, which is o_proj's and down_proj's weights scaled by it (the same product
up to float rounding; weights kept quantized, GGUF blocks or a checkpoint's packed format, through
their scales; a LoRA adapter's update to them is scaled alike: `adapter_rows`); the
softmax scale is `attention_multiplier` (each layer's `scale`). The other two are one multiply
each: the embeddings times `embedding_multiplier` (the table may be the tied lm_head, so it is
not folded), the logits divided by `logits_scaling`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.config import ModelConfig
from kvflow.models.llama import DecoderLayer, LlamaForCausalLM
from kvflow.quantization.gguf_blocks import BlockQuantized
from kvflow.quantization.packed_weights import STORED_TYPES

_RESIDUAL_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_RESIDUAL_MODULES = ("o_proj", "down_proj")  # (the HF modules of those weights, as LoRA adapters name them)


class GraniteForCausalLM(LlamaForCausalLM):
    def _decoder_layer(
        self, index: int, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> DecoderLayer:
        layer = super()._decoder_layer(index, cfg, attention, dtype, device)
        layer.scale = cfg.granite.attention_multiplier
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.cfg.granite.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor | None:
        logits = super().compute_logits(hidden, float32)
        return None if logits is None else logits / self.cfg.granite.logits_scaling

    def adapter_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        return b * self.cfg.granite.residual_multiplier if module in _RESIDUAL_MODULES else b

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._residual_scaled(weights))

    def _residual_scaled(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        factor = self.cfg.granite.residual_multiplier
        for name, tensor in weights:
            if name.endswith(_RESIDUAL_PROJECTIONS) and factor != 1.0:
                if isinstance(tensor, (BlockQuantized, *STORED_TYPES)):  # (quantized as stored: its scales)
                    tensor = tensor.scaled(factor)
                else:
                    tensor = (tensor.float() * factor).to(tensor.dtype)  # (the dtype the checkpoint stores)
            yield name, tensor
