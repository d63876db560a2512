"""The Mixture-of-Experts decoder: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

These families are the Llama decoder (kvflow.models.llama) with a routed feed-forward
(kvflow.layers.moe.SparseMoeBlock) in some or all layers; what differs between them is data in
`ModelConfig` (its `moe` and the q/k norm fields), not code here. A layer that does not route
(Qwen2/3-MoE's `decoder_sparse_step`, `mlp_only_layers`) is the dense `DecoderLayer` itself.

Not there yet, refused where they would be asked for: tensor parallelism (kvflow.distributed),
int8 / int4 weights (`check_options`), GGUF MoE files (kvflow.models.gguf_loader), and the native
decode pass (kvflow.models.decode_pass: MoE models take the per-layer path).
"""

from __future__ import annotations

import re

import torch

from kvflow.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvflow.config import ModelConfig
from kvflow.distributed.parallel import TPGroup
from kvflow.layers.linear import Linear
from kvflow.layers.moe import SparseMoeBlock
from kvflow.models.llama import DecoderLayer, LlamaForCausalLM
from kvflow.quantization.gguf_blocks import BlockQuantized

# A MoE layer's feed-forward weights: Mixtral's hub checkpoints name the block `block_sparse_moe`,
# the others (and transformers' own modules) `mlp`.
_FFN_KEY = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)")
# One expert's projection, as hub checkpoints (and transformers 5's save_pretrained) store them:
# Mixtral's w1 / w3 / w2, the others' gate_proj / up_proj / down_proj.
_EXPERT_KEY = re.compile(r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def check_options(cfg: ModelConfig, quantization: str | None) -> None:
    """Refuse the engine options a MoE model cannot run with yet (before any weight is read)."""
    if cfg.moe is not None and quantization is not None:
        raise ValueError(
            f"quantization={quantization!r} does not reach Mixture-of-Experts models ({cfg.architecture}) "
            f"yet: unset quantization to run it in float (dtype float32 or bfloat16)"
        )


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose feed-forward routes each token to experts; its attention is the dense
    layer's (`attend`), so every attention backend and KV layout serves it unchanged."""

    def __init__(self, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, attention, dtype, device, dense_mlp=False)
        self.moe = SparseMoeBlock(cfg.hidden_size, cfg.moe, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.attend(x, cos, sin_signed, kv_cache, meta)
        # (called directly, as the dense layer calls its kernels: no nn.Module hooks per step)
        return self.moe.forward(self.post_attention_layernorm.forward(x), x)  # x + moe(norm(x))


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama decoder with routed layers where `cfg.moe.is_sparse(layer)`."""

    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} has no experts: it is LlamaForCausalLM's")
        if tp is not None and tp.size > 1:
            raise ValueError("Mixture-of-Experts models run on one rank so far (tensor_parallel_size=1)")
        super().__init__(cfg, attention, max_positions, dtype, device, tp)
        # Per MoE layer, the parts of its stacked weights read so far (see _load_family_weight).
        self._parts: dict[int, _LayerParts] = {}

    def _decoder_layer(
        self, index: int, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> DecoderLayer:
        if cfg.moe.is_sparse(index):
            return MoeDecoderLayer(cfg, attention, dtype, device)
        return DecoderLayer(cfg, attention, dtype, device)

    def projection_shapes(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Every projection on the linear kernels (attention, dense layers' MLPs, shared experts,
        the logits) and, as one layer's, only the attention's qkv and o: a routed layer has no
        fixed gate_up / down, and the decode pass does not take MoE models."""
        layer = self.layers[0]
        per_layer = [tuple(lin.weight.shape) for lin in (layer.qkv_proj, layer.o_proj)]
        linears = [tuple(m.weight.shape) for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head]
        return list(dict.fromkeys([*per_layer, *linears, (self.cfg.vocab_size, self.cfg.hidden_size)])), per_layer

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(m.expert_bytes() for m in self.modules() if isinstance(m, SparseMoeBlock))

    # ---- weights ---------------------------------------------------------------------------
    def _load_family_weight(self, name: str, tensor: torch.Tensor, loaded: set[str]) -> bool:
        """A routed layer's feed-forward weight, in any of the layouts HF checkpoints use:

        * per expert: `experts.{e}.w1/w3/w2.weight` (Mixtral) or `experts.{e}.gate_proj/up_proj/
          down_proj.weight` (the others; what transformers 5's save_pretrained writes too);
        * stacked, as transformers 5 holds them in memory: `experts.gate_up_proj` [E, 2I, H] (gate
          rows then up rows) and `experts.down_proj` [E, H, I];
        * the router `gate.weight` [E, H]; Qwen2-MoE's `shared_expert.{gate,up,down}_proj.weight`
          and `shared_expert_gate.weight` [1, H].

        Dense layers' MLP weights are left to the Llama names."""
        m = _FFN_KEY.fullmatch(name)
        if m is None:
            return False
        index, key = int(m.group(1)), m.group(2)
        layer = self.layers[index] if index < len(self.layers) else None
        if not isinstance(layer, MoeDecoderLayer):
            return False
        if isinstance(tensor, BlockQuantized):
            raise ValueError(f"checkpoint has a block-quantized expert weight {name!r}; MoE weights load in float")
        block, parts = layer.moe, self._parts.setdefault(index, _LayerParts())
        prefix = f"layers.{index}.moe."
        experts, inter = block.w13.shape[0], block.w2.shape[2]
        expert = _EXPERT_KEY.fullmatch(key)
        if expert is not None:
            e, part = int(expert.group(1)), _EXPERT_PART[expert.group(2)]
            if e >= experts:
                raise ValueError(f"checkpoint has weights of expert {e} in {name!r}; the config has {experts}")
            dst = {"gate": block.w13[e, :inter], "up": block.w13[e, inter:], "down": block.w2[e]}[part]
            _copy_into(name, dst, tensor)
            (parts.down if part == "down" else parts.gate_up).add((e, part))
        elif key == "experts.gate_up_proj":
            _copy_into(name, block.w13, tensor)
            parts.gate_up.update((e, p) for e in range(experts) for p in ("gate", "up"))
        elif key == "experts.down_proj":
            _copy_into(name, block.w2, tensor)
            parts.down.update((e, "down") for e in range(experts))
        elif key == "gate.weight":
            _copy_into(name, block.router, tensor)
            loaded.add(prefix + "router")
        elif key == "shared_expert_gate.weight" and block.shared_expert_gate is not None:
            _copy_into(name, block.shared_expert_gate, tensor)
            loaded.add(prefix + "shared_expert_gate")
        elif (
            key in ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight") and block.shared_down is not None
        ):
            # (fused into one projection, as the dense layers' gate and up)
            rows, w = block.shared_down.in_features, block.shared_gate_up.weight
            _copy_into(name, w[:rows] if key.startswith("shared_expert.gate") else w[rows:], tensor)
            parts.shared.add(key)
            if len(parts.shared) == 2:
                loaded.add(prefix + "shared_gate_up.weight")
        elif key == "shared_expert.down_proj.weight" and block.shared_down is not None:
            _copy_into(name, block.shared_down.weight, tensor)
            loaded.add(prefix + "shared_down.weight")
        else:
            raise ValueError(f"checkpoint has an unexpected weight {name!r} for a Mixture-of-Experts layer")
        if len(parts.gate_up) == 2 * experts:
            loaded.add(prefix + "w13")
        if len(parts.down) == experts:
            loaded.add(prefix + "w2")
        return True


class _LayerParts:
    """The parts of one MoE layer's stacked weights read so far: a stacked weight counts as loaded
    once every expert's parts have come (in whichever layout)."""

    def __init__(self) -> None:
        self.gate_up: set[tuple[int, str]] = set()  # (expert, "gate" | "up")
        self.down: set[tuple[int, str]] = set()  # (expert, "down")
        self.shared: set[str] = set()  # the shared expert's gate and up weights


def _copy_into(name: str, dst: torch.Tensor, tensor: torch.Tensor) -> None:
    if dst.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor)
