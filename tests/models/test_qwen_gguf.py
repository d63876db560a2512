"""Dense Qwen2 / Qwen2.5 and Qwen3 GGUF files (llama.cpp's `qwen2`, `qwen3`), written from tiny HF
models by llama.cpp's layout (tests/gguf_files.py): HF's greedy tokens from the F32 file (q/k/v
biases, per-head q/k norms, tied embeddings, the file's tokenizer), and a Q8_0 file on its
blocks following the same file dequantized."""

from __future__ import annotations

import pytest
from tiny_models import check_blocks_follow_floats, shared_prefix_prompts

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks, hf_greedy
from gguf_files import Q, write_dense_gguf

FAMILIES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_greedy_matches_hf(model_factory, tmp_path, family):
    path, hf = model_factory(family)
    gguf_path = tmp_path / f"{family}.gguf"
    write_dense_gguf(gguf_path, path, family)
    llm = LLM(str(gguf_path), num_kv_blocks=64, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    mc = llm.engine.model_config
    assert mc.architecture == FAMILIES[family] and mc.tie_word_embeddings
    assert mc.attention_bias == (family == "qwen2") and mc.qk_norm == (family == "qwen3")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = shared_prefix_prompts(3, 4, 20, seed=6)
    llm.generate(prompts[:1], greedy, use_tqdm=False)
    for p, o in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    assert llm.get_stats().prefix_cache_hits > 0
    # the file's tokenizer is the folder's
    text = "Hello world, the quick brown fox."
    assert llm.get_tokenizer().encode(text, add_special_tokens=False) == hf_tokenizer(path).encode(
        text, add_special_tokens=False
    )
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_blocks_follow_floats(model_factory, tmp_path, family):
    path, _ = model_factory(family)
    gguf_path = tmp_path / f"{family}-q8.gguf"
    write_dense_gguf(gguf_path, path, family, Q.Q8_0)
    check_blocks_follow_floats(str(gguf_path), shared_prefix_prompts(3, 4, 20, seed=8), 12)


def hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
