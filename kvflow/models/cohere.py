"""Cohere's Command R (HF `CohereForCausalLM`: Command R, Aya 23, Aya Expanse) and Command R7B / A
(`Cohere2ForCausalLM`): the Llama projections in Cohere's layer (HF transformers' modeling_cohere.py,
modeling_cohere2.py):

* one LayerNorm (mean-centred, no bias, float32) feeding attention and MLP side by side:
  x + attn(ln(x)) + mlp(ln(x));
* rotary over interleaved pairs of each head's features (2i, 2i + 1): q's and k's rows are
  reordered at load (kvflow.models.qk_layout), so kvflow's rotate-half is that rotation;
* Command R7B / A: sliding-window layers that rotate, and every fourth layer global, attending to
  the whole context without rotary (`ModelConfig.layer_windows`, `rope_layers`);
* the logits times `logit_scale`, the embeddings tied.

The layers run on the per-layer path (the native decode pass runs the Llama layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvflow.config import ModelConfig
from kvflow.layers.norm import LayerNorm
from kvflow.models.llama import DecoderLayer, LlamaForCausalLM
from kvflow.models.qk_layout import InterleavedRotaryRows


class CohereDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, attention, dtype, device)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        del self.post_attention_layernorm  # (one norm feeds both halves: the checkpoint holds no other)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.input_layernorm.forward(x)
        y = self.attend(h, cos, sin_signed, kv_cache, meta, residual=x)  # x + attn(h)
        gate, up = self.gate_up_proj.kernel(h).chunk(2, dim=-1)
        return self.down_proj.kernel(F.silu(gate) * up, y)  # (x + attn(h)) + mlp(h), HF's order

    def attend(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual + o_proj(attention(h)), h the normed input."""
        t = h.shape[0]
        qkv = self.qkv_proj.kernel(h)  # [T, q | k | v]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        self.apply_rotary(qk, cos, sin_signed)  # (a global layer of Command R7B: none)
        q = qk[:, : self.num_heads]
        kv = qkv[:, self.q_size :].view(t, 2, self.num_kv_heads, self.head_dim)
        attn = self.attention.forward(q, kv, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj.kernel(attn, residual)


class CohereForCausalLM(InterleavedRotaryRows, LlamaForCausalLM):
    """CohereForCausalLM and Cohere2ForCausalLM (see the top of the file)."""

    def _final_norm(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        return LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def _decoder_layer(
        self, index: int, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> DecoderLayer:
        return CohereDecoderLayer(cfg, attention, dtype, device)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor | None:
        logits = super().compute_logits(hidden, float32)
        return None if logits is None else logits * self.cfg.cohere.logit_scale

    def apply_smoothing(self, act_amax: dict[str, torch.Tensor], alpha: float = 0.0) -> None:
        # (SmoothQuant divides the norm before each projection; Cohere's one norm feeds q/k/v and
        # gate/up alike, which would need one smoothing for both)
        raise ValueError(f"quantization='int8' (SmoothQuant) is not supported for {self.cfg.architecture} yet")
