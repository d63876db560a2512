"""Tiny random HF models saved by the tests themselves (random norm weights included), shared by
the tests of the model families (HF folders and GGUF files)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from conftest import VOCAB_SIZE, make_tokenizer


def save_tiny_model(path: Path, model_cls, config, seed: int, norms: tuple[float, float] = (1.0, 0.2)):
    """`model_cls(config)` with seeded random weights, its norm weights drawn from N(norms) too (HF
    starts them constant: a norm applied the wrong way, or twice, would not show), saved to `path`
    with the test tokenizer. Returns the HF model, in eval mode."""
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(*norms)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return model.eval()


def save_tiny_gemma(path: Path, family: str, config: dict, seed: int):
    """A `family` ("gemma2" or "gemma3") model of `config`: `save_tiny_model` with norms around
    w = 0 (Gemma scales by 1 + w: a (1 + w) applied twice, missing or not undone would show)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    config_cls, model_cls = {
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[family]
    return save_tiny_model(path, model_cls, config_cls(**config), seed, norms=(0.0, 0.3))


def tiny_gemmas(tmp_path_factory, config_of: Callable[[str], dict], seed: int) -> Callable[[str], tuple[str, object]]:
    """For a module-scoped fixture: family -> (its folder, the HF model), each family saved once."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            path = tmp_path_factory.mktemp(family)
            cache[family] = (str(path), save_tiny_gemma(path, family, config_of(family), seed))
        return cache[family]

    return get


# ---- the dense families' shared checks (tests/models/test_<family>.py) ----------------------------
# A tiny dense config: 2 layers, GQA (4 heads over 2 KV heads), the test tokenizer's vocabulary.
TINY_DENSE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


def shared_prefix_prompts(n: int, lo: int, hi: int, seed: int = 9) -> list[list[int]]:
    """`n` prompts of one common 8-token prefix and lo..hi random tokens of their own."""
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(2, VOCAB_SIZE) for _ in range(8)]
    return [shared + [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def check_greedy_matches_hf(path: str, hf, backend: str, max_tokens: int = 16, num_kv_blocks: int = 20) -> None:
    """Five prompts through 4-token blocks, 8-token steps (prefill in chunks of several prompts) and
    few KV blocks (preemption), after the first prompt alone (a prefix-cache hit): HF's greedy tokens
    on attention `backend` ("torch" or "native"; skipped where the native kernels cannot be built)."""
    import pytest

    from kvflow import LLM, SamplingParams
    from kvflow.attention.backends.cpu import native_unsupported

    from conftest import assert_no_leaks, hf_greedy

    if backend == "native":
        why = native_unsupported(torch.device("cpu"), torch.float32, 4, 2, 16)
        if why is not None:
            pytest.skip(f"the native kernels cannot be built here: {why}")
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = shared_prefix_prompts(5, 4, 20)
    llm = LLM(
        path,
        num_kv_blocks=num_kv_blocks,
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=8,
        attention_backend=backend,
    )
    first = llm.generate([prompts[0]], greedy, use_tqdm=False)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    assert first[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, max_tokens)
    assert_no_leaks(llm.engine)


def check_prefill_logits_match_hf(path: str, hf, chunk: int) -> None:
    """Every position's logits of a 37-token prompt computed `chunk` tokens at a time: HF's."""
    from conftest import kvflow_prefill_logits

    prompt = shared_prefix_prompts(1, 29, 29, seed=2)[0]
    ours = kvflow_prefill_logits(path, prompt, chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def check_bfloat16_close_to_float32(path: str) -> None:
    """bfloat16 weights and activations: logits within bf16's rounding of the float32 model's."""
    from conftest import kvflow_prefill_logits

    prompt = shared_prefix_prompts(1, 20, 20, seed=4)[0]
    f32 = kvflow_prefill_logits(path, prompt, 7)
    bf16 = kvflow_prefill_logits(path, prompt, 7, dtype=torch.bfloat16)
    assert ((bf16 - f32).abs().amax() / f32.abs().amax()) < 0.05


def check_blocks_follow_floats(
    path: str, prompts: list[list[int]], max_tokens: int = 16, tol: float = 0.08, num_kv_blocks: int = 64
) -> None:
    """A GGUF file with quantized projections run on its blocks against the same file dequantized
    to float: every step's logprobs within `tol` (the blocks' int8 rounding of the inputs: up to
    ~0.04 seen on the tiny models), the tokens the same up to a step whose two best were that close."""
    from kvflow import LLM, SamplingParams

    # (float32 K/V on both: the block path's bfloat16 default is not what is compared here)
    opts = dict(num_kv_blocks=num_kv_blocks, max_model_len=64, block_size=4, kv_cache_dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = {}
    for weights in ("native", "dequantize"):
        llm = LLM(path, gguf_weights=weights, **opts)
        assert (llm.engine.runner.linear_backend == "gguf") == (weights == "native")  # (blocks vs float)
        outs[weights] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for blocks, floats in zip(outs["native"], outs["dequantize"]):
        for step, (a, b) in enumerate(zip(blocks.token_ids, floats.token_ids)):
            mine, ref = blocks.logprobs[step], floats.logprobs[step]
            assert b in mine, step  # (the float path's token among the blocks' two best)
            for token in set(mine) & set(ref):
                assert abs(mine[token].logprob - ref[token].logprob) < tol, (step, token)
            if a != b:
                best = sorted((lp.logprob for lp in ref.values()), reverse=True)
                assert best[0] - best[1] < 2 * tol, step  # (a near tie flipped)
                break
