"""One decoder for the Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Pure tensors in, hidden states and logits out: the model knows nothing about requests. Q/K/V and
gate/up are fused into single projections at load time (fewer, larger matmuls per step).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kvflow.config import ModelConfig
from kvflow.layers.attention import AttentionBackend, AttentionMetadata
from kvflow.layers.linear import Linear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.attention = attention
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, dtype, device)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        h = self.input_layernorm(x)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = self.attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        x = x + self.o_proj(attn.reshape(t, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionBackend, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = torch.nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, attention, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.lookup(positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens).float()
        return self.lm_head(hidden).float()

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named tensors; fuse q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("lm_head") and self.lm_head is None:
                continue  # tied: lm_head is embed_tokens
            if "rotary_emb" in name:
                continue
            name = name.replace("embed_tokens.weight", "embed_tokens")
            name = name.replace("self_attn.", "").replace("mlp.", "")
            parts = name.split(".")
            # layers.{i}.{proj}.{weight|bias}
            if len(parts) == 4 and parts[2] in fused:
                target, slot = fused[parts[2]]
                key = f"layers.{parts[1]}.{target}.{parts[3]}"
                group = pending.setdefault(key, {})
                group[slot] = tensor
                if len(group) == (3 if target == "qkv_proj" else 2):
                    self._copy(params, key, torch.cat([group[i] for i in sorted(group)], dim=0))
                    loaded.add(key)
                    del pending[key]
                continue
            self._copy(params, name, tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if pending or missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing | set(pending))[:8]}")

    @staticmethod
    def _copy(params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r}")
        p = params[name]
        if p.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        p.data.copy_(tensor)
