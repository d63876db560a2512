"""Phi-3 (HF `Phi3ForCausalLM`): the Llama decoder, with q/k/v and gate/up already fused in the
checkpoint (`self_attn.qkv_proj`, `mlp.gate_up_proj`, in the row order kvflow fuses them itself:
q | k | v and gate | up). Its rope (LongRoPE: `su` / `longrope` scaling) is the rotary layer's
(kvflow.layers.rotary); its sliding window, if the config sets one, the attention backends'."""

from __future__ import annotations

import re

import torch

from kvflow.distributed.parallel import shard_weight
from kvflow.models.llama import LlamaForCausalLM
from kvflow.quantization.gguf_blocks import BlockQuantized

_FUSED_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)")


class Phi3ForCausalLM(LlamaForCausalLM):
    """The Llama decoder reading Phi-3's fused projections."""

    def _load_family_weight(self, name: str, tensor: torch.Tensor | BlockQuantized, loaded: set[str]) -> bool:
        """A fused `qkv_proj` / `gate_up_proj` weight: under tensor parallelism each part (q, k, v;
        gate, up) is cut to this rank's heads / FFN slice as the separate HF projections are, and
        the rank's slices fused again. A GGUF's block-quantized one (llama.cpp's `attn_qkv`, and
        its `ffn_up`, which holds gate and up) is kept in blocks on one rank."""
        m = _FUSED_KEY.fullmatch(name)
        if m is None:
            return False
        index, field = int(m.group(1)), m.group(2)
        size = self.tp.size
        target = "qkv_proj" if "qkv_proj" in name else "gate_up_proj"
        if isinstance(tensor, BlockQuantized):  # (a GGUF's blocks, as stored: kept for the block kernels)
            if size > 1:
                tensor = tensor.dequantize()  # (each rank's rows, cut from the float weight below)
            else:
                self._set_blocks(f"layers.{index}.{target}.{field}", [tensor])
                loaded.add(f"layers.{index}.{target}.{field}")
                return True
        if target == "qkv_proj":
            q, kv = self.cfg.num_heads * self.cfg.head_dim * size, self.cfg.num_kv_heads * self.cfg.head_dim * size
            if tensor.shape[0] != q + 2 * kv:
                raise ValueError(
                    f"weight {name!r} has {tensor.shape[0]} rows; the config's q/k/v heads make {q + 2 * kv}"
                )
            parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split((q, kv, kv), dim=0))
        else:
            inter = self.cfg.intermediate_size * size
            if tensor.shape[0] != 2 * inter:
                raise ValueError(f"weight {name!r} has {tensor.shape[0]} rows; 2 x intermediate_size is {2 * inter}")
            parts = zip(("gate_proj", "up_proj"), tensor.split((inter, inter), dim=0))
        local = torch.cat([shard_weight(proj, part, self.tp) for proj, part in parts], dim=0)
        key = f"layers.{index}.{target}.{field}"
        layer = self.layers[index] if index < len(self.layers) else None
        param = getattr(getattr(layer, target, None), field, None)
        self._copy({} if param is None else {key: param}, key, local)
        loaded.add(key)
        return True
