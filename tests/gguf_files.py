"""Tiny GGUF files written by the tests themselves (a trained byte-level BPE tokenizer and random
weights in llama.cpp's layout), shared by the GGUF, GGUF-cache and block-kernel tests."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"]
TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand   runs     of   spaces",
    "日本語のテキストも大丈夫ですか？東京は大きい。",
    "emoji 🎉🚀 and 👩‍👩‍👧 family, ünïcödé, Ελληνικά, русский",
    "def f(x):\n    return x ** 2  # code\n\tif x: pass",
    "numbers 1234567890 3.14159 -42 1e10 0x1F",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> special <repo_name>x tokens inline",
    "it's they're we've I'm you'll he'd DON'T",
    "",
    "a",
    "URL: https://example.com/path?q=1&r=2#frag",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "日本の首都は？ 🎌"},
]
CORPUS = "\n".join(TEXTS[:9] * 3) + (
    "\nThe quick brown fox jumps over the lazy dog. Once upon a time there was a model that "
    "loaded weights from files and tokenized text in many languages. こんにちは世界。 "
    "for i in range(10):\n    print(i)\n"
)


# --------------------------------------------------------------------------------------------------
# A tiny llama GGUF, written the way llama.cpp's converter writes one
# --------------------------------------------------------------------------------------------------


def _train_tokenizer(vocab_size: int = 360) -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    import json

    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to HF q_proj/k_proj rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny(
    path,
    *,
    tied: bool,
    pre: str = "smollm",
    add_bos: bool = False,
    layers: int = 2,
    hidden: int = 64,
    ffn: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    arch: str = "llama",
    raw_overrides: dict | None = None,
    raw_blocks: dict | None = None,
    context: int = 512,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF; returns the HF-layout float32 weights that went in (pre-quantisation).
    `raw_overrides`: name -> a type whose tensor is written as zero bytes; `raw_blocks`: name ->
    (type, uint8 rows of blocks) written as given (formats gguf-py cannot quantize)."""
    rng = np.random.default_rng(0)
    tokens, merges = _train_tokenizer()
    tokens = tokens + ["<think>"]
    token_types = [3 if t in SPECIALS else 1 for t in tokens[:-1]] + [4]
    vocab = len(tokens)
    head_dim = hidden // heads
    raw_overrides = raw_overrides or {}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("Tiny Test Llama")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)

    hf: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, shape, qtype: Q, permute_heads: int | None = None):
        data = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        if len(shape) == 1:
            data = 1.0 + 0.1 * data
        hf[hf_name] = data
        stored = llama_cpp_permute(data, permute_heads) if permute_heads else data
        if gguf_name in (raw_blocks or {}):
            rq, raw = raw_blocks[gguf_name]
            w.add_tensor(gguf_name, raw, raw_dtype=rq)
        elif gguf_name in raw_overrides:  # an unsupported type, as raw (zero) bytes of the right size
            rq = raw_overrides[gguf_name]
            block, size = gguf.GGML_QUANT_SIZES[rq]
            raw = np.zeros((shape[0], shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(gguf_name, raw, raw_dtype=rq)
        elif qtype == Q.F32:
            w.add_tensor(gguf_name, stored)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name, stored.astype(np.float16))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)

    put("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden), Q.Q8_0)
    cycle = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.F32]
    for i in range(layers):
        names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
        lt = {n: cycle[(j + i) % len(cycle)] for j, n in enumerate(names)}
        p = f"blk.{i}."
        m = f"model.layers.{i}."
        put(p + "attn_norm.weight", m + "input_layernorm.weight", (hidden,), Q.F32)
        put(p + "attn_q.weight", m + "self_attn.q_proj.weight", (heads * head_dim, hidden), lt["attn_q"], heads)
        put(p + "attn_k.weight", m + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), lt["attn_k"], kv_heads)
        put(p + "attn_v.weight", m + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), lt["attn_v"])
        put(p + "attn_output.weight", m + "self_attn.o_proj.weight", (hidden, heads * head_dim), lt["attn_output"])
        put(p + "ffn_norm.weight", m + "post_attention_layernorm.weight", (hidden,), Q.F32)
        put(p + "ffn_gate.weight", m + "mlp.gate_proj.weight", (ffn, hidden), lt["ffn_gate"])
        put(p + "ffn_up.weight", m + "mlp.up_proj.weight", (ffn, hidden), lt["ffn_up"])
        put(p + "ffn_down.weight", m + "mlp.down_proj.weight", (hidden, ffn), lt["ffn_down"])
    put("output_norm.weight", "model.norm.weight", (hidden,), Q.F32)
    if not tied:
        put("output.weight", "lm_head.weight", (vocab, hidden), Q.Q4_1)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


# --------------------------------------------------------------------------------------------------
# A Mixture-of-Experts GGUF from a tiny HF model folder, laid out as llama.cpp's converter lays it out
# --------------------------------------------------------------------------------------------------

# HF architecture -> llama.cpp's, and whether llama.cpp renormalises its top-k by default (its graph's
# norm_w; a file says otherwise with {arch}.expert_weights_norm).
MOE_GGUF_ARCHS = {
    "MixtralForCausalLM": ("llama", True),
    "Qwen2MoeForCausalLM": ("qwen2moe", False),
    "Qwen3MoeForCausalLM": ("qwen3moe", True),
    "OlmoeForCausalLM": ("olmoe", False),
}


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """`w` [..., cols] (cols a multiple of 256) to GGML's Q4_K blocks, round to nearest (gguf-py has
    no Q4_K quantizer): per 32 values a 6-bit scale and min under the super-block's fp16 d / dmin,
    value = d * scale * q - dmin * min with q in 0..15. uint8 [..., cols / 256 * 144]."""
    lead, cols = w.shape[:-1], w.shape[-1]
    x = w.astype(np.float32).reshape(-1, 8, 32)
    mins = np.maximum(0.0, -x.min(axis=2))  # [blocks, 8], subtracted
    scales = (x.max(axis=2) + mins) / 15
    d = (scales.max(axis=1) / 63).astype(np.float16)
    dmin = (mins.max(axis=1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scales, df, out=np.zeros_like(scales), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[:, :, None]
    q = np.round(np.divide(x + (dminf * mn)[:, :, None], step, out=np.zeros_like(x), where=step > 0))
    q = np.clip(q, 0, 15).astype(np.uint8)
    packed = np.empty((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk j: sub-blocks 2j (low), 2j + 1 (high)
    head = np.stack([d, dmin], axis=1).view(np.uint8).reshape(-1, 4)
    return np.concatenate([head, packed, qs], axis=1).reshape(*lead, cols // 256 * 144)


class _DroppingWriter(gguf.GGUFWriter):
    """A GGUFWriter that leaves the tensors named in `drop` out."""

    def __init__(self, path: str, arch: str, drop: tuple[str, ...] = ()) -> None:
        super().__init__(path, arch)
        self.drop = set(drop)

    def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, tensor_endianess=None) -> None:
        if name not in self.drop:
            super().add_tensor(name, tensor, raw_shape, raw_dtype, tensor_endianess)


def _put(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        w.add_tensor(name, data.astype(np.float32))
    elif qtype == Q.F16:
        w.add_tensor(name, data.astype(np.float16))
    elif qtype == Q.Q4_K:
        w.add_tensor(name, quantize_q4_k(data), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)


def add_folder_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, cfg: dict) -> None:
    """The HF folder's tokenizer as llama.cpp's converter writes a byte-level BPE one (`gpt2`): its
    vocabulary padded to the model's with unused tokens, merges, special ids."""
    tok = json.loads((Path(hf_dir) / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    specials = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    tokens = [s for s, _ in vocab] + [f"[PAD{i}]" for i in range(len(vocab), cfg["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if s in specials else 5 if s.startswith("[PAD") else 1 for s in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


def add_folder_header(w: gguf.GGUFWriter, hf_dir: Path, cfg: dict) -> None:
    """A dense HF folder's shape (context, widths, layers, heads, rope base, norm eps, vocabulary) as
    llama.cpp's converter writes it under the file's architecture, and its tokenizer."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg["rope_parameters"]["rope_theta"]))
    if "layer_norm_eps" in cfg:  # (Cohere's LayerNorm)
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    add_folder_tokenizer(w, hf_dir, cfg)


def write_dense_gguf(path, hf_dir, arch: str, qtype: Q = Q.F32) -> None:
    """Write the tiny dense HF model in `hf_dir` as llama.cpp's convert_hf_to_gguf writes `arch`
    (`qwen2`: q/k/v biases; `qwen3`: per-head q/k norms; `glm4`: the fused gate_up_proj as `ffn_up`,
    its norms as `ffn_norm` (before the MLP), `post_attention_norm` and `post_ffw_norm`, the rotated
    features as `rope.dimension_count`; `command-r` / `cohere2`: `logit_scale`, the LayerNorm's
    eps, Command R7B's window and layer pattern; `attention.key_length` always; Q/K rows as HF holds them,
    llama.cpp rotating these families as HF does, but `smollm3`'s, converted as llama's: permuted),
    the projections in `qtype`, tied embeddings as no
    `output` tensor, and the folder's byte-level BPE tokenizer padded to the vocabulary."""
    from safetensors.numpy import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"Tiny {arch}")
    add_folder_header(w, hf_dir, cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" in rope:
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    names = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    norms = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
    if arch == "glm4":
        del names["ffn_gate"]
        names["ffn_up"] = "mlp.gate_up_proj"
        norms.update({"post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm"})
    if arch == "seed_oss":  # (the converter names its pre-MLP norm post_attention_norm)
        norms["post_attention_norm"] = norms.pop("ffn_norm")
    if arch in ("command-r", "cohere2"):
        w.add_logit_scale(cfg["logit_scale"])
        if arch == "cohere2":
            w.add_sliding_window(cfg["sliding_window"])
            w.add_sliding_window_pattern([kind == "sliding_attention" for kind in cfg["layer_types"]])
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for i in range(cfg["num_hidden_layers"]):
        p, m = f"blk.{i}.", f"model.layers.{i}."
        for gguf_name, hf_name in names.items():
            data = t[f"{m}{hf_name}.weight"]
            if arch == "smollm3" and gguf_name in heads:  # (converted as llama: rows permuted)
                data = llama_cpp_permute(data, heads[gguf_name])
            _put(w, f"{p}{gguf_name}.weight", np.ascontiguousarray(data), qtype)
            if f"{m}{hf_name}.bias" in t:
                w.add_tensor(f"{p}{gguf_name}.bias", t[f"{m}{hf_name}.bias"])
        for gguf_name, hf_name in norms.items():
            if f"{m}{hf_name}.weight" in t:
                w.add_tensor(f"{p}{gguf_name}.weight", t[f"{m}{hf_name}.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    if "lm_head.weight" in t and not cfg.get("tie_word_embeddings"):
        w.add_tensor("output.weight", t["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_moe_gguf(
    path,
    hf_dir,
    *,
    experts: Q = Q.F32,
    shared: Q = Q.F32,
    attention: Q = Q.F32,
    expert_types: dict | None = None,
    drop: tuple[str, ...] = (),
) -> None:
    """Write the tiny HF Mixture-of-Experts model in `hf_dir` (tests/conftest.py's make_model) as a
    GGUF the way llama.cpp's convert_hf_to_gguf writes one: each layer's experts stacked into the
    3-D `ffn_{gate,up,down}_exps` ([experts, out, in] in numpy, GGUF dims reversed), the router
    `ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_*_shexp` with its gate `ffn_gate_inp_shexp` as a
    [hidden] row, `{arch}.expert_*` metadata, Q/K rows permuted for the `llama` architecture
    (Mixtral) only, and the folder's byte-level BPE tokenizer padded to the vocabulary.

    Types: `experts` for the expert tensors (`expert_types`: per projection, "gate" / "up" /
    "down", instead), `shared` for the shared expert's projections, `attention` for q/k/v/o; the
    rest (embeddings, norms, router, shared gate) in F32. Q4_K is quantized by `quantize_q4_k`.
    `drop`: GGUF tensor names left out (a broken file)."""
    import json
    from pathlib import Path

    from safetensors.numpy import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    hf_arch = cfg["architectures"][0]
    arch, norm_default = MOE_GGUF_ARCHS[hf_arch]
    t = {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    n_experts = cfg.get("num_local_experts") or cfg["num_experts"]
    expert_types = {"gate": experts, "up": experts, "down": experts, **(expert_types or {})}

    w = _DroppingWriter(str(path), arch, drop=drop)
    w.add_name(f"Tiny {hf_arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(n_experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch != "llama" and bool(cfg.get("norm_topk_prob", False)) != norm_default:
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", False)))
    if cfg.get("clip_qkv") is not None:
        w.add_clamp_kqv(float(cfg["clip_qkv"]))
    add_folder_tokenizer(w, hf_dir, cfg)

    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    for i in range(layers):
        p, m = f"blk.{i}.", f"model.layers.{i}."
        q, k = t[m + "self_attn.q_proj.weight"], t[m + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = llama_cpp_permute(q, heads), llama_cpp_permute(k, kv_heads)
        w.add_tensor(p + "attn_norm.weight", t[m + "input_layernorm.weight"])
        _put(w, p + "attn_q.weight", q, attention)
        _put(w, p + "attn_k.weight", k, attention)
        _put(w, p + "attn_v.weight", t[m + "self_attn.v_proj.weight"], attention)
        _put(w, p + "attn_output.weight", t[m + "self_attn.o_proj.weight"], attention)
        for part in ("q", "k", "v"):
            if m + f"self_attn.{part}_proj.bias" in t:
                w.add_tensor(p + f"attn_{part}.bias", t[m + f"self_attn.{part}_proj.bias"])
        for part in ("q", "k"):
            if m + f"self_attn.{part}_norm.weight" in t:
                w.add_tensor(p + f"attn_{part}_norm.weight", t[m + f"self_attn.{part}_norm.weight"])
        w.add_tensor(p + "ffn_norm.weight", t[m + "post_attention_layernorm.weight"])
        ffn = m + ("block_sparse_moe." if arch == "llama" else "mlp.")
        if ffn + "gate.weight" not in t:  # a dense layer (Qwen2/3-MoE's mlp_only_layers)
            for part in ("gate", "up", "down"):
                _put(w, p + f"ffn_{part}.weight", t[m + f"mlp.{part}_proj.weight"], attention)
            continue
        w.add_tensor(p + "ffn_gate_inp.weight", t[ffn + "gate.weight"])
        names = {"gate": "w1", "up": "w3", "down": "w2"} if arch == "llama" else {}
        for part in ("gate", "up", "down"):
            stacked = np.stack(
                [t[f"{ffn}experts.{e}.{names.get(part, part + '_proj')}.weight"] for e in range(n_experts)]
            )
            _put(w, p + f"ffn_{part}_exps.weight", stacked, expert_types[part])
        if ffn + "shared_expert_gate.weight" in t:
            for part in ("gate", "up", "down"):
                _put(w, p + f"ffn_{part}_shexp.weight", t[f"{ffn}shared_expert.{part}_proj.weight"], shared)
            w.add_tensor(p + "ffn_gate_inp_shexp.weight", t[ffn + "shared_expert_gate.weight"].reshape(-1))
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    if not cfg.get("tie_word_embeddings", False):
        w.add_tensor("output.weight", t["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_olmo2_gguf(path, hf_dir) -> None:
    """The tiny HF OLMo 2 or 3 in `hf_dir` as llama.cpp's convert_hf_to_gguf writes it (architecture
    `olmo2`: no `attn_norm`, `post_attention_norm` / `post_ffw_norm` on the sublayers' outputs,
    whole-projection `attn_q_norm` / `attn_k_norm`, Q/K rows as HF holds them: NEOX rotary; OLMo 3:
    `attention.sliding_window` with the layers' `sliding_window_pattern`, and the full layers' YaRN
    as `rope.scaling.*`), in F32, with the folder's byte-level BPE tokenizer padded to the
    vocabulary."""
    from safetensors.numpy import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = {k: v.astype("float32") for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), "olmo2")
    w.add_name("Tiny OLMo")
    ropes = cfg["rope_parameters"]
    rope = ropes.get("full_attention", ropes)  # (OLMo 3: a rope per layer type; the converter writes the full one's)
    add_folder_header(w, hf_dir, {**cfg, "rope_parameters": rope})
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([kind == "sliding_attention" for kind in cfg["layer_types"]])
        local = ropes["sliding_attention"]["rope_theta"]
        if local != rope["rope_theta"]:  # (llama.cpp's olmo2 reads it; the converter writes none)
            w.add_rope_freq_base_swa(local)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    names = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    for i in range(cfg["num_hidden_layers"]):
        for gguf_name, hf_name in names.items():
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", t[f"model.layers.{i}.{hf_name}.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
