"""One decoder for the Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Pure tensors in, hidden states and logits out: the model knows nothing about requests. Q/K/V and
gate/up are fused into single projections at load time (fewer, larger matmuls per step). The
Mixture-of-Experts families (kvflow.models.moe) build on this decoder: the same attention, their
own feed-forward.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kvflow.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvflow.config import ModelConfig
from kvflow.distributed.parallel import TPGroup, shard_weight
from kvflow.kernels.cpu.qk_norm import available as qk_norm_available
from kvflow.kernels.cpu.qk_norm import qk_norm_
from kvflow.layers.linear import Linear, RowParallelKernel, StoredWeight
from kvflow.layers.linear_kernels import FUSED_PROLOGUE, KernelPlan, LinearKernel, make_linear_kernel
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding, RotaryFn, apply_rotary_, select_rotary
from kvflow.models.decode_pass import DecodePass, decode_pass
from kvflow.quantization.gguf_blocks import BlockQuantized
from kvflow.quantization.packed_weights import STORED_TYPES, fuse_stored
from kvflow.quantization.smoothquant import SMOOTH_ALPHA, smoothing_scales


class DecoderLayer(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        dense_mlp: bool = True,
    ) -> None:
        """`dense_mlp=False`: no gate_up / down projections (a subclass brings its own feed-forward)."""
        super().__init__()
        self.attention = attention
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # This layer's attention window (None: full attention) and attention-logit soft-cap, passed
        # to the backend on every call: set per layer by the model (`ModelConfig.window_of`).
        self.window: int | None = cfg.sliding_window
        self.softcap: float | None = None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, dtype, device)
        # q/k norms per head (Qwen3), or over the whole q and k projections (OLMoE).
        self.qk_norm_per_head = cfg.qk_norm_per_head
        q_norm_size, k_norm_size = (cfg.head_dim,) * 2 if cfg.qk_norm_per_head else (self.q_size, self.kv_size)
        self.q_norm = RMSNorm(q_norm_size, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.clip_qkv = cfg.clip_qkv
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.gate_up_proj = (
            Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, dtype, device) if dense_mlp else None
        )
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, device) if dense_mlp else None
        # Set by LlamaForCausalLM.prepare: kernels that apply the norms and the activation themselves
        # (int8, native fp32); rotary runs natively where it can (the same code as the decode pass).
        self.fused_prologue = False
        # Whether this layer rotates q and k (set by the model: SmolLM3's NoPE layers do not), and
        # whether by the model's table for sliding-window layers (`rotary_local`)
        self.rope = True
        self.local_rope = False
        self.apply_rotary: RotaryFn = apply_rotary_
        # Set by LlamaForCausalLM.prepare: q/k norms by the native function the decode pass runs
        # (kvflow.kernels.cpu.qk_norm; float32 on the CPU's native backends), then the native rotary.
        self.native_qk_norm = False

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.attend(x, cos, sin_signed, kv_cache, meta)
        if self.fused_prologue:
            gate_up = self.gate_up_proj.kernel(x, norm=self.post_attention_layernorm.kernel_args())
            return self.down_proj.kernel(gate_up, x, silu_mul=True)
        gate_up = self.gate_up_proj.kernel(self.post_attention_layernorm.forward(x))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj.kernel(F.silu(gate) * up, x)  # x + down_proj(...)

    @property
    def llama_attention(self) -> bool:
        """Whether this layer's attention is this class's `attend` (the one the native decode pass
        runs; a subclass may bring its own)."""
        return type(self).attend is DecoderLayer.attend

    def attend(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention half of the layer: x + o_proj(attention(input_layernorm(x)))."""
        # Kernels and norms are called directly, not through nn.Module.__call__: ~7 calls per layer
        # per step on the decode path, where per-call overhead is what a step costs (no hooks here).
        t = x.shape[0]
        if self.fused_prologue:
            qkv = self.qkv_proj.kernel(x, norm=self.input_layernorm.kernel_args())
        else:
            qkv = self.qkv_proj.kernel(self.input_layernorm.forward(x))  # [T, q | k | v]
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(t, heads, self.head_dim)
        if self.native_qk_norm:
            qk_norm_(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.qk_norm_per_head,
                self.q_norm.float_weight(),
                self.k_norm.float_weight(),
                self.q_norm.eps,
            )
            self.apply_rotary(qk, cos, sin_signed)
        elif self.q_norm is not None:
            if self.qk_norm_per_head:
                normed = torch.cat(
                    (self.q_norm.forward(qk[:, : self.num_heads]), self.k_norm.forward(qk[:, self.num_heads :])), dim=1
                )
            else:
                normed = self._whole_qk_norm(qkv, t, heads)
            if self.rope:
                apply_rotary_(normed, cos, sin_signed, out=qk)
            else:
                qk.copy_(normed)
        else:
            self.apply_rotary(qk, cos, sin_signed)  # q and k rotated together, in place in qkv
        q = qk[:, : self.num_heads]
        kv = qkv[:, self.q_size :].view(t, 2, self.num_kv_heads, self.head_dim)
        attn = self.attention.forward(q, kv, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj.kernel(attn, x)  # x + o_proj(attn)

    def _whole_qk_norm(self, qkv: torch.Tensor, t: int, heads: int) -> torch.Tensor:
        """OLMoE's q and k, each normed over its whole projection, then (clip_qkv) q, k and v -- the
        latter in place in qkv -- clamped: [t, heads + kv heads, head_dim], not yet rotated."""
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        normed = torch.cat((self.q_norm.forward(qkv[:, :q_end]), self.k_norm.forward(qkv[:, q_end:k_end])), dim=1).view(
            t, heads, self.head_dim
        )
        if self.clip_qkv is not None:
            normed.clamp_(-self.clip_qkv, self.clip_qkv)
            qkv[:, k_end:].clamp_(-self.clip_qkv, self.clip_qkv)
        return normed


class LlamaForCausalLM(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        """`cfg`: this rank's share of the architecture under tensor parallelism (`tp`)."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.attention = attention
        self.embed_tokens = torch.nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = torch.nn.ModuleList(
            self._decoder_layer(i, cfg, attention, dtype, device) for i in range(cfg.num_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.window = cfg.window_of(i)
            layer.rope = cfg.uses_rope(i)
            if not layer.rope:
                layer.apply_rotary = _no_rotary
        self.norm = self._final_norm(cfg, dtype, device)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, dtype, device)
        # The sliding-window layers' own table, where their rope differs (Gemma 3, OLMo 3)
        self.rotary_local = (
            None
            if cfg.rope_local is None
            else RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local, dtype, device)
        )
        for i, layer in enumerate(self.layers):
            layer.local_rope = self.rotary_local is not None and cfg.window_of(i) is not None
        self._row_parallel()  # from the start: a pass before `prepare` (int8 calibration) sums ranks too
        # The logits projection; set by `prepare` (tied models: a kernel over embed_tokens).
        self.logits_kernel: LinearKernel | None = None
        self.linear_backend = "dense"
        self.kernel_plan: KernelPlan | None = None
        self._vocab_widths: list[int] = []  # tensor parallel: each rank's slice of the vocabulary
        self._lm_head_smoothing: torch.Tensor | None = None  # tied + smoothed: columns of the lm_head copy
        # Native kernels (int8, fp32 / bf16, GGUF blocks) with the native attention: decode-only
        # steps run all layers in one call (kvflow.models.decode_pass; set by `prepare`).
        self.native_decode: DecodePass | None = None
        self.embed_blocks: BlockQuantized | None = None  # the embedding in its GGUF format, until `prepare`
        # A block kernel holding the embedding (GGUF blocks, or int4's logits): looked up through it.
        self._embed_kernel = None

    def _decoder_layer(
        self, index: int, cfg: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> DecoderLayer:
        """Decoder layer `index` (a family whose layers differ overrides this; called during __init__)."""
        return DecoderLayer(cfg, attention, dtype, device)

    def _final_norm(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """The norm after the last layer (a family with another norm overrides this)."""
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def prepare(self, backend: str, plan: KernelPlan | None = None) -> None:
        """Move every projection, and the lm_head, to the linear backend `backend` (after
        load_weights); `plan`: the autotune's choices for the ``auto`` backend."""
        if self.tp.size > 1 and self.logits_kernel is None:
            # Vocab-parallel logits: each rank projects onto its slice of the vocabulary; the
            # slices are gathered on the first rank (compute_logits). The embedding stays whole.
            slices = self._logits_weight().chunk(self.tp.size)
            self._vocab_widths = [w.shape[0] for w in slices]
            self.logits_kernel = make_linear_kernel(backend, slices[self.tp.rank].contiguous(), plan=plan)
            self.lm_head = None  # the full copy is not needed any more
        for m in self.modules():
            if isinstance(m, Linear):
                m.prepare(backend, plan, logits=m is self.lm_head)
        # q/k-normed layers: the native norms and rotary where they can run (the decode pass's), else
        # the norms in torch and apply_rotary_ on their output (see attend).
        native_qk = (
            self.cfg.qk_norm
            and backend in FUSED_PROLOGUE
            and self.cfg.clip_qkv is None
            and self.rotary.cos.device.type == "cpu"
            and self.rotary.cos.dtype == torch.float32
            and (self.cfg.qk_norm_per_head or self.tp.size == 1)  # (a whole-projection norm spans the ranks)
            and qk_norm_available()
        )
        rotary = select_rotary(
            self.rotary.cos.device,
            self.rotary.cos.dtype,
            self.cfg.head_dim,
            native=backend in FUSED_PROLOGUE and (not self.cfg.qk_norm or native_qk),
        )
        for layer in self.layers:
            layer.fused_prologue = backend in FUSED_PROLOGUE
            layer.apply_rotary = rotary if layer.rope else _no_rotary
            layer.native_qk_norm = native_qk and rotary is not apply_rotary_ and layer.llama_attention
        if self.embed_blocks is not None:
            # A block-quantized embedding lives in a block kernel (repacked, or read in place);
            # the lookup dequantizes the rows it needs from it, and a tied model's logits use it.
            self._embed_kernel, self.embed_blocks = make_linear_kernel(backend, self.embed_blocks), None
        if self.tp.size == 1:  # (under TP the logits kernel is this rank's vocabulary slice, above)
            if self.lm_head is not None:
                self.logits_kernel = self.lm_head.kernel
            elif self._embed_kernel is not None:
                self.logits_kernel = self._embed_kernel
            else:
                # Tied: `dense` reads embed_tokens itself; other backends keep their own copy (the
                # embedding lookup still needs the float rows, except under int4: below).
                w = self._logits_weight()
                self.logits_kernel = make_linear_kernel(backend, w, plan=plan, logits=True)
                if backend == "int4":  # the lookup reads the logits kernel's 8-bit rows: one copy
                    self._embed_kernel = self.logits_kernel
                    self.embed_tokens = torch.nn.Parameter(w.new_empty(0, self.cfg.hidden_size), requires_grad=False)
        self.linear_backend, self.kernel_plan = backend, plan
        self._row_parallel()  # the new kernels, wrapped again
        self.native_decode = decode_pass(self)

    def _logits_weight(self) -> torch.Tensor:
        """The float weight of the logits projection: the lm_head's, or for a tied model the
        embedding's, with int8's smoothing applied to that copy (the lookup keeps the original rows)."""
        if self.lm_head is not None:
            return self.lm_head.weight.data  # (smoothing, if any, is in it already)
        w = self.embed_tokens.data
        return w if self._lm_head_smoothing is None else w * self._lm_head_smoothing

    def _row_parallel(self) -> None:
        """Under tensor parallelism, o and down are row-parallel: partial sums over this rank's heads
        / FFN slice, one all-reduce each; the residual is added by the first rank only."""
        if self.tp.size == 1:
            return
        for layer in self.layers:
            for lin in (layer.o_proj, layer.down_proj):  # (a layer with its own feed-forward has no down_proj)
                if lin is not None and not isinstance(lin.kernel, RowParallelKernel):
                    lin.kernel = RowParallelKernel(lin.kernel, self.tp.all_reduce, self.tp.is_first)

    def projection_shapes(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """((out, in) of every projection and the logits, those of one decoder layer's qkv, o,
        gate_up and down): what the kernel autotune times (before `prepare`)."""
        layer = self.layers[0]
        per_layer = [
            tuple(lin.weight.shape) for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]
        return list(dict.fromkeys([*per_layer, self._logits_shape()])), per_layer

    def _logits_shape(self) -> tuple[int, int]:
        """(out, in) of the logits kernel: this rank's slice of the vocabulary under TP (as
        `prepare` cuts it)."""
        vocab = torch.empty(self.cfg.vocab_size, 0).chunk(self.tp.size)[self.tp.rank].shape[0]
        return vocab, self.cfg.hidden_size

    def linear_inputs(self) -> dict[str, torch.nn.Module]:
        """The modules whose inputs `apply_smoothing` takes statistics of: every Linear by its
        name, and "lm_head" -> the final norm (its output is the lm_head's input)."""
        mods: dict[str, torch.nn.Module] = {n: m for n, m in self.named_modules() if isinstance(m, Linear)}
        mods.pop("lm_head", None)
        return mods

    @torch.no_grad()
    def apply_smoothing(self, act_amax: dict[str, torch.Tensor], alpha: float = SMOOTH_ALPHA) -> None:
        """SmoothQuant, folded into the weights (see kvflow.quantization.smoothquant): call after
        load_weights and before prepare("int8"). `act_amax[name]` is the per-input-channel max |x|
        of the Linear `name` (as listed by linear_inputs) and of the lm_head under "lm_head". Exact
        in real arithmetic: the float model computes the same function."""
        cfg = self.cfg
        group = cfg.num_heads // cfg.num_kv_heads
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            # qkv and gate_up read RMSNorm outputs: divide the norm weight. (A layer without a dense
            # MLP, a Mixture-of-Experts layer, keeps its post-attention norm: the router reads that
            # norm's output too, and its experts are quantized without smoothing.)
            pairs = [(layer.input_layernorm, layer.qkv_proj)]
            if layer.gate_up_proj is not None:
                pairs.append((layer.post_attention_layernorm, layer.gate_up_proj))
            for norm, proj in pairs:
                sc = smoothing_scales(act_amax[p + _name(layer, proj)], proj.weight, alpha).to(proj.weight.dtype)
                norm.weight.div_(sc)
                proj.weight.mul_(sc)
            if layer.down_proj is not None:  # down reads silu(gate) * up: divide the up rows.
                down = layer.down_proj
                sc = smoothing_scales(act_amax[p + "down_proj"], down.weight, alpha).to(down.weight.dtype)
                layer.gate_up_proj.weight[cfg.intermediate_size :].div_(sc[:, None])
                down.weight.mul_(sc)
            # o reads the attention output, linear in v: divide the v rows, one scale per
            # (kv head, dim), shared by the query heads of a group.
            o = layer.o_proj
            sc = smoothing_scales(act_amax[p + "o_proj"], o.weight, alpha)
            sc = sc.view(cfg.num_kv_heads, group, cfg.head_dim).amax(1).to(o.weight.dtype)
            layer.qkv_proj.weight[q_size + kv_size :].div_(sc.reshape(-1, 1))
            if layer.qkv_proj.bias is not None:
                layer.qkv_proj.bias[q_size + kv_size :].div_(sc.reshape(-1))
            o.weight.mul_(sc[:, None, :].expand(-1, group, -1).reshape(-1))
        head = self.lm_head.weight if self.lm_head is not None else self.embed_tokens
        sc = smoothing_scales(act_amax["lm_head"], head, alpha).to(head.dtype)
        self.norm.weight.div_(sc)
        if self.lm_head is not None:
            self.lm_head.weight.mul_(sc)
        else:
            self._lm_head_smoothing = sc  # the embedding lookup keeps the original rows

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
        layer_meta: list[AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. `layer_meta`: per layer its
        KV group's metadata (a hybrid KV layout: each group has its own block tables); None: `meta`
        for every layer."""
        x = self.embed(input_ids)
        rope = cos, sin_signed = self.rotary.lookup(positions)
        local = rope if self.rotary_local is None else self.rotary_local.lookup(positions)
        fused = self.native_decode  # (None where layers rotate by two tables: decode_pass)
        group = (
            self.attention.decode_group(meta)
            if fused is not None and layer_meta is None and x.shape[0] <= fused.max_rows
            else None
        )
        if group is None or not fused(x, cos, sin_signed, kv_caches, meta.slot_mapping, group):
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                x = layer(x, *(local if layer.local_rope else rope), kv, meta if layer_meta is None else layer_meta[i])
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `input_ids` [T] -> [T, hidden] (a family may scale them)."""
        return (
            F.embedding(input_ids, self.embed_tokens)
            if self._embed_kernel is None
            else self._embed_kernel.rows(input_ids)
        )

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor | None:
        """Logits [rows, vocab], in float32 or (`float32=False`, one rank) as the lm_head gives them:
        a bf16 model's argmax needs no float copy. Under tensor parallelism every rank calls it with
        the same rows; the first rank gets the logits, the others None."""
        if self.logits_kernel is None:
            self.prepare(self.linear_backend, self.kernel_plan)
        logits = self.logits_kernel(hidden)
        if float32 or self.tp.size > 1:
            logits = logits.float()
        return self.tp.gather_first(logits, self._vocab_widths) if self.tp.size > 1 else logits

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named tensors; fuse q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if self._load_family_weight(name, tensor, loaded):
                continue
            if name.startswith("lm_head") and self.lm_head is None:
                continue  # tied: lm_head is embed_tokens
            if "rotary_emb" in name:
                continue
            name = name.replace("embed_tokens.weight", "embed_tokens")
            name = name.replace("self_attn.", "").replace("mlp.", "")
            parts = name.split(".")
            if self.tp.size > 1 and not isinstance(tensor, torch.Tensor):
                raise ValueError("quantized weights kept as stored cannot be sharded (tensor_parallel_size must be 1)")
            if len(parts) == 4:  # layers.{i}.{proj}.{weight|bias}: this rank's slice
                tensor = shard_weight(parts[2], tensor, self.tp)
            # layers.{i}.{proj}.{weight|bias}
            if len(parts) == 4 and parts[2] in fused:
                target, slot = fused[parts[2]]
                key = f"layers.{parts[1]}.{target}.{parts[3]}"
                group = pending.setdefault(key, {})
                group[slot] = tensor
                if len(group) == (3 if target == "qkv_proj" else 2):
                    parts = [group[i] for i in sorted(group)]
                    if all(isinstance(p, BlockQuantized) for p in parts):
                        self._set_blocks(key, parts)
                    elif any(isinstance(p, STORED_TYPES) for p in parts):  # a quantized HF checkpoint's
                        self.get_submodule(key.rpartition(".")[0]).load_blocks(fuse_stored(key, parts))
                    else:  # blocks beside float parts: the fused projection runs in float
                        parts = [p.dequantize() if isinstance(p, BlockQuantized) else p for p in parts]
                        self._copy(params, key, torch.cat(parts, dim=0))
                    loaded.add(key)
                    del pending[key]
                continue
            if isinstance(tensor, BlockQuantized):
                self._set_blocks(name, [tensor])
            elif isinstance(tensor, STORED_TYPES):
                self._set_blocks(name, tensor)
            else:
                self._copy(params, name, tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if pending or missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing | set(pending))[:8]}")

    def adapter_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B for HF module `module` (e.g. "o_proj", [out, r]) with its rows as
        `load_weights` left that module's weight rows: as they are here; a family that scales or
        reorders a weight at load (Granite, Phi-3's partial rotary) does the same to B (kvflow.lora)."""
        return b

    def _load_family_weight(self, name: str, tensor: torch.Tensor, loaded: set[str]) -> bool:
        """A weight that only a subclass's family has (`name` without the "model." prefix): load
        it, add the names of the parameters it completes to `loaded`, and return True; False
        leaves it to the names above."""
        return False

    def _set_blocks(self, name: str, parts: StoredWeight) -> None:
        """A weight kept as a quantized file stores it (a GGUF's blocks, a quantized HF checkpoint's
        weights): a Linear's parts, or the embedding (looked up row by row; the logits kernel of a
        tied model reads it too)."""
        if name == "embed_tokens":
            self.embed_blocks = parts[0]
            self.embed_tokens = torch.nn.Parameter(
                self.embed_tokens.data.new_empty(0, self.cfg.hidden_size), requires_grad=False
            )
            return
        module, _, field = name.rpartition(".")
        linear = self.get_submodule(module)
        if field != "weight" or not isinstance(linear, Linear):
            raise ValueError(f"checkpoint has an unexpected block-quantized tensor {name!r}")
        linear.load_blocks(parts)

    @property
    def has_block_weights(self) -> bool:
        """Whether load_weights took tensors in block formats (before `prepare`)."""
        return self.embed_blocks is not None or any(
            isinstance(m, Linear) and m.blocks is not None for m in self.modules()
        )

    def weight_bytes(self) -> int:
        """Bytes of every weight as the model holds it: the norms, the float embedding (empty when
        a block kernel holds it), each kernel's own copy once (a tied model's logits kernel may be
        the embedding's)."""
        kernels = {
            id(k): k
            for k in (
                *(m.kernel for m in self.modules() if isinstance(m, Linear)),
                self.logits_kernel,
                self._embed_kernel,
            )
            if k is not None
        }
        params = sum(
            p.numel() * p.element_size() for n, p in self.named_parameters() if "norm" in n or n == "embed_tokens"
        )
        return params + sum(k.nbytes for k in kernels.values())

    @staticmethod
    def _copy(params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r}")
        p = params[name]
        if p.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        p.data.copy_(tensor)


def _no_rotary(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """A NoPE layer's rotary: q and k stay as projected."""


def _name(layer: torch.nn.Module, child: torch.nn.Module) -> str:
    return next(n for n, m in layer.named_children() if m is child)
