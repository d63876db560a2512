"""GLM-4 (HF `Glm4ForCausalLM`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): the Llama decoder with three
differences (HF transformers' modeling_glm4.py):

* a norm after each sublayer too, before its residual add: x + post_self_attn_layernorm(attn(
  input_layernorm(x))), then h + post_mlp_layernorm(mlp(post_attention_layernorm(h))) (the
  residual never goes through a norm);
* gate and up fused in the checkpoint (`mlp.gate_up_proj`, gate first), loaded as Phi-3's are;
* rotary on the first `partial_rotary_factor` (0.5) of each head, in interleaved pairs (features
  2i and 2i + 1 at frequency i): q's and k's rows are reordered per head at load
  (kvflow.models.qk_layout) so that kvflow's rotate-half, with cos 1 and sin 0 on the features
  that do not rotate, is that rotation on every attention path.

q/k/v carry biases (`attention_bias`), o_proj none. The layers run on the per-layer path (the
native decode pass runs the Llama layer, without the post-norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvflow.config import ModelConfig
from kvflow.layers.norm import RMSNorm
from kvflow.models.llama import DecoderLayer
from kvflow.models.phi3 import Phi3ForCausalLM
from kvflow.models.qk_layout import InterleavedRotaryRows


class Glm4DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, attention, dtype, device)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.attend(x, cos, sin_signed, kv_cache, meta)
        # (kernels called plainly: the post-norm sits between the projection and the residual)
        gate, up = self.gate_up_proj.kernel(self.post_attention_layernorm.forward(x)).chunk(2, dim=-1)
        return x + self.post_mlp_layernorm.forward(self.down_proj.kernel(F.silu(gate) * up))

    def attend(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.kernel(self.input_layernorm.forward(x))  # [T, q | k | v]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        self.apply_rotary(qk, cos, sin_signed)  # (q and k in the reordered layout: see the top)
        q = qk[:, : self.num_heads]
        kv = qkv[:, self.q_size :].view(t, 2, self.num_kv_heads, self.head_dim)
        attn = self.attention.forward(q, kv, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return x + self.post_self_attn_layernorm.forward(self.o_proj.kernel(attn))


class Glm4ForCausalLM(InterleavedRotaryRows, Phi3ForCausalLM):
    """GLM-4's layers; its fused gate_up_proj loaded as Phi-3's (see the top of the file)."""

    def _decoder_layer(
        self, index: int, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> DecoderLayer:
        return Glm4DecoderLayer(cfg, attention, dtype, device)

    def apply_smoothing(self, act_amax: dict[str, torch.Tensor], alpha: float = 0.0) -> None:
        raise ValueError(
            f"quantization='int8' (SmoothQuant) is not supported for {self.cfg.architecture} yet: run it in "
            "float32, bfloat16 or with --quantization int4"
        )
