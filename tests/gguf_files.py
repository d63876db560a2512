"""Tiny GGUF files written by the tests themselves (a trained byte-level BPE tokenizer and random
weights in llama.cpp's layout), shared by the GGUF, GGUF-cache and block-kernel tests."""

from __future__ import annotations

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
    w.add_context_length(512)
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
