"""Tiny random models, made by the tests (never downloaded), and a leak check for engines."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Triton kernels' tests run them under Triton's interpreter on the CPU. Triton reads the switch
# when a kernel is decorated, and a library imported by an earlier test module (peft, through
# torch's own Triton ops) can import Triton first: set here, before any test module is collected.
if os.environ.get("KVFLOW_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The kernel autotune's timings go to a directory of this run's, not the user's kernel cache: timed
# beside the suite's own threads and servers, they would become the user's kernel choices (a
# default-model float32 plan timed there once bounded the decode pass at 16 rows instead of 64).
# The compiled libraries stay shared.
if "KVFLOW_AUTOTUNE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["KVFLOW_AUTOTUNE_DIR"] = tempfile.mkdtemp(prefix="kvflow-autotune-")
    atexit.register(shutil.rmtree, os.environ["KVFLOW_AUTOTUNE_DIR"], True)

import pytest
import torch

# CI sets KVFLOW_REQUIRE_NATIVE=1: there, a native-kernel test that would skip because its kernel
# cannot be built (no compiler, no headers) fails instead, so a broken toolchain cannot pass as green.
REQUIRE_NATIVE = os.environ.get("KVFLOW_REQUIRE_NATIVE") == "1"
NATIVE_SKIP_MARKS = ("cannot be built", "could not be built")  # what every such skip reason says


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_NATIVE and report.skipped and any(m in str(report.longrepr) for m in NATIVE_SKIP_MARKS):
        report.outcome = "failed"
        report.longrepr = f"KVFLOW_REQUIRE_NATIVE=1 but the test skipped: {report.longrepr}"


CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time there was a little engine that served many requests at once.",
    "def hello(name):\n    return f'hello {name}'\n",
    "東京は日本の首都です。私は寿司が好きです。こんにちは世界！",
    "Emoji test: 🚀🔥😀👍🏽 and flags 🇯🇵 — done.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
]
VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 8,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )


# Tiny Mixture-of-Experts models: 4 experts, top-2; Mixtral's and OLMoE's experts are
# intermediate_size wide, Qwen2/3-MoE's moe_intermediate_size (their dense layers', if any, the former).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def make_model(path, arch: str = "llama", **overrides):
    """Save a random tiny model of the given family (with a tokenizer) to `path`."""
    from transformers import (
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.1,
    )
    common.update(overrides)
    families = {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
        "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=None)),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=16)),
        "mixtral": (
            MixtralConfig,
            MixtralForCausalLM,
            dict(tie_word_embeddings=False, sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
        ),
        "qwen2_moe": (
            Qwen2MoeConfig,
            Qwen2MoeForCausalLM,
            dict(_QWEN_MOE, tie_word_embeddings=False, shared_expert_intermediate_size=48),
        ),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(_QWEN_MOE, tie_word_embeddings=True, head_dim=16)),
        "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(num_experts=4, num_experts_per_tok=2)),
        # (Granite 3's kind of scalars: tests/models/test_granite.py)
        "granite": (
            GraniteConfig,
            GraniteForCausalLM,
            dict(
                tie_word_embeddings=False,
                embedding_multiplier=12.0,
                residual_multiplier=0.22,
                attention_multiplier=0.05,
                logits_scaling=8.0,
            ),
        ),
    }
    config_cls, model_cls, extra = families[arch]
    torch.manual_seed(1234)
    model = model_cls(config_cls(**{**extra, **common}))
    if arch in ("qwen2", "qwen2_moe"):  # random biases, so a missing bias would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    if arch in ("qwen3", "qwen3_moe", "olmoe"):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.2)
                layer.self_attn.k_norm.weight.normal_(1, 0.2)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    cache: dict = {}

    def get(arch: str = "llama", **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-model")
            cache[key] = (str(path), make_model(path, arch, **overrides))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama(model_factory):
    return model_factory("llama")


def assert_no_leaks(engine) -> None:
    """Every KV block is back in the pool and the books balance."""
    pool = engine.kv_cache.pool
    pool.check_consistency()
    # (a sliding-window model's pool reserves its null block for good: kvflow.core.kv_groups)
    leaked = pool.num_blocks - pool.num_reserved - pool.num_free_blocks
    assert leaked == 0, f"{leaked} KV blocks leaked"
    assert not engine.scheduler.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.kv_cache.block_tables


def assert_same_completions(outs, reference, abs_tol: float = 1e-5) -> None:
    """CompletionOutputs with the same tokens and, where logprobs were asked for, the same top-N
    ids with logprobs within abs_tol."""
    for o, r in zip(outs, reference, strict=True):
        assert o.token_ids == r.token_ids
        for a, b in zip(o.logprobs or [], r.logprobs or []):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=abs_tol)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation, never stopping early (the engine side uses ignore_eos)."""
    import copy

    gc = copy.deepcopy(model.generation_config)
    gc.pad_token_id, gc.do_sample = 0, False
    # (eos_token_id=None as an argument: a None in the config is filled from the model's own.)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), generation_config=gc, max_new_tokens=max_new_tokens, eos_token_id=None
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_embedding(model, prompt: list[int], pooling: str) -> torch.Tensor:
    """HF's final hidden states (after the final norm), pooled ("last" or "mean") and
    L2-normalised, in float32."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    last = out.hidden_states[-1][0].float()  # post-norm: HF's last entry is the final norm's output
    assert torch.allclose(last, model.model(torch.tensor([prompt])).last_hidden_state[0].float(), atol=1e-6)
    vec = last[-1] if pooling == "last" else last.mean(0)
    return torch.nn.functional.normalize(vec, dim=0)


def hf_beams(
    model, prompt_ids: list[int], width: int, max_new_tokens: int, stops: list[int], length_penalty=1.0, min_tokens=0
) -> tuple[list[list[int]], list[float] | None]:
    """HF's beam search (`generate(num_beams=width)`, its default early stopping): the `width`
    beams best first, each cut after the stop token that ended it, and their scores (None for
    width 1, which HF runs as greedy search and returns unscored)."""
    with torch.no_grad():
        g = model.generate(
            torch.tensor([prompt_ids]),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=0,
            length_penalty=length_penalty,
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for seq in g.sequences:
        out = seq[len(prompt_ids) :].tolist()
        end = next((i + 1 for i, t in enumerate(out) if t in stops), len(out))  # HF pads after a stop
        beams.append(out[:end])
    return beams, (g.sequences_scores.tolist() if width > 1 else None)


def engine_logits(llm, ids: list[int]) -> torch.Tensor:
    """The logits at every position of `ids`: one forward pass of an `LLM`'s own model (its
    kernels, whatever backend it chose) over a fresh block table (nothing else may be running)."""
    from kvflow.attention.backend import SeqLayout

    runner = llm.engine.runner
    blocks = list(range(-(-len(ids) // llm.engine.config.block_size)))
    with torch.inference_mode():
        meta = runner.attention.build_metadata([SeqLayout(0, len(ids), blocks)])
        return runner.model.compute_logits(runner.model(torch.tensor(ids), meta.positions, runner.kv_caches, meta))


def kvflow_prefill_logits(
    path: str, prompt: list[int], chunk: int, num_blocks: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Logits (float32) at every prompt position, computed `chunk` tokens at a time through the
    paged cache, by a model in `dtype` on the dense linear path."""
    import random

    from kvflow.attention.backend import SeqLayout
    from kvflow.attention.backends.torch import TorchPagedAttention
    from kvflow.config import ModelConfig
    from kvflow.core.kv_cache_manager import KVCacheManager
    from kvflow.models.loader import load_checkpoint
    from kvflow.models.registry import causal_lm_class

    ckpt = load_checkpoint(path)
    cfg = ModelConfig.from_hf_config(ckpt.hf_config)
    dev = torch.device("cpu")
    attn = TorchPagedAttention(block_size=4, sliding_window=None, device=dev)
    model = causal_lm_class(cfg)(cfg, attn, num_blocks * 4, dtype, dev)
    model.load_weights(ckpt.weights)
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_caching=False)
    # Shuffle the pool so the block table is not the identity.
    kv.pool._free = type(kv.pool._free).fromkeys(random.Random(0).sample(range(num_blocks), num_blocks))
    caches = attn.allocate_kv_cache(cfg.num_layers, num_blocks, cfg.num_kv_heads, cfg.head_dim, dtype)

    class Seq:
        request_id, num_computed_tokens = "x", 0

    seq, logits = Seq(), []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            ids = prompt[start : start + chunk]
            assert kv.allocate_slots(seq, len(ids))
            meta = attn.build_metadata([SeqLayout(start, len(ids), kv.block_tables["x"])])
            hidden = model(torch.tensor(ids), meta.positions, caches, meta)
            logits.append(model.compute_logits(hidden))
            seq.num_computed_tokens += len(ids)
    return torch.cat(logits)


# ---- paged attention: a random cache and the float64 brute force the kernels are checked against ----
def random_kv_cache(
    attn,
    num_blocks: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
):
    """One layer's cache from `attn` filled with random values (int8: random codes and scales)."""
    cache = attn.allocate_kv_cache(1, num_blocks, kv_heads, head_dim, dtype, kv_dtype)[0]
    if kv_dtype == "int8":
        cache.data.copy_(torch.randint(-127, 128, cache.data.shape, generator=gen))
        cache.scale.copy_(torch.rand(cache.scale.shape, generator=gen) * 0.05 + 1e-3)
    else:
        cache.data.copy_(torch.randn(cache.data.shape, generator=gen).to(dtype))
    return cache


def bf16_product_rows(cache, seqs: list, heads: int, head_dim: int, native: bool) -> list[bool]:
    """Per new token: whether the native CPU kernel computes it in a prefill tile that multiplies in
    bf16 (a bfloat16 cache on a CPU with AVX512_BF16, head_dim 64 / 128, a chunk long enough to fill
    half a tile of 48 lanes: csrc/tiled_attention.h), so its scaled query and its probabilities are
    rounded to bf16. A step whose sequences all have at most DECODE_LIKE_ROWS new tokens runs as
    decode rows, untiled. Sequences here have distinct block tables (each chunk its own run)."""
    from kvflow.attention.backend import DECODE_LIKE_ROWS
    from kvflow.kernels.cpu import paged_attention as kernel

    kv_heads = cache.data.shape[3]
    group = heads // kv_heads
    on = native and cache.data.dtype == torch.bfloat16 and head_dim in (64, 128) and kernel.bf16_products()
    on = on and any(s.num_new > DECODE_LIKE_ROWS for s in seqs)
    return [on and 2 * s.num_new * group >= 48 for s in seqs for _ in range(s.num_new)]


def bf16_query_reference(q, cache, seqs, block_size, scale, window, rows: list[bool]) -> torch.Tensor:
    """paged_attention_reference with the rows flagged in `rows` given the query a bf16-product tile
    multiplies: q * scale rounded to bf16. Their remaining error is the probabilities' rounding to
    bf16 (relative 2^-9 each), at most 2^-9 * max|v|."""
    qs = (q.float() * scale).bfloat16().double() / scale
    q_used = torch.where(torch.tensor(rows).view(-1, 1, 1), qs, q.double())
    return paged_attention_reference(q_used, cache, seqs, block_size, scale, window)


def paged_attention_reference(
    q: torch.Tensor, cache, seqs: list, block_size: int, scale: float, window: int | None, softcap: float | None = None
) -> torch.Tensor:
    """Brute force in float64: each new token attends to its sequence's keys 0..pos (within window),
    its scores soft-capped (tanh(s / softcap) * softcap) when `softcap` is given."""
    data = cache.data.double()
    if cache.scale is not None:
        data = data * cache.scale.double().unsqueeze(-1)
    heads, kv_heads = q.shape[1], data.shape[3]
    out, row = [], 0
    for s in seqs:
        slots = torch.tensor(
            [s.block_table[p // block_size] * block_size + p % block_size for p in range(s.start_pos + s.num_new)]
        )
        kv = data.flatten(0, 1)[slots]  # [L, 2, KV, D]
        k = kv[:, 0].repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        v = kv[:, 1].repeat_interleave(heads // kv_heads, dim=1)
        for i in range(s.num_new):
            pos = s.start_pos + i
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,lhd->hl", q[row].double(), k[lo : pos + 1]) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo : pos + 1]).flatten())
            row += 1
    return torch.stack(out)
