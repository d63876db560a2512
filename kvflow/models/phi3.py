"""Phi-3 (HF `Phi3ForCausalLM`): the Llama decoder, with q/k/v and gate/up already fused in the
checkpoint (`self_attn.qkv_proj`, `mlp.gate_up_proj`, in the row order kvflow fuses them itself:
q | k | v and gate | up). Its rope (LongRoPE: `su` / `longrope` scaling) is the rotary layer's
(kvflow.layers.rotary); its sliding window, if the config sets one, the attention backends'.

Phi-4-mini rotates the first 3/4 of each head only (`partial_rotary_factor`): its q and k rows are
reordered per head at load (kvflow.models.qk_layout) so that rotate-half over the whole head,
with cos 1 and sin 0 on the unrotated features, is HF's rotation; every attention path runs it
unchanged (and a LoRA adapter's q and k rows are reordered alike: `adapter_rows`)."""

from __future__ import annotations

import re

import torch

from kvflow.distributed.parallel import shard_weight
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.qk_layout import qk_rows
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
        if target == "qkv_proj":
            tensor = self._rotary_layout(name, tensor)
        if isinstance(tensor, BlockQuantized):  # (a GGUF's blocks, as stored: kept for the block kernels)
            if size > 1:
                tensor = tensor.dequantize()  # (each rank's rows, cut from the float weight below)
            else:
                self._set_blocks(f"layers.{index}.{target}.{field}", [tensor])
                loaded.add(f"layers.{index}.{target}.{field}")
                return True
        if target == "qkv_proj":
            parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split(self._qkv_rows(name, tensor), dim=0))
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

    def adapter_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        return qk_rows(self.cfg, b, interleaved=False) if module in ("q_proj", "k_proj") else b

    def _qkv_rows(self, name: str, tensor: torch.Tensor | BlockQuantized) -> tuple[int, int, int]:
        """The q, k and v rows of a whole (unsharded) fused qkv_proj; ValueError if it has others."""
        size, d = self.tp.size, self.cfg.head_dim
        q, kv = self.cfg.num_heads * d * size, self.cfg.num_kv_heads * d * size
        rows = (tensor.data if isinstance(tensor, BlockQuantized) else tensor).shape[0]
        if rows != q + 2 * kv:
            raise ValueError(f"weight {name!r} has {rows} rows; the config's q/k/v heads make {q + 2 * kv}")
        return q, kv, kv

    def _rotary_layout(self, name: str, tensor: torch.Tensor | BlockQuantized) -> torch.Tensor | BlockQuantized:
        """A fused qkv_proj weight or bias with its q and k rows in the partial rotary's order (as it
        is when every feature rotates)."""
        if self.cfg.rope.rotary_dim(self.cfg.head_dim) == self.cfg.head_dim:
            return tensor
        rows = tensor.data if isinstance(tensor, BlockQuantized) else tensor  # (blocks: whole rows move)
        q, k, v = rows.split(self._qkv_rows(name, tensor), dim=0)
        rows = torch.cat((qk_rows(self.cfg, q, False), qk_rows(self.cfg, k, False), v), dim=0)
        return tensor.with_rows(rows) if isinstance(tensor, BlockQuantized) else rows
