"""Load a llama-architecture GGUF checkpoint -- a dense llama, or one of llama.cpp's Mixture-of-Experts
architectures (`llama` with experts: Mixtral; `qwen2moe`, `qwen3moe`, `olmoe`) -- without going
through transformers.

`load_gguf(path)` returns what the engine needs to build a model: a config dict shaped like a
Hugging Face `config.json` (`LlamaForCausalLM`, or the MoE family's), the weights under Hugging
Face names as float32 tensors, and a fast tokenizer rebuilt from the GGUF's tokenizer metadata.
The result equals what `transformers` loads from the same file (where it reads the file: not its
MoE experts' widths), but comes several times faster (no model instantiation, vectorised
dequantisation in torch, a cheaper metadata parse). With `keep_blocks` the quantized
tensors stay in their block formats instead (`BlockQuantized`, run by the native block kernels:
`--gguf-weights native`).

What a GGUF does differently from a Hugging Face checkpoint:

* llama.cpp's converter permutes the rows of the Q and K projections of its `llama` architecture
  (Mixtral included) so that each rotary pair is interleaved (rows 2i, 2i+1) instead of split in
  halves (rows i, i + head_dim/2). `_unpermute_rows` undoes it per head, so the weights work with
  the usual "rotate half" rotary embedding. (`qwen2`, `qwen3`, `qwen2moe`, `qwen3moe`, `olmoe` and
  the other dense families use llama.cpp's NEOX rotary, which is HF's: their rows are stored as HF
  holds them.)
* llama.cpp's converter stores Gemma's (`gemma2`, `gemma3`) norm weights as 1 + w, its norm being
  plain x * w; the 1 is taken off here, so they are HF's w for the (1 + w) norm of kvflow.models.gemma.
* A MoE layer's experts are three 3-D tensors, `ffn_{gate,up,down}_exps` of GGUF dims
  [inputs, outputs, experts] (numpy / torch [experts, outputs, inputs]: expert e's weight is the
  e-th slice), beside the router `ffn_gate_inp` [experts, hidden] and Qwen2-MoE's shared expert
  (`ffn_{gate,up,down}_shexp`, and `ffn_gate_inp_shexp`: the [hidden] row of its sigmoid gate).
  They arrive as stacked tensors `mlp.experts.{gate,up,down}_proj` [E, out, in] (kvflow.models.moe
  takes that layout); with `keep_blocks` a quantized one stays in its blocks, E x out rows of
  them, each expert's rows a `BlockQuantized` of its own in the model.
* The tokenizer is stored as metadata (tokens, merges, token types, special ids); it is rebuilt here
  with the `tokenizers` library the way transformers' GGUF converter does for byte-level BPE
  ("gpt2") vocabularies, wrapped by transformers once, and served as a `FastTokenizer` (same ids,
  text and chat prompts, without importing transformers).

The metadata's result (config, tokenizer state, where each tensor lies) is kept in the kvflow cache
(`gguf_cache`), so a second load of the same file parses nothing and never imports transformers.
"""

from __future__ import annotations

import logging
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvflow.models import gguf_cache
from kvflow.models.tokenizer import FastTokenizer, state_of
from kvflow.quantization.gguf_blocks import FORMATS, BlockQuantized

logger = logging.getLogger(__name__)

T = GGMLQuantizationType
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (T.F32, T.F16, T.BF16, *(T[name] for name in FORMATS))
_SUPPORTED_NAMES = ", ".join(t.name for t in SUPPORTED_TYPES)


@dataclass
class GGUFCheckpoint:
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor | BlockQuantized]
    tokenizer: FastTokenizer | None
    name: str


# --------------------------------------------------------------------------------------------------
# Reading: gguf.GGUFReader, made bounds-checked and faster
# --------------------------------------------------------------------------------------------------


class _CorruptGGUF(ValueError):
    pass


_SCALAR_DTYPES = {int(k): np.dtype(v) for k, v in GGUFReader.gguf_scalar_to_np.items()}
_SCALAR_SIZES = {k: v.itemsize for k, v in _SCALAR_DTYPES.items()}
_ARRAY, _STRING = int(GGUFValueType.ARRAY), int(GGUFValueType.STRING)
_U64 = struct.Struct("=Q")


class _Reader(GGUFReader):
    """`GGUFReader` with three changes, none of which alter what it returns:

    * every read is bounds-checked, so a truncated or corrupt file raises `_CorruptGGUF` instead of
      an IndexError/reshape error deep in numpy -- or looping for ages over a garbage array length;
    * the file mapping is held as a plain ndarray rather than an `np.memmap`, whose Python-level
      `__array_finalize__` on every one of the ~200k small slices made parsing take 3 s;
    * arrays are cheaper: a numeric array is one part instead of one per element, and the elements
      of string arrays (vocabulary, merges) are memoryview slices; `ReaderField.contents()` returns
      the same lists from them (only `contents(i)` on a numeric array would differ; not used here).
    """

    @property
    def data(self) -> np.ndarray:
        return self._buf

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buf = value.view(np.ndarray) if isinstance(value, np.memmap) else value
        self._mv = memoryview(self._buf)

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        dtype = np.dtype(dtype)
        end = offset + dtype.itemsize * count
        if offset < 0 or count < 0 or end > self._buf.shape[0]:
            raise _CorruptGGUF(
                f"needs bytes {offset}..{end} but the file has only {self._buf.shape[0]} (truncated or corrupt)"
            )
        arr = self._buf[offset:end].view(dtype)
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != _ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count = int(raw_itype[0]), int(alen[0])
        remaining = self._buf.shape[0] - (orig_offs + 12)
        min_size = 8 if itype == _STRING else _SCALAR_SIZES.get(itype, 12)
        if count * min_size > remaining:
            raise _CorruptGGUF(f"an array of {count} items at offset {orig_offs} runs past the end of the file")
        if count == 0 or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        if itype in _SCALAR_DTYPES:
            # One part for the whole array (the base class makes one per element); `contents()` of a
            # numeric array flattens its parts, so the list it returns is the same.
            values = self._get(orig_offs + 12, _SCALAR_DTYPES[itype], count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, GGUFValueType(itype)]
        if itype != _STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        parts: list[Any] = [raw_itype, alen]
        idxs: list[int] = []
        mv, n, offs = self._mv, self._buf.shape[0], orig_offs + 12
        for _ in range(count):
            if offs + 8 > n:
                raise _CorruptGGUF(f"string array at offset {orig_offs} runs past the end of the file")
            (slen,) = _U64.unpack_from(mv, offs)
            end = offs + 8 + slen
            if end > n:
                raise _CorruptGGUF(f"string array at offset {orig_offs} runs past the end of the file")
            parts.append(mv[offs : offs + 8])
            parts.append(mv[offs + 8 : end])
            idxs.append(len(parts) - 1)
            offs = end
        return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY, GGUFValueType.STRING]

    def _build_tensors(self, start_offs, fields):
        known = {int(t) for t in GGMLQuantizationType}
        size = self._buf.shape[0]
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            type_id = int(raw_dtype[0])
            if type_id not in known:
                raise _CorruptGGUF(f"tensor {name!r} has unknown GGML type id {type_id}")
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
            dims_list = [int(d) for d in dims]
            if not dims_list or dims_list[0] % block:
                raise _CorruptGGUF(
                    f"tensor {name!r} ({qtype.name}) has shape {dims_list}, not a whole number of blocks"
                )
            n_bytes = math.prod(dims_list) // block * type_size
            begin = start_offs + int(offset_tensor[0])
            if begin + n_bytes > size:
                raise _CorruptGGUF(
                    f"data of tensor {name!r} ({qtype.name}, {n_bytes} bytes at offset {begin}) lies beyond the "
                    f"end of the file ({size} bytes): truncated or corrupt"
                )
        super()._build_tensors(start_offs, fields)


def _open(path: str) -> _Reader:
    try:
        # 'c' (copy-on-write) gives writable arrays, so torch.from_numpy works without a copy or a warning.
        return _Reader(path, mode="c")
    except FileNotFoundError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, struct.error) as e:
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from e


# --------------------------------------------------------------------------------------------------
# Dequantisation (torch, vectorised; same arithmetic as gguf.quants so results are bit-identical)
# --------------------------------------------------------------------------------------------------


def _dequantize(data: np.ndarray, qtype: GGMLQuantizationType, hf_shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.from_numpy(data)
    if qtype == T.F32:
        out = raw.clone()
    elif qtype == T.F16:
        out = raw.float()
    elif qtype == T.BF16:
        out = raw.reshape(-1).view(torch.bfloat16).float()
    else:
        out = _blocks(data, qtype, hf_shape).dequantize()
    return out.reshape(hf_shape)


def _blocks(data: np.ndarray, qtype: GGMLQuantizationType, hf_shape: tuple[int, ...]) -> BlockQuantized:
    """A quantized tensor's bytes as rows of blocks (copied out of the file's mapping)."""
    rows = math.prod(hf_shape[:-1])  # (a 3-D expert tensor: every expert's output channels, in order)
    return BlockQuantized(FORMATS[qtype.name], torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(rows, -1))


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (0, 1, 2, 3, ...) of the GGUF hold HF
    rows (0, d/2, 1, d/2+1, ...); i.e. GGUF = HF.reshape(h, 2, d/2, ...).swapaxes(1, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


# --------------------------------------------------------------------------------------------------
# Config and tensor names
# --------------------------------------------------------------------------------------------------

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # q, k and v fused (Phi-3)
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    # norms on a sublayer's output, before its residual add (OLMo 2)
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture-of-Experts layers: the router, the stacked experts, Qwen2-MoE's shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The 3-D expert tensors, [experts, out, in] as torch sees them: stacked names without ".weight"
# (as transformers holds its own stacked experts), which kvflow.models.moe reads.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_OLD_EXPERT_RE = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")  # one 2-D tensor per expert
_IGNORED_TENSORS = {"rope_freqs.weight"}

# llama.cpp's Mixture-of-Experts architectures: the HF family each is, and whether llama.cpp
# renormalises the top-k routing weights to sum to 1 (the `norm_w` its graph passes for the
# architecture; a file's `{arch}.expert_weights_norm`, where written, says it instead). `llama`
# with experts is Mixtral (always renormalised, as HF's Mixtral).
_MOE_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("MixtralForCausalLM", "mixtral", True),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", True),
    "olmoe": ("OlmoeForCausalLM", "olmoe", False),
}
# llama.cpp's dense architectures besides `llama`: the HF family each is (NEOX rotary, as HF's: Q/K
# rows as stored; but `granite`, which llama.cpp converts as llama: _PERMUTED_QK).
_DENSE_ARCHS: dict[str, tuple[str, str]] = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "glm4": ("Glm4ForCausalLM", "glm4"),  # (llama.cpp rotates its interleaved pairs as HF: rows as stored)
    # SmolLM3: converted as llama (Q/K rows permuted); llama.cpp fixes its NoPE layers at every
    # fourth (il + 1) % 4 == 0, HF's default (`no_rope_layer_interval` 4), which the config keeps.
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
    # Seed-OSS: its pre-MLP norm is llama.cpp's post_attention_norm (HF's post_attention_layernorm)
    "seed_oss": ("SeedOssForCausalLM", "seed_oss"),
    # Cohere (rows as stored: llama.cpp rotates their interleaved pairs as HF does)
    "command-r": ("CohereForCausalLM", "cohere"),
    "cohere2": ("Cohere2ForCausalLM", "cohere2"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "granite": ("GraniteForCausalLM", "granite"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# Gemma's norms are x * (1 + w) (HF's weights hold w); llama.cpp's converter stores 1 + w (its norm
# is plain x * w), so the loader takes the 1 back off every norm weight of these architectures.
_GEMMA_ARCHS = ("gemma2", "gemma3")
_GEMMA_FAMILIES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# llama.cpp's layer counts of Gemma's 27B models, whose attention scale it takes from
# hidden / heads (the checkpoints' query_pre_attn_scalar) instead of head_dim (llama-model.cpp).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Phi-3's LongRoPE factors, which llama.cpp stores as tensors: read into the config, not the weights.
_PHI3_ROPE_FACTORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
SUPPORTED_ARCHS = (*_MOE_ARCHS, *_DENSE_ARCHS)  # (`llama` dense or with experts)
# Families whose Q/K rows llama.cpp permuted (its LLaMA rotary); the others use NEOX's, which is HF's.
_PERMUTED_QK = ("LlamaForCausalLM", "MixtralForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM")
# YaRN's parameters: the HF rope key each GGUF key holds (llama.cpp's converter writes them).
_YARN_KEYS = {
    "yarn_attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}
# Granite's scalars: the HF config key each GGUF key holds (llama.cpp's names).
_GRANITE_KEYS = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}
# Families that size an expert by `moe_intermediate_size` (their dense layers by `intermediate_size`).
_QWEN_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def _build_config(
    path: str,
    meta: dict[str, Any],
    dims: dict[str, list[int]],
    arch: str,
    rope_factors: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """The HF-style config of the file's model; `dims`: each tensor's GGUF dims (innermost first);
    `rope_factors`: Phi-3's LongRoPE `short_factor` / `long_factor`, read from its tensors."""

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{name}"
        if full not in meta:
            if required:
                raise ValueError(f"{path}: GGUF metadata lacks {full!r}, needed to build the model config")
            return default
        return meta[full]

    tensor_names = set(dims)
    moe = _is_moe(meta, tensor_names, arch)
    hidden = int(key("embedding_length", required=True))
    n_head = int(key("attention.head_count", required=True))
    n_kv = key("attention.head_count_kv", n_head)
    if isinstance(n_kv, list):  # per-layer list: only a uniform one describes a plain llama
        if len(set(n_kv)) != 1:
            raise ValueError(f"{path}: per-layer KV head counts {n_kv} are not supported")
        n_kv = n_kv[0]
    rotary = key("rope.dimension_count")
    if arch in ("phi3", "glm4"):  # (Phi-4-mini rotates 96 of its 128 features, GLM-4 half: n_rot is not the head size)
        head_dim = key("attention.key_length") or hidden // n_head
    else:
        head_dim = key("attention.key_length") or rotary or hidden // n_head
    vocab = key("vocab_size")  # else: the embedding's row count (filled in by the caller), else the token count
    if vocab is None and "token_embd.weight" not in tensor_names and "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    rope_theta = float(key("rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rotary is not None and int(rotary) != head_dim:  # (refused by the config but for phi3)
        rope["partial_rotary_factor"] = int(rotary) / head_dim
        if int(head_dim * rope["partial_rotary_factor"]) != int(rotary):
            raise ValueError(
                f"{path}: rope.dimension_count {rotary} of head size {head_dim} is not a factor kvflow can hold"
            )
    scaling_type = key("rope.scaling.type")
    factor = key("rope.scaling.factor")
    if scaling_type is None and key("rope.scale_linear") is not None:  # older files
        scaling_type, factor = "linear", key("rope.scale_linear")
    scaling: dict[str, Any] | None = None
    if scaling_type not in (None, "none") and factor not in (None, 0, 1, 1.0):
        scaling = {"rope_type": scaling_type, "factor": float(factor)}
        original = key("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        if scaling_type == "yarn":  # (the converter's keys for HF's YaRN parameters, where written)
            for name, hf_name in _YARN_KEYS.items():
                if key(f"rope.scaling.{name}") is not None:
                    scaling[hf_name] = float(key(f"rope.scaling.{name}"))
        rope.update(scaling)
    if "rope_freqs.weight" in tensor_names:
        logger.warning(
            "%s has a rope_freqs tensor (Llama-3-style frequency scaling); it is ignored, as transformers "
            "does, so positions far beyond the original context may degrade",
            path,
        )
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=not moe),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(n_kv),
        "head_dim": int(head_dim),
        "vocab_size": int(vocab) if vocab is not None else None,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": any(n.endswith(".attn_q.bias") for n in tensor_names),
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if cfg["vocab_size"] is None and "token_embd.weight" not in tensor_names:
        raise ValueError(f"{path}: cannot tell the vocabulary size (no vocab_size, tokens or embedding)")
    if moe:
        _add_experts(path, cfg, key, dims, arch)
    else:
        cfg["intermediate_size"] = int(cfg["intermediate_size"])
    if arch in _DENSE_ARCHS:
        cfg["architectures"], cfg["model_type"] = [_DENSE_ARCHS[arch][0]], _DENSE_ARCHS[arch][1]
    if arch == "phi3":
        _add_phi3(path, cfg, key, rope_factors or {})
    if arch in _GEMMA_ARCHS:
        _add_gemma(path, cfg, key, arch)
    if arch == "granite":
        cfg.update({hf: float(key(name)) for name, hf in _GRANITE_KEYS.items() if key(name) is not None})
    if arch == "olmo2" and key("attention.sliding_window"):
        _add_olmo3(cfg, key)
    if arch in ("command-r", "cohere2"):
        _add_cohere(cfg, key, arch)
    return cfg


def _add_cohere(cfg: dict[str, Any], key, arch: str) -> None:
    """Command R's keys (`logit_scale`, the LayerNorm's `attention.layer_norm_epsilon`) and Command
    R7B's (`cohere2`) window: its sliding layers by `attention.sliding_window_pattern`, else every
    fourth layer global, as llama.cpp reads them."""
    cfg["logit_scale"] = float(key("logit_scale", 1.0))
    cfg["layer_norm_eps"] = float(key("attention.layer_norm_epsilon", 1e-5))
    if arch == "cohere2":
        cfg["sliding_window"] = int(key("attention.sliding_window", required=True))
        cfg["layer_types"] = _layer_types(cfg["num_hidden_layers"], key("attention.sliding_window_pattern"))


def _add_olmo3(cfg: dict[str, Any], key) -> None:
    """OLMo 3, which llama.cpp converts as `olmo2` with a sliding window: its layer types from
    `attention.sliding_window_pattern` (default: every fourth layer global), the full layers' rope
    with the file's scaling (YaRN), the sliding layers' plain (base `rope.freq_base_swa`, else the
    same base), as llama.cpp's olmo2 graph rotates them."""
    full = cfg.pop("rope_parameters")
    cfg.pop("rope_scaling", None)
    local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", full["rope_theta"]))}
    cfg.update(
        architectures=["Olmo3ForCausalLM"],
        model_type="olmo3",
        sliding_window=int(key("attention.sliding_window")),
        layer_types=_layer_types(cfg["num_hidden_layers"], key("attention.sliding_window_pattern")),
        rope_parameters={"full_attention": full, "sliding_attention": local},
    )


def _layer_types(n: int, pattern: Any) -> list[str]:
    """HF's `layer_types` from llama.cpp's `attention.sliding_window_pattern`: a bool per layer (true:
    sliding), or an int (every pattern-th layer global); absent, 4 (its default for these models)."""
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern or 4) != 0 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _add_gemma(path: str, cfg: dict[str, Any], key, arch: str) -> None:
    """Gemma 2 / 3's keys, as llama.cpp's converter writes them and its loader reads them
    (llama-model.cpp): GeGLU; the sliding window (Gemma 2: 4096 unless written; Gemma 3: required)
    on every other layer from layer 0 (Gemma 2) or on five layers of each six (Gemma 3: llama.cpp's
    fixed pattern); Gemma 2's soft-caps (llama.cpp's defaults 50 / 30 unless written), Gemma 3's
    final cap if written; Gemma 3's local layers at rope base 10000, unscaled (fixed in llama.cpp),
    its global ones at the file's `rope.freq_base` and scaling. No GGUF key holds
    query_pre_attn_scalar: llama.cpp takes head_dim (`attention.key_length`), and hidden / heads for
    the 27B models (46 layers for Gemma 2, 62 for Gemma 3), as their HF configs say."""
    head_dim = cfg["head_dim"]
    value_length = key("attention.value_length")
    if value_length is not None and int(value_length) != head_dim:
        raise ValueError(
            f"{path}: {arch}.attention.value_length {value_length} differs from key_length {head_dim}; "
            "kvflow's Gemma needs one head size"
        )
    n_layers, hidden, n_head = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    if n_layers == _GEMMA_27B_LAYERS[arch]:
        if hidden % n_head:
            raise ValueError(
                f"{path}: cannot tell query_pre_attn_scalar: a {n_layers}-layer {arch} takes hidden / heads as "
                f"llama.cpp does, but {hidden} is not a multiple of {n_head} heads"
            )
        scalar = hidden // n_head
    else:
        scalar = head_dim
    window = key("attention.sliding_window", 4096 if arch == "gemma2" else None, required=arch == "gemma3")
    if int(window) < 1:
        raise ValueError(f"{path}: {arch}.attention.sliding_window must be a positive number of tokens, got {window}")
    cfg.update(
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(scalar),
        sliding_window=int(window),
    )
    if arch == "gemma2":
        cfg["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0))
        cfg["final_logit_softcapping"] = float(key("final_logit_softcapping", 30.0))
        return
    final_cap = key("final_logit_softcapping")
    cfg["final_logit_softcapping"] = float(final_cap) if final_cap else None
    cfg["attn_logit_softcapping"] = None
    cfg["sliding_window_pattern"] = 6
    cfg["rope_parameters"] = {
        "full_attention": cfg["rope_parameters"],
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    cfg.pop("rope_scaling", None)


def _add_phi3(path: str, cfg: dict[str, Any], key, rope_factors: dict[str, list[float]]) -> None:
    """Phi-3's keys, as llama.cpp's converter writes them: the sliding window (0: none) and, with
    its `rope_factors_short` / `rope_factors_long` tensors, LongRoPE over the original context with
    the converter's attention factor."""
    window = key("attention.sliding_window")
    cfg["sliding_window"] = int(window) if window else None
    if not rope_factors:
        return
    if set(rope_factors) != {"short_factor", "long_factor"}:
        raise ValueError(f"{path}: a phi3 GGUF needs both rope_factors_short and rope_factors_long, or neither")
    original = key("rope.scaling.original_context_length", required=True)
    rope = {
        **cfg["rope_parameters"],
        "rope_type": "longrope",
        **rope_factors,
        "original_max_position_embeddings": int(original),
    }
    attn_factor = key("rope.scaling.attn_factor")
    if attn_factor is not None:
        rope["attention_factor"] = float(attn_factor)
    cfg["rope_parameters"] = rope
    cfg["original_max_position_embeddings"] = int(original)
    cfg.pop("rope_scaling", None)


# GLM-4's norms by llama.cpp's names: its ffn_norm is HF's post_attention_layernorm (before the MLP),
# its post_attention_norm HF's post_self_attn_layernorm (on the attention output), its post_ffw_norm
# HF's post_mlp_layernorm.
_GLM4_NORMS = {
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
}


def _glm4_norm_name(gguf_name: str, hf: str) -> str:
    """`hf` (the generic mapping of GGUF tensor `gguf_name`) as GLM-4 names that norm."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    return f"model.layers.{m.group(1)}.{_GLM4_NORMS[m.group(2)]}.weight" if m and m.group(2) in _GLM4_NORMS else hf


def _is_moe(meta: dict[str, Any], tensor_names: set[str], arch: str) -> bool:
    """A Mixture-of-Experts file: an expert count, expert tensors, or a MoE-only architecture."""
    return bool(
        meta.get(f"{arch}.expert_count")
        or arch in ("qwen2moe", "qwen3moe", "olmoe")
        or any("_exps." in n or ".ffn_gate_inp." in n for n in tensor_names)
    )


def _add_experts(path: str, cfg: dict[str, Any], key, dims: dict[str, list[int]], arch: str) -> None:
    """The MoE family's keys, as its HF config names them (kvflow.config.model reads them): the
    experts' count, top-k and width, the renormalisation, the shared expert, the dense layers.

    A layer routes when it has a router (`ffn_gate_inp`); the others are dense MLP layers
    (`mlp_only_layers`, Qwen2/3-MoE only: Mixtral and OLMoE route in every layer). Widths come from
    the metadata, else from the tensors' own shapes."""
    hf_arch, model_type, norm_default = _MOE_ARCHS[arch]
    layers = cfg["num_hidden_layers"]
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in dims]
    if not sparse:
        raise ValueError(f"{path}: a Mixture-of-Experts GGUF ({arch}) without any router (ffn_gate_inp) tensor")
    dense = [i for i in range(layers) if i not in sparse]
    if dense and hf_arch not in _QWEN_MOE:
        raise ValueError(f"{path}: layers {dense[:5]} have no router (ffn_gate_inp); {hf_arch} routes in every layer")
    experts, top_k = key("expert_count"), key("expert_used_count", required=True)
    gate = dims.get(f"blk.{sparse[0]}.ffn_gate_exps.weight")  # [hidden, width, experts]
    if experts is None:
        if gate is None or len(gate) != 3:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.expert_count")
        experts = gate[2]
    width = key("expert_feed_forward_length")
    if width is None:
        width = gate[1] if gate is not None and len(gate) == 3 else cfg["intermediate_size"]
    if width is None:
        raise ValueError(f"{path}: cannot tell the experts' width (no {arch}.expert_feed_forward_length)")
    norm = key("expert_weights_norm")
    cfg.update(
        architectures=[hf_arch],
        model_type=model_type,
        num_experts=int(experts),
        num_experts_per_tok=int(top_k),
        norm_topk_prob=bool(norm_default if norm is None else norm),
    )
    if hf_arch in _QWEN_MOE:
        cfg["moe_intermediate_size"] = int(width)
        cfg["intermediate_size"] = int(cfg["intermediate_size"] if cfg["intermediate_size"] is not None else width)
        cfg["mlp_only_layers"] = dense
        cfg["decoder_sparse_step"] = 1
    else:
        cfg["intermediate_size"] = int(width)
    if hf_arch == "Qwen2MoeForCausalLM":
        cfg["qkv_bias"] = cfg["attention_bias"]
        shared = key("expert_shared_feed_forward_length")
        shared_gate = dims.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight")
        if shared is None and shared_gate is not None:
            shared = shared_gate[1]
        cfg["shared_expert_intermediate_size"] = int(shared or 0) if shared_gate is not None else 0
    if hf_arch == "OlmoeForCausalLM":
        clamp = key("attention.clamp_kqv")
        cfg["clip_qkv"] = None if clamp is None else float(clamp)


def _hf_name(gguf_name: str, n_layers: int) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or int(m.group(1)) >= n_layers:
        return None
    layer, part, kind = m.groups()
    if part in _EXPERT_TENSORS:
        return f"model.layers.{layer}.mlp.experts.{_EXPERT_TENSORS[part]}" if kind == "weight" else None
    if part not in _LAYER_TENSORS or (kind == "bias" and part not in ("attn_q", "attn_k", "attn_v")):
        return None
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def _expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    arch = cfg["architectures"][0]
    attention = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
    }
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):  # q/k norms per head
        attention.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    elif arch == "OlmoeForCausalLM":  # q/k norms over the whole projections
        attention.update({"self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,)})
    elif arch in ("CohereForCausalLM", "Cohere2ForCausalLM"):  # one norm feeding both sublayers
        del attention["post_attention_layernorm.weight"]
    elif arch == "Glm4ForCausalLM":  # a norm after each sublayer too
        attention.update({"post_self_attn_layernorm.weight": (h,), "post_mlp_layernorm.weight": (h,)})
    elif arch == "Phi3ForCausalLM":  # q/k/v fused as stored
        for part in ("q", "k", "v"):
            del attention[f"self_attn.{part}_proj.weight"]
        attention["self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
    elif arch in _GEMMA_FAMILIES:  # a norm before and after each sublayer; Gemma 3: per-head q/k norms
        attention.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
        if arch == "Gemma3ForCausalLM":
            attention.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    elif arch in (
        "Olmo2ForCausalLM",
        "Olmo3ForCausalLM",
    ):  # no input norm; whole-projection q/k norms; a norm on each output
        del attention["input_layernorm.weight"]
        attention.update(
            {
                "self_attn.q_norm.weight": (q,),
                "self_attn.k_norm.weight": (kv,),
                "post_feedforward_layernorm.weight": (h,),
            }
        )
    dense = {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    if arch in ("Phi3ForCausalLM", "Glm4ForCausalLM"):  # gate and up fused as stored (llama.cpp's ffn_up holds both)
        dense = {"mlp.gate_up_proj.weight": (2 * f, h), "mlp.down_proj.weight": (h, f)}
    routed = dense
    if "num_experts" in cfg:
        e, w = cfg["num_experts"], cfg.get("moe_intermediate_size", f)
        routed = {
            "mlp.gate.weight": (e, h),
            "mlp.experts.gate_proj": (e, w, h),
            "mlp.experts.up_proj": (e, w, h),
            "mlp.experts.down_proj": (e, h, w),
        }
        s = cfg.get("shared_expert_intermediate_size", 0)
        if s:
            routed.update(
                {
                    "mlp.shared_expert.gate_proj.weight": (s, h),
                    "mlp.shared_expert.up_proj.weight": (s, h),
                    "mlp.shared_expert.down_proj.weight": (h, s),
                    "mlp.shared_expert_gate.weight": (1, h),
                }
            )
    dense_layers = set(cfg.get("mlp_only_layers", ())) if "num_experts" in cfg else set(range(cfg["num_hidden_layers"]))
    shapes = {
        f"model.layers.{i}.{k}": v
        for i in range(cfg["num_hidden_layers"])
        for k, v in {**attention, **(dense if i in dense_layers else routed)}.items()
    }
    shapes["model.norm.weight"] = (h,)
    shapes["model.embed_tokens.weight"] = (cfg["vocab_size"], h)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    if cfg["attention_bias"]:
        for i in range(cfg["num_hidden_layers"]):
            shapes[f"model.layers.{i}.self_attn.q_proj.bias"] = (q,)
            shapes[f"model.layers.{i}.self_attn.k_proj.bias"] = (kv,)
            shapes[f"model.layers.{i}.self_attn.v_proj.bias"] = (kv,)
    return shapes


def _same_shape(stored: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """`stored` is `expected`, up to leading 1s: llama.cpp stores Qwen2-MoE's shared-expert gate
    [1, hidden] as its [hidden] row (older converters squeezed it)."""
    return stored == expected or (
        math.prod(stored) == math.prod(expected) and expected[0] == 1 and stored == expected[1:]
    )


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_CHARS = _byte_alphabet()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())

# Split regexes for the `tokenizer.ggml.pre` values whose merges were learned on a non-GPT-2 split
# (transformers applies the same ones); anything else uses GPT-2's own regex inside ByteLevel.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values that split off every digit before GPT-2's split (Cohere's Command R).
_DIGITS_FIRST = ("command-r",)
_PRE_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
            "chatglm-bpe",
            "glm4",
            "glm5",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _O200K_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4


def _build_tokenizer(path: str, meta: dict[str, Any]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer type {kind!r} is not supported; only byte-level BPE ('gpt2') GGUF tokenizers are"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ValueError(f"{path}: the GGUF has no tokenizer vocabulary or merges (tokenizer.ggml.tokens/merges)")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []

    def spell(token: str) -> str:
        # Every ordinary token is already written in the byte alphabet; respell any that is not.
        if set(token) <= _BYTE_ALPHABET:
            return token
        return "".join(_BYTE_CHARS[b] for b in token.encode("utf-8"))

    vocab = {spell(t): i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"{path}: malformed BPE merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    try:
        backend = Tokenizer(
            models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        )
    except Exception as e:  # tokenizers raises plain Exception for merges outside the vocab
        raise ValueError(f"{path}: inconsistent tokenizer vocabulary/merges: {e}") from e
    pre = meta.get("tokenizer.ggml.pre")
    split = _PRE_SPLITS.get(pre)
    if pre in _DIGITS_FIRST:  # (each digit alone, then GPT-2's split: llama.cpp's two regexes)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) become special added tokens so text never splits them; a
    # "control" token outside the byte alphabet is a mislabel and is left alone. User-defined tokens
    # are matched whole too, but are not special.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty == _CONTROL and set(t) <= _BYTE_ALPHABET
    ]
    if control:
        backend.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types)
        if ty == _USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens(user)

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    kwargs: dict[str, Any] = {
        name: token(key)
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    kwargs["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    kwargs["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = meta.get("tokenizer.chat_template")
    if template:
        kwargs["chat_template"] = template
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def load_gguf(path: str | os.PathLike, with_tokenizer: bool = True, keep_blocks: bool = False) -> GGUFCheckpoint:
    """Load a llama GGUF: HF-style config, float32 weights under HF names, and its tokenizer
    (None without `with_tokenizer`: a tensor-parallel worker needs only its weights).
    `keep_blocks`: quantized 2-D and 3-D tensors as `BlockQuantized` (their bytes as stored, one row
    of blocks per output channel: a 3-D expert tensor's E x out rows), not float32.
    What the metadata gives (config, tokenizer, tensor places) comes from the kvflow cache when this
    file was loaded before (`gguf_cache`); the weights are always read from the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    index = gguf_cache.read(path)
    if index is None or (with_tokenizer and index.tokenizer is None):
        index = _index(path, with_tokenizer)
        gguf_cache.write(path, index)
    tokenizer = FastTokenizer.from_state(index.tokenizer) if with_tokenizer and index.tokenizer else None
    # 'c' (copy-on-write) gives writable arrays, so torch.from_numpy works without a copy or a warning;
    # a plain ndarray view, as in _Reader, keeps np.memmap's per-slice overhead out.
    buf = np.memmap(path, dtype=np.uint8, mode="c").view(np.ndarray)
    cfg = index.hf_config
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    permuted = cfg["architectures"][0] in _PERMUTED_QK
    offset_norms = cfg["architectures"][0] in _GEMMA_FAMILIES  # stored as 1 + w: see _GEMMA_ARCHS
    expected = _expected_shapes(cfg)
    tensors: dict[str, torch.Tensor | BlockQuantized] = {}
    # The ops here are memory-bound and small; torch's intra-op thread pool gains nothing on them and,
    # on a machine whose cores are busy with other processes, made them many times slower (figures:
    # docs/benchmarks/results/2026-11-29-xeon-avx512.md).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for place in index.tensors:
            hf, qtype = place.hf_name, T[place.qtype]
            dtype = np.dtype(place.dtype)
            data = buf[place.offset : place.offset + dtype.itemsize * math.prod(place.shape)].view(dtype)
            data = data.reshape(place.shape)
            shape = expected[hf]
            try:
                quantized = place.qtype in FORMATS and len(shape) >= 2
                w = _blocks(data, qtype, shape) if keep_blocks and quantized else _dequantize(data, qtype, shape)
            except (RuntimeError, ValueError) as e:
                raise ValueError(f"{path}: cannot decode tensor {hf!r} ({place.qtype}): {e}") from e
            rows = w.data if isinstance(w, BlockQuantized) else w  # the permutation moves whole rows
            if permuted and ".q_proj." in hf:
                rows = _unpermute_rows(rows, n_head)
            elif permuted and ".k_proj." in hf:
                rows = _unpermute_rows(rows, n_kv)
            w = w.with_rows(rows) if isinstance(w, BlockQuantized) else rows
            if offset_norms and hf.endswith("norm.weight"):  # (1-D: always float here)
                w = w - 1.0
            tensors[hf] = w
    finally:
        torch.set_num_threads(threads)
    return GGUFCheckpoint(hf_config=cfg, tensors=tensors, tokenizer=tokenizer, name=index.name)


def _index(path: str, with_tokenizer: bool) -> gguf_cache.GGUFIndex:
    """Parse and check the file's metadata: config, tensor places and (with_tokenizer) the tokenizer."""
    reader = _open(path)
    if reader.byte_order != "I":
        raise ValueError(f"{path}: GGUF file has the opposite byte order of this machine; not supported")
    try:
        meta = {name: field.contents() for name, field in reader.fields.items()}
    except (UnicodeDecodeError, ValueError, IndexError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: corrupt GGUF metadata: {e}") from e
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)} "
            "(llama dense or with experts, qwen2, qwen3, the Mixture-of-Experts qwen2moe, qwen3moe and olmoe, "
            "olmo2, phi3, glm4, granite, smollm3, seed_oss, command-r, cohere2, gemma2 and gemma3)"
        )

    by_name = {t.name: t for t in reader.tensors}
    old_experts = next((n for n in by_name if _OLD_EXPERT_RE.fullmatch(n)), None)
    if old_experts is not None:
        raise ValueError(
            f"{path}: tensor {old_experts!r} is one expert of llama.cpp's old per-expert layout; kvflow reads "
            "the 3-D ffn_{gate,up,down}_exps tensors llama.cpp has written since 2024: convert the model again"
        )
    rope_factors = (
        {
            _PHI3_ROPE_FACTORS[n]: [float(x) for x in t.data.reshape(-1)]
            for n, t in by_name.items()
            if n in _PHI3_ROPE_FACTORS
        }
        if arch == "phi3"
        else None
    )
    cfg = _build_config(
        path, meta, {t.name: [int(d) for d in t.shape] for t in reader.tensors}, arch, rope_factors=rope_factors
    )
    if cfg["vocab_size"] is None:
        cfg["vocab_size"] = int(by_name["token_embd.weight"].shape[-1])  # GGUF dims are [hidden, vocab]

    # Map names and check types and shapes before doing any work.
    expected = _expected_shapes(cfg)
    places: list[gguf_cache.TensorPlace] = []
    for t in reader.tensors:
        if t.name in _IGNORED_TENSORS or (arch == "phi3" and t.name in _PHI3_ROPE_FACTORS):
            continue
        hf = _hf_name(t.name, cfg["num_hidden_layers"])
        if arch in ("phi3", "glm4") and hf is not None:  # (their ffn_up is gate and up, fused)
            hf = hf.replace(".mlp.up_proj.", ".mlp.gate_up_proj.")
        if arch == "glm4" and hf is not None:
            hf = _glm4_norm_name(t.name, hf)
        if arch in _GEMMA_ARCHS and hf is not None and t.name.endswith(".ffn_norm.weight"):
            # Gemma's ffn_norm is the norm before the feed-forward; post_attention_norm is HF's
            # post_attention_layernorm (on the attention output)
            hf = hf.replace(".post_attention_layernorm.", ".pre_feedforward_layernorm.")
        if hf is None or hf not in expected:
            raise ValueError(
                f"{path}: unexpected tensor {t.name!r} for a {cfg['architectures'][0]} model "
                f"(from GGUF architecture {arch!r})"
            )
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which kvflow cannot dequantize; "
                f"supported types: {_SUPPORTED_NAMES}"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if not _same_shape(shape, expected[hf]):
            raise ValueError(
                f"{path}: tensor {t.name!r} has shape {list(shape)}, expected {list(expected[hf])} "
                f"for {hf} from the GGUF metadata"
            )
        places.append(
            gguf_cache.TensorPlace(
                hf, t.tensor_type.name, int(t.data_offset), t.data.dtype.str, tuple(int(d) for d in t.data.shape)
            )
        )
    missing = sorted(set(expected) - {p.hf_name for p in places})
    if missing:
        raise ValueError(f"{path}: GGUF lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    tokenizer = state_of(_build_tokenizer(path, meta)) if with_tokenizer else None
    name = meta.get("general.name") or Path(path).stem
    return gguf_cache.GGUFIndex(hf_config=cfg, name=str(name), tensors=places, tokenizer=tokenizer)
