"""OLMo 2 (HF `Olmo2ForCausalLM`): the Llama decoder with its norms moved. No norm before attention
or MLP; RMSNorm on the attention output (`post_attention_layernorm`) and on the MLP output
(`post_feedforward_layernorm`), each before its residual add; q and k RMSNormed over their whole
projections (not per head), as OLMoE does (HF transformers' modeling_olmo2.py). OLMo 3
(`Olmo3ForCausalLM`, modeling_olmo3.py) is the same layer with sliding-window layers beside full
ones, each kind with its own rope (YaRN on the full layers only): `ModelConfig.layer_windows` and
`rope_local`, which the base model serves. EXAONE 4 (`Exaone4ForCausalLM`, modeling_exaone4.py)
is the same layer with q/k norms per head, and no rotary on its global layers (`rope_layers`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvflow.config import ModelConfig
from kvflow.distributed.parallel import TPGroup
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import apply_rotary_
from kvflow.models.llama import DecoderLayer, LlamaForCausalLM
from kvflow.quantization.smoothquant import SMOOTH_ALPHA


class Olmo2DecoderLayer(DecoderLayer):
    """x + post_attention_layernorm(attention(x)), then h + post_feedforward_layernorm(mlp(h))."""

    def __init__(self, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, attention, dtype, device)
        del self.input_layernorm  # (OLMo 2 has none: the checkpoint holds no such weight)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.attend(x, cos, sin_signed, kv_cache, meta)
        # (the plain path on every linear backend: the fused-prologue kernels norm their input,
        # and here the norm comes after the projection)
        gate, up = self.gate_up_proj.kernel(x).chunk(2, dim=-1)
        return x + self.post_feedforward_layernorm.forward(self.down_proj.kernel(F.silu(gate) * up))

    def attend(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.kernel(x)  # [T, q | k | v], from the un-normed hidden state
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(t, heads, self.head_dim)
        if self.qk_norm_per_head:  # (EXAONE 4)
            normed = torch.cat(
                (self.q_norm.forward(qk[:, : self.num_heads]), self.k_norm.forward(qk[:, self.num_heads :])), dim=1
            )
        else:
            normed = self._whole_qk_norm(qkv, t, heads)
        if self.rope:
            apply_rotary_(normed, cos, sin_signed, out=qk)
        else:  # (EXAONE 4's global layers: no rotary)
            qk.copy_(normed)
        kv = qkv[:, self.q_size :].view(t, 2, self.num_kv_heads, self.head_dim)
        q = qk[:, : self.num_heads]
        attn = self.attention.forward(q, kv, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return x + self.post_attention_layernorm.forward(self.o_proj.kernel(attn))


class Olmo2ForCausalLM(LlamaForCausalLM):
    """The Llama decoder with OLMo 2's layers, on one rank."""

    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        if tp is not None and tp.size > 1 and not cfg.qk_norm_per_head:
            # q/k norms over the whole projections would need every rank's heads (an all-reduce
            # of the sums of squares per layer); not there yet.
            raise ValueError(
                f"{cfg.architecture} runs on one rank so far (its q/k norms span all heads): set tensor_parallel_size=1"
            )
        super().__init__(cfg, attention, max_positions, dtype, device, tp)

    def _decoder_layer(
        self, index: int, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> DecoderLayer:
        return Olmo2DecoderLayer(cfg, attention, dtype, device)

    def apply_smoothing(self, act_amax: dict[str, torch.Tensor], alpha: float = SMOOTH_ALPHA) -> None:
        raise ValueError(
            f"int8 quantization does not reach {self.cfg.architecture} yet (SmoothQuant folds scales into "
            "the norm before each projection, and OLMo 2 has none there): run it in float32 or bfloat16"
        )
