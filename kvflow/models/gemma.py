"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences, following HF
transformers' modeling_gemma2.py / modeling_gemma3.py step by step (Gemma 1, modeling_gemma.py:
the embeddings' scale, the (1 + w) norms and GeGLU only, in the Llama layer's places):

* embeddings scaled by sqrt(hidden_size), that factor rounded to the model dtype first;
* RMSNorm as x * (1 + w) in float32 (`OffsetRMSNorm`), with a norm after the attention and
  norms before and after the feed-forward: x + post_attn(attn(in(x))), then
  x + post_ffw(mlp(pre_ffw(x))) (the residual never goes through a norm);
* attention scaled by query_pre_attn_scalar ** -0.5; per layer a sliding window (Gemma 2: every
  other layer; Gemma 3: five local layers to one global) and, Gemma 2 only, soft-capped scores
  (tanh(s / cap) * cap), both passed to the attention backend on every call;
* Gemma 3: q/k norms per head before rotary, and the local layers' own rope (base 10k, unscaled)
  beside the global one (base 1M, with the config's scaling);
* GeGLU: gelu (tanh approximation) of the gate times up;
* the logits soft-capped too (final_logit_softcapping).

What the model reads of a config is `ModelConfig.gemma` (kvflow.config.model.GemmaConfig).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvflow.config import ModelConfig
from kvflow.distributed.parallel import TPGroup
from kvflow.layers.norm import OffsetRMSNorm
from kvflow.layers.rotary import apply_rotary_
from kvflow.models.llama import DecoderLayer, LlamaForCausalLM


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # HF's gelu_pytorch_tanh


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, attention, dtype, device)
        gemma = cfg.gemma
        self.scale = gemma.query_pre_attn_scalar**-0.5
        self.softcap = gemma.attn_logit_softcapping

        def norm(size: int) -> OffsetRMSNorm:
            return OffsetRMSNorm(size, cfg.rms_norm_eps, dtype, device)

        self.input_layernorm = norm(cfg.hidden_size)
        self.post_attention_layernorm = norm(cfg.hidden_size)
        self.pre_feedforward_layernorm = norm(cfg.hidden_size)
        self.post_feedforward_layernorm = norm(cfg.hidden_size)
        self.q_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.act = _gelu_tanh if gemma.hidden_act == "gelu_pytorch_tanh" else F.silu

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # (Kernels and norms called directly, as in DecoderLayer; no fused norm prologue: the
        # post-norms sit between the projections and the residual, where no kernel fuses them.)
        t = x.shape[0]
        qkv = self.qkv_proj.kernel(self.input_layernorm.forward(x))  # [T, q | k | v]
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(t, heads, self.head_dim)
        if self.q_norm is not None:
            normed = torch.cat(
                (self.q_norm.forward(qk[:, : self.num_heads]), self.k_norm.forward(qk[:, self.num_heads :])), dim=1
            )
            apply_rotary_(normed, cos, sin_signed, out=qk)
        else:
            self.apply_rotary(qk, cos, sin_signed)
        q = qk[:, : self.num_heads]
        kv = qkv[:, self.q_size :].view(t, 2, self.num_kv_heads, self.head_dim)
        attn = self.attention.forward(q, kv, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        x = x + self.post_attention_layernorm.forward(self.o_proj.kernel(attn))
        gate, up = self.gate_up_proj.kernel(self.pre_feedforward_layernorm.forward(x)).chunk(2, dim=-1)
        return x + self.post_feedforward_layernorm.forward(self.down_proj.kernel(self.act(gate) * up))


class Gemma1DecoderLayer(DecoderLayer):
    """Gemma (1)'s layer: the Llama layer with (1 + w) norms and GeGLU -- the attention half is the
    Llama layer's (its fused norm prologue multiplies by 1 + w), the feed-forward computed plainly."""

    def __init__(self, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, attention, dtype, device)
        self.scale = cfg.gemma.query_pre_attn_scalar**-0.5
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.act = _gelu_tanh if cfg.gemma.hidden_act == "gelu_pytorch_tanh" else F.silu

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.attend(x, cos, sin_signed, kv_cache, meta)
        gate, up = self.gate_up_proj.kernel(self.post_attention_layernorm.forward(x)).chunk(2, dim=-1)
        return self.down_proj.kernel(self.act(gate) * up, x)  # x + down_proj(...)


class GemmaForCausalLM(LlamaForCausalLM):
    """GemmaForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM (see the top of the file)."""

    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        if cfg.gemma is None:
            raise ValueError(f"{cfg.architecture} is not a Gemma model: it is LlamaForCausalLM's")
        super().__init__(cfg, attention, max_positions, dtype, device, tp)
        # HF: embedding * tensor(sqrt(hidden)).to(dtype), i.e. the factor rounded to the model dtype.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device=device)

    def _decoder_layer(
        self, index: int, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> DecoderLayer:
        if not cfg.gemma.post_norms:
            return Gemma1DecoderLayer(cfg, attention, dtype, device)
        return GemmaDecoderLayer(cfg, attention, dtype, device)

    def _final_norm(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        return OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor | None:
        logits = super().compute_logits(hidden, float32)
        cap = self.cfg.gemma.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # HF: logits / cap, tanh, * cap

    def apply_smoothing(self, act_amax: dict[str, torch.Tensor], alpha: float = 0.0) -> None:
        # SmoothQuant divides the norm weights that feed a projection; Gemma's norms scale by
        # (1 + w) and its post-norms sit after the projections, so that folding does not hold.
        raise ValueError(f"quantization='int8' (SmoothQuant) is not supported for {self.cfg.architecture}")
