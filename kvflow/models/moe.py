"""The Mixture-of-Experts decoder: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

These families are the Llama decoder (kvflow.models.llama) with a routed feed-forward
(kvflow.layers.moe.SparseMoeBlock) in some or all layers; what differs between them is data in
`ModelConfig` (its `moe` and the q/k norm fields), not code here. A layer that does not route
(Qwen2/3-MoE's `decoder_sparse_step`, `mlp_only_layers`) is the dense `DecoderLayer` itself.

A GGUF's experts (kvflow.models.gguf_loader) arrive stacked, `experts.{gate,up,down}_proj`
[E, out, in]: float ones are copied into the stacked weights, quantized ones (kept as stored) become
each expert's block-quantized weights, run by the block kernels. On the CPU `prepare` gives every
expert its own linear kernels (kvflow.layers.moe.SparseMoeBlock.prepare).

The model records its routing when asked (`set_routing_stats`, `start_routing_capture`): tokens
per layer and expert and the load imbalance for the metrics, the experts of a step's rows for
expert traces (kvflow.layers.moe.RoutingRecorder); the model knows no requests, the runner reads
what it needs.

Under tensor parallelism (kvflow.distributed) the attention is split as the dense model's, every
rank keeps the whole router, and the experts are split inside as the dense MLP (each expert's gate
/ up rows and down columns; Qwen2-MoE's shared expert too) or, with expert parallelism, partitioned
whole over the ranks: each loads and keeps only its range. OLMoE's q/k norms over the whole
projections sum their squares over the ranks (one all-reduce per layer).

Decode-only steps run in the native decode pass (kvflow.models.decode_pass) where every routed
layer's experts are on native float kernels and the model is not sharded; the pass hands back the
experts each row chose, for the same telemetry (`_pass_routed`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvflow.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvflow.config import ModelConfig
from kvflow.distributed.parallel import TPGroup
from kvflow.kernels.norm import rms_norm_of
from kvflow.layers.linear import Linear
from kvflow.layers.linear_kernels import KernelPlan
from kvflow.layers.moe import MoeRoutingStats, RoutingRecorder, SparseMoeBlock
from kvflow.models.llama import DecoderLayer, LlamaForCausalLM
from kvflow.quantization.gguf_blocks import BlockQuantized

# What `set_routing_stats` takes (the engine's --moe-expert-metrics).
ROUTING_STATS_MODES = ("off", "per_layer", "per_expert")

# A MoE layer's feed-forward weights: Mixtral's hub checkpoints name the block `block_sparse_moe`,
# the others (and transformers' own modules) `mlp`.
_FFN_KEY = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)")
# One expert's projection, as hub checkpoints (and transformers 5's save_pretrained) store them:
# Mixtral's w1 / w3 / w2, the others' gate_proj / up_proj / down_proj.
_EXPERT_KEY = re.compile(r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# One projection of every expert, stacked [E, out, in] (GGUF's 3-D tensors; transformers' down_proj).
_STACKED_KEY = re.compile(r"experts\.(gate_proj|up_proj|down_proj)")
# OLMoE's q/k norms over the whole projections: under tensor parallelism each rank's slice.
_WHOLE_QK_NORM_KEY = re.compile(r"layers\.(\d+)\.self_attn\.([qk])_norm\.weight")


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose feed-forward routes each token to experts; its attention is the dense
    layer's (`attend`), so every attention backend and KV layout serves it unchanged."""

    def __init__(
        self, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device, tp: TPGroup
    ) -> None:
        super().__init__(cfg, attention, dtype, device, dense_mlp=False)
        self.tp = tp
        self.moe = SparseMoeBlock(cfg.hidden_size, cfg.moe, dtype, device, tp)

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

    def _whole_qk_norm(self, qkv: torch.Tensor, t: int, heads: int) -> torch.Tensor:
        """OLMoE's whole-projection q/k norms, as the dense layer's; under tensor parallelism a
        rank holds only its heads' slice of q and k, so the per-token sums of squares are summed
        over the ranks first (one all-reduce of [t, 2] for both norms)."""
        if self.tp.size == 1:
            return super()._whole_qk_norm(qkv, t, heads)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q, k = qkv[:, :q_end], qkv[:, q_end:k_end]
        squares = torch.stack([(f * f).sum(-1) for f in (q.float(), k.float())], dim=1)
        widths = squares.new_tensor([q_end * self.tp.size, (k_end - q_end) * self.tp.size])  # the whole q, k
        mean_sq = self.tp.all_reduce(squares) / widths
        normed = torch.cat(
            (
                rms_norm_of(q, mean_sq[:, :1], self.q_norm.weight, self.q_norm.eps),
                rms_norm_of(k, mean_sq[:, 1:], self.k_norm.weight, self.k_norm.eps),
            ),
            dim=1,
        ).view(t, heads, self.head_dim)
        if self.clip_qkv is not None:
            normed.clamp_(-self.clip_qkv, self.clip_qkv)
            qkv[:, k_end:].clamp_(-self.clip_qkv, self.clip_qkv)
        return normed


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
        super().__init__(cfg, attention, max_positions, dtype, device, tp)
        # Per MoE layer, the parts of its stacked weights read so far (see _load_family_weight).
        self._parts: dict[int, _LayerParts] = {}
        self.moe_blocks = [layer.moe for layer in self.layers if isinstance(layer, MoeDecoderLayer)]
        for slot, block in enumerate(self.moe_blocks):
            block.slot = slot
        self.moe_layers = [i for i, layer in enumerate(self.layers) if isinstance(layer, MoeDecoderLayer)]
        self._recorder = RoutingRecorder(self.moe_layers, cfg.moe.num_experts, cfg.moe.num_experts_per_tok, device)
        self._stats_mode = "off"

    def _decoder_layer(
        self, index: int, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> DecoderLayer:
        if cfg.moe.is_sparse(index):
            return MoeDecoderLayer(cfg, attention, dtype, device, self.tp)
        return DecoderLayer(cfg, attention, dtype, device)

    def projection_shapes(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Every projection on the linear kernels (attention, dense layers' MLPs, shared experts,
        experts, the logits) and, as one layer's, the attention's qkv and o and one expert's gate |
        up and down (what a routed layer's row runs in the decode pass; a GGUF's quantized experts
        are not timed: block kernels)."""
        layer = self.layers[0]
        per_layer = [tuple(lin.weight.shape) for lin in (layer.qkv_proj, layer.o_proj)]
        linears = [tuple(m.weight.shape) for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head]
        experts = [shape for b in self.moe_blocks if b.expert_blocks is None for shape in b.expert_shapes()]
        per_layer += experts[:2]
        return list(dict.fromkeys([*per_layer, *linears, *experts, self._logits_shape()])), per_layer

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(m.expert_bytes() for m in self.moe_blocks)

    def prepare(self, backend: str, plan: KernelPlan | None = None) -> None:
        for block in self.moe_blocks:  # experts onto their kernels (see SparseMoeBlock.prepare)
            block.prepare(backend, plan)
        super().prepare(backend, plan)  # (last: it builds the decode pass, which reads the experts' kernels)
        if self.native_decode is not None:
            self.native_decode.on_routed = self._pass_routed

    @property
    def has_block_weights(self) -> bool:
        return super().has_block_weights or any(b.expert_blocks is not None for b in self.moe_blocks)

    @property
    def experts_paths(self) -> list[str]:
        """What runs the layers' experts (`SparseMoeBlock.path`), each path once, in layer order."""
        return list(dict.fromkeys(b.path for b in self.moe_blocks))

    # ---- routing telemetry ---------------------------------------------------------------------
    def set_routing_stats(self, mode: str) -> None:
        """Count tokens per layer and expert and the load imbalance (`per_layer`, `per_expert`: what
        `routing_stats` reports), or nothing (`off`: no per-step work at all)."""
        if mode not in ROUTING_STATS_MODES:
            raise ValueError(f"routing stats mode must be one of {ROUTING_STATS_MODES}, got {mode!r}")
        self._stats_mode = mode
        self._recorder.counting = mode != "off"
        self._attach_recorder()

    def routing_stats(self) -> MoeRoutingStats | None:
        """The counts so far (None when off)."""
        if self._stats_mode == "off":
            return None
        return self._recorder.snapshot(per_expert=self._stats_mode == "per_expert")

    def start_routing_capture(self) -> None:
        """Keep the experts every row of the next forward pass chooses (see take_routing_capture)."""
        self._recorder.capture = [None] * len(self.moe_blocks)
        self._attach_recorder()

    def take_routing_capture(self) -> torch.Tensor | None:
        """The experts of every row of the forward pass since start_routing_capture: int64
        [MoE layers, rows, k] (layer i is decoder layer `moe_layers[i]`), or None if no pass
        completed; the capture ends either way."""
        captured, self._recorder.capture = self._recorder.capture, None
        self._attach_recorder()
        if captured is None or any(c is None for c in captured):
            return None
        return torch.stack(captured)

    def _pass_routed(self, experts: torch.Tensor) -> None:
        """A decode pass's routing, int64 [MoE layers, rows, k], to the recorder if it records."""
        rec = self._recorder
        if rec.counting or rec.capture is not None:
            rec.record_layers(experts)

    def _attach_recorder(self) -> None:
        """The layers see the recorder only while it records something (counting or a capture)."""
        rec = self._recorder
        active = rec if rec.counting or rec.capture is not None else None
        for block in self.moe_blocks:
            block.recorder = active

    # ---- weights ---------------------------------------------------------------------------
    def _load_family_weight(self, name: str, tensor: torch.Tensor | BlockQuantized, loaded: set[str]) -> bool:
        """A routed layer's feed-forward weight, in any of the layouts HF checkpoints use:

        * per expert: `experts.{e}.w1/w3/w2.weight` (Mixtral) or `experts.{e}.gate_proj/up_proj/
          down_proj.weight` (the others; what transformers 5's save_pretrained writes too);
        * stacked, as transformers 5 holds them in memory: `experts.gate_up_proj` [E, 2I, H] (gate
          rows then up rows) and `experts.down_proj` [E, H, I];
        * stacked per projection, as a GGUF stores them (kvflow.models.gguf_loader):
          `experts.gate_proj` / `experts.up_proj` [E, I, H] and `experts.down_proj` [E, H, I], in
          float or block-quantized (`BlockQuantized` of E x out rows: each expert's slice becomes
          its own block-quantized weight, when all three are);
        * the router `gate.weight` [E, H]; Qwen2-MoE's `shared_expert.{gate,up,down}_proj.weight`
          (float or blocks, on the linear kernels) and `shared_expert_gate.weight` [1, H].

        Under tensor parallelism each rank keeps its share (`_ExpertShard`): its slice of every
        expert's and of the shared expert's width, or (expert parallelism) its range of whole
        experts, the others' tensors dropped as they are read; the router and the shared gate
        whole. OLMoE's whole-projection q/k norm weights are sliced to the rank's heads here too.

        Dense layers' MLP weights are left to the Llama names."""
        if self.tp.size > 1 and isinstance(tensor, BlockQuantized):
            raise ValueError("quantized weights kept as stored cannot be sharded (tensor_parallel_size must be 1)")
        norm = _WHOLE_QK_NORM_KEY.fullmatch(name)
        if norm is not None and self.tp.size > 1 and not self.cfg.qk_norm_per_head:
            target = f"layers.{norm.group(1)}.{norm.group(2)}_norm.weight"
            _copy_into(name, self.get_parameter(target), tensor.chunk(self.tp.size)[self.tp.rank])
            loaded.add(target)
            return True
        m = _FFN_KEY.fullmatch(name)
        if m is None:
            return False
        index, key = int(m.group(1)), m.group(2)
        layer = self.layers[index] if index < len(self.layers) else None
        if not isinstance(layer, MoeDecoderLayer):
            return False
        block, parts = layer.moe, self._parts.setdefault(index, _LayerParts())
        if isinstance(tensor, BlockQuantized):
            if key in ("gate.weight", "shared_expert_gate.weight"):
                tensor = tensor.dequantize()  # the router and the shared gate run in float, as HF's
            elif _STACKED_KEY.fullmatch(key) is None and not key.startswith("shared_expert."):
                raise ValueError(
                    f"checkpoint has a block-quantized expert weight {name!r} in a layout kvflow cannot run"
                )
        prefix = f"layers.{index}.moe."
        shard = _ExpertShard(block, self.tp)
        experts, held, inter = block.num_experts, block.experts, block.inter
        expert = _EXPERT_KEY.fullmatch(key)
        if expert is not None:
            e, part = int(expert.group(1)), _EXPERT_PART[expert.group(2)]
            if e >= experts:
                raise ValueError(f"checkpoint has weights of expert {e} in {name!r}; the config has {experts}")
            if e in held:  # (an expert held by another rank: dropped)
                i = e - held.start
                dst = {"gate": block.w13[i, :inter], "up": block.w13[i, inter:], "down": block.w2[i]}[part]
                _copy_into(name, dst, shard.inner(part, tensor))
                (parts.down if part == "down" else parts.gate_up).add((e, part))
        elif key == "experts.gate_up_proj":
            gate, up = shard.experts(tensor).chunk(2, dim=1)
            _copy_into(name, block.w13, torch.cat((shard.inner("gate", gate), shard.inner("up", up)), dim=1))
            parts.gate_up.update((e, p) for e in held for p in ("gate", "up"))
        elif _STACKED_KEY.fullmatch(key) is not None:
            # One projection of every expert, [E, out, in] (a GGUF's ffn_{gate,up,down}_exps; the
            # down one is transformers' experts.down_proj as well): float ones are copied now,
            # block-quantized ones wait for the other two (`_resolve_expert_blocks`).
            part = _EXPERT_PART[key.removeprefix("experts.")]
            if isinstance(tensor, BlockQuantized):
                parts.blocks[part] = (name, tensor)
            else:
                dst = {"gate": block.w13[:, :inter], "up": block.w13[:, inter:], "down": block.w2}[part]
                _copy_into(name, dst, shard.inner(part, shard.experts(tensor)))
            (parts.down if part == "down" else parts.gate_up).update((e, part) for e in held)
            if parts.blocks and len(parts.gate_up) == 2 * len(held) and len(parts.down) == len(held):
                _resolve_expert_blocks(block, parts)
        elif key == "gate.weight":
            _copy_into(name, block.router, tensor)
            loaded.add(prefix + "router")
        elif key == "shared_expert_gate.weight" and block.shared_expert_gate is not None:
            _copy_into(name, block.shared_expert_gate, tensor.reshape(block.shared_expert_gate.shape))
            loaded.add(prefix + "shared_expert_gate")
        elif (
            key in ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight") and block.shared_down is not None
        ):
            # (fused into one projection, as the dense layers' gate and up; in blocks if both are)
            parts.shared[key] = tensor
            if len(parts.shared) == 2:
                gate, up = parts.shared["shared_expert.gate_proj.weight"], parts.shared["shared_expert.up_proj.weight"]
                if isinstance(gate, BlockQuantized) and isinstance(up, BlockQuantized):
                    block.shared_gate_up.load_blocks([gate, up])
                else:
                    rows, w = block.shared_down.in_features, block.shared_gate_up.weight
                    _copy_into(name, w[:rows], shard.shared("gate", _float(gate)))
                    _copy_into(name, w[rows:], shard.shared("up", _float(up)))
                loaded.add(prefix + "shared_gate_up.weight")
        elif key == "shared_expert.down_proj.weight" and block.shared_down is not None:
            if isinstance(tensor, BlockQuantized):
                block.shared_down.load_blocks([tensor])
            else:
                _copy_into(name, block.shared_down.weight, shard.shared("down", tensor))
            loaded.add(prefix + "shared_down.weight")
        else:
            raise ValueError(f"checkpoint has an unexpected weight {name!r} for a Mixture-of-Experts layer")
        if len(parts.gate_up) == 2 * len(held):
            loaded.add(prefix + "w13")
        if len(parts.down) == len(held):
            loaded.add(prefix + "w2")
        return True


@dataclass(frozen=True)
class _ExpertShard:
    """What of a MoE layer's checkpoint tensors one tensor-parallel rank keeps: with expert
    parallelism its range of whole experts (`experts`), else its slice of every expert's width
    (`inner`: gate / up rows, down columns, as the dense MLP's column- and row-parallel halves);
    the shared expert's width is split either way (`shared`)."""

    block: SparseMoeBlock
    tp: TPGroup

    def experts(self, stacked: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a stacked [E, ...] tensor."""
        held = self.block.experts
        # (a tensor of another count of experts stays whole: its copy names the wrong shape)
        return stacked[held.start : held.stop] if len(stacked) == self.block.num_experts else stacked

    def inner(self, part: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of one expert's (or stacked experts') `part` weight, [..., out, in]."""
        if self.block.expert_parallel:  # whole experts
            return t
        return self.shared(part, t)

    def shared(self, part: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a `part` ("gate", "up", "down") weight [..., out, in] split by width."""
        if self.tp.size == 1:
            return t
        return t.chunk(self.tp.size, dim=-1 if part == "down" else -2)[self.tp.rank]


class _LayerParts:
    """The parts of one MoE layer's stacked weights read so far: a stacked weight counts as loaded
    once every expert's parts have come (in whichever layout)."""

    def __init__(self) -> None:
        self.gate_up: set[tuple[int, str]] = set()  # (expert, "gate" | "up")
        self.down: set[tuple[int, str]] = set()  # (expert, "down")
        # block-quantized stacked projections waiting for the others: part -> (name, blocks)
        self.blocks: dict[str, tuple[str, BlockQuantized]] = {}
        self.shared: dict[str, torch.Tensor | BlockQuantized] = {}  # the shared expert's gate and up


def _resolve_expert_blocks(block: SparseMoeBlock, parts: _LayerParts) -> None:
    """Every expert projection of a layer has come, some in blocks: all three in blocks, the
    experts run on them (each expert's slice its own weight); otherwise the block ones are
    dequantized into the stacked float weights beside the float ones."""
    if len(parts.blocks) == 3:
        block.load_expert_blocks(*(parts.blocks[p][1] for p in ("gate", "up", "down")))
    else:
        inter = block.inter
        for part, (name, blocks) in parts.blocks.items():
            dst = {"gate": block.w13[:, :inter], "up": block.w13[:, inter:], "down": block.w2}[part]
            _copy_into(name, dst, blocks.dequantize().reshape(-1, *dst.shape[1:]))
    parts.blocks = {}


def _float(t: torch.Tensor | BlockQuantized) -> torch.Tensor:
    return t.dequantize() if isinstance(t, BlockQuantized) else t


def _copy_into(name: str, dst: torch.Tensor, tensor: torch.Tensor) -> None:
    if dst.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor)
