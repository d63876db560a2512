"""Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against HF transformers on the
same tiny random weights: greedy tokens under batching, chunked prefill, preemption and prefix
hits; prefill logits; the grouped experts against a float64 loop; routing ties against HF's own
routers; bfloat16 against float32; tensor and expert parallelism (TP = 2, mp executor) against HF
and TP = 1; and the refusals of what is not there yet."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, SamplingParams
from kvflow.attention.backends.cpu import CpuPagedAttention, native_unsupported
from kvflow.config import ModelConfig
from kvflow.kernels.cpu.moe_experts import NativeExperts
from kvflow.layers.linear_kernels import INT4_FORMAT, native_available
from kvflow.layers.moe import Routing, SparseMoeBlock, expert_kernel, grouped_experts
from kvflow.models.decode_pass import native_decode_unsupported
from kvflow.quantization.gguf_blocks import quantize
from kvflow.worker.model_runner import MOE_NATIVE_PATH, MOE_PATH

from conftest import assert_no_leaks, assert_same_completions, engine_logits, hf_greedy, kvflow_prefill_logits

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# (family, overrides): every family, Mixtral with a sliding window, Qwen2-MoE with dense layers between its routed ones (by
# mlp_only_layers, and by decoder_sparse_step), Qwen3-MoE with and without renormalised top-k,
# OLMoE with and without clip_qkv.
VARIANTS = {
    "mixtral": ("mixtral", {}),
    "mixtral-sliding_window": ("mixtral", {"sliding_window": 8}),
    "qwen2_moe-mlp_only": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "qwen2_moe-sparse_step": ("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2}),
    "qwen3_moe-norm_topk": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe-no_norm_topk": ("qwen3_moe", {"norm_topk_prob": False}),
    "olmoe": ("olmoe", {}),
    "olmoe-clip_qkv": ("olmoe", {"clip_qkv": 1.0}),
}


def _model(model_factory, variant: str):
    arch, overrides = VARIANTS[variant]
    return model_factory(arch, **overrides)


def _workload() -> list[list[int]]:
    """Four prompts sharing a 16-token prefix (4 blocks of 4) and two unrelated ones."""
    rng = random.Random(5)
    system = [rng.randrange(2, 500) for _ in range(16)]
    shared = [system + [rng.randrange(2, 500) for _ in range(rng.randint(2, 20))] for _ in range(4)]
    return shared + [[rng.randrange(2, 500) for _ in range(rng.randint(3, 30))] for _ in range(2)]


def test_configs_read_as_hf_builds_them(model_factory):
    """Which layers route, and each family's routing rules, as HF's modules show them."""
    for variant in VARIANTS:
        path, hf = _model(model_factory, variant)
        cfg = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
        moe = cfg.moe
        sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
        assert [moe.is_sparse(i) for i in range(cfg.num_layers)] == sparse, variant
        router = next(layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate"))
        assert moe.num_experts == router.num_experts and moe.num_experts_per_tok == router.top_k
        assert moe.norm_topk_prob == getattr(router, "norm_topk_prob", True)  # (Mixtral's always)
        assert moe.routing_weights_float32 == variant.startswith("mixtral")
        assert (moe.shared_expert_intermediate_size > 0) == variant.startswith("qwen2_moe")
        assert cfg.qk_norm == (not variant.startswith(("mixtral", "qwen2"))) and cfg.qk_norm_per_head != (
            variant.startswith("olmoe")
        )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf(model_factory, variant):
    """Six prompts at once through 4-token blocks, a 16-token step budget (prefill chunks of
    several prompts in one step) and 24 KV blocks (preemption), after one of them alone (prefix
    hits): HF's greedy tokens, and every block back in the pool. A sliding window holds only its
    window's blocks (hybrid KV), so that variant gets a smaller pool to preempt in."""
    path, hf = _model(model_factory, variant)
    prompts = _workload()
    blocks = 12 if "sliding_window" in VARIANTS[variant][1] else 24
    llm = LLM(path, num_kv_blocks=blocks, max_model_len=64, block_size=4, max_num_batched_tokens=16)
    first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert first[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("backend", ["dense", "native"])
def test_expert_paths_match_hf(model_factory, monkeypatch, backend):
    """The stacked experts in torch (the `dense` backend, what a GPU runs) and the experts on
    native kernels (forced): HF's greedy tokens, with the kernel summary naming the path."""
    if backend == "native" and not native_available(torch.float32):
        pytest.skip("the native float kernels cannot be built here")
    path, hf = model_factory("qwen2_moe")
    monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", backend)
    llm = LLM(path, num_kv_blocks=32, max_model_len=64, block_size=4)
    expected = MOE_PATH if backend == "dense" else MOE_NATIVE_PATH
    assert expected in llm.get_stats().linear_kernels
    blocks = llm.engine.runner.model.moe_blocks
    assert all((b.expert_kernels is None) == (backend == "dense") for b in blocks)
    prompts = _workload()
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)


def test_ngram_speculation_matches_hf(model_factory):
    """n-gram drafts verified by a MoE target (several tokens per row through the experts): HF's
    greedy tokens, with drafts accepted."""
    path, hf = model_factory("qwen3_moe")
    prompts = _workload()
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(path, num_kv_blocks=64, max_model_len=96, block_size=4, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 32)
    assert llm.get_stats().spec_decode.num_accepted_tokens > 0
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe-mlp_only", "qwen3_moe-norm_topk", "olmoe-clip_qkv"])
@pytest.mark.parametrize("chunk", [1000, 5])
def test_prefill_logits_match_hf(model_factory, variant, chunk):
    path, hf = _model(model_factory, variant)
    prompt = _workload()[1]
    ours = kvflow_prefill_logits(path, prompt, chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_bfloat16_close_to_float32(model_factory, family):
    """bfloat16 weights and activations: logits within bf16's rounding of the float32 model's (not
    token identity), and the engine runs end to end. A token whose router scores nearly tie in some
    layer may pick another expert in bf16 (HF's own bf16 model does the same: its logits then move
    by more than rounding), so the bound holds for the median position and all but 10% of them."""
    path, _ = model_factory(family)
    prompt = _workload()[2]
    f32 = kvflow_prefill_logits(path, prompt, 7)
    bf16 = kvflow_prefill_logits(path, prompt, 7, dtype=torch.bfloat16)
    per_position = (bf16 - f32).abs().amax(dim=-1) / f32.abs().amax()
    assert per_position.median() < 0.02
    assert (per_position < 0.04).float().mean() >= 0.9, per_position
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=32, max_model_len=64, block_size=4)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == MAX_TOKENS
    assert_no_leaks(llm.engine)


# ---- the grouped experts -------------------------------------------------------------------------
def _loop_reference(x, routing: Routing, w13, w2) -> torch.Tensor:
    """Token by token, slot by slot, in float64."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(routing.experts.shape[1]):
            e = int(routing.experts[t, j])
            xt = x[t].double()
            gate, up = w13[e, :inter].double() @ xt, w13[e, inter:].double() @ xt
            out[t] += float(routing.weights[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize(
    "dtype,weights_dtype,tol",
    [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.float32, 3e-2), (torch.bfloat16, None, 3e-2)],
)
def test_grouped_experts_against_float64_loop(dtype, weights_dtype, tol):
    """Random weights and routing over 6 experts, expert 4 chosen by no token: its weights are NaN,
    so any computation that touched it would show."""
    g = torch.Generator().manual_seed(3)
    tokens, hidden, inter, experts, top_k = 11, 24, 16, 6, 2
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.3
    w13[4], w2[4] = float("nan"), float("nan")
    chosen = torch.stack([torch.randperm(5, generator=g)[:top_k] for _ in range(tokens)])
    chosen[chosen == 4] = 5  # (5 twice in a row would be a duplicate: randperm of 0..4 never has 5)
    weights = torch.rand(tokens, top_k, generator=g)
    routing = Routing(weights.to(weights_dtype or dtype), chosen)
    ref = _loop_reference(x.to(dtype), routing, w13.to(dtype), w2.to(dtype))
    got = grouped_experts(x.to(dtype), routing, w13.to(dtype), w2.to(dtype))
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, atol=tol * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "backend,dtype,tol",
    [
        ("native", torch.float32, 1e-5),
        ("auto", torch.float32, 1e-5),
        ("native", torch.bfloat16, 3e-2),
        ("int4", torch.float32, 2e-2),
    ],
)
def test_grouped_experts_on_linear_kernels_against_float64_loop(backend, dtype, tol):
    """Each expert on its own linear kernels (what `SparseMoeBlock.prepare` builds on the CPU):
    the float64 loop's result, within the kernel's rounding (int4: the loop over the Q4_1 weights
    dequantized, within the 8-bit activations' rounding), and, on the native GEMV, a row's result
    the same bits whatever else is in the batch."""
    if backend == "native" and not native_available(dtype):
        pytest.skip("the native float kernels cannot be built here")
    g = torch.Generator().manual_seed(5)
    tokens, hidden, inter, experts, top_k = 13, 64, 32, 6, 2
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.3).to(dtype)
    chosen = torch.stack([torch.randperm(5, generator=g)[:top_k] for _ in range(tokens)])
    routing = Routing(torch.rand(tokens, top_k, generator=g), chosen)  # expert 5: chosen by none
    gate_up = [expert_kernel(backend, w.clone(), None) for w in w13]
    down = [expert_kernel(backend, w.clone(), None) for w in w2]
    if backend == "int4":  # the weights the kernels hold
        w13 = torch.stack([quantize(w, INT4_FORMAT).dequantize() for w in w13])
        w2 = torch.stack([quantize(w, INT4_FORMAT).dequantize() for w in w2])
    ref = _loop_reference(x, routing, w13, w2)
    got = grouped_experts(x, routing, gate_up, down)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    if backend == "native":
        for t in range(tokens):
            one = Routing(routing.weights[t : t + 1], routing.experts[t : t + 1])
            assert torch.equal(grouped_experts(x[t : t + 1], one, gate_up, down), got[t : t + 1]), t
        # the layer's experts in one native call: the per-expert calls' result (the same bits in
        # float32, where both keep float32 activations), and split over ranks (expert parallelism)
        # partial sums that add up to it
        native = NativeExperts(gate_up, down)
        whole = native(x, routing.experts, routing.weights)
        assert whole.dtype == torch.float32
        if dtype == torch.float32:
            assert torch.equal(whole, got)
        torch.testing.assert_close(whole.double(), ref, atol=tol * ref.abs().max().item(), rtol=0)
        halves = [NativeExperts(gate_up[sl], down[sl]) for sl in (slice(0, 4), slice(4, 6))]
        parts = halves[0](x, routing.experts, routing.weights, 0) + halves[1](x, routing.experts, routing.weights, 4)
        torch.testing.assert_close(parts.double(), whole.double(), atol=1e-6 * ref.abs().max().item(), rtol=0)


def test_grouped_experts_single_token_and_top1():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 8, generator=g)
    w13, w2 = torch.randn(3, 12, 8, generator=g), torch.randn(3, 8, 6, generator=g)
    routing = Routing(torch.tensor([[0.7]]), torch.tensor([[2]]))
    ref = _loop_reference(x, routing, w13, w2)
    torch.testing.assert_close(grouped_experts(x, routing, w13, w2).double(), ref, atol=1e-5, rtol=0)


# ---- routing ties ---------------------------------------------------------------------------------
def _hf_router(family: str, norm_topk_prob: bool):
    """HF's own router module of the family, 4 experts, top-2, hidden 16."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    shape = dict(hidden_size=16, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    config_cls, router_cls = {
        "mixtral": (MixtralConfig, MixtralTopKRouter),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeTopKRouter),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeTopKRouter),
        "olmoe": (OlmoeConfig, OlmoeTopKRouter),
    }[family]
    extra = {"num_local_experts": 4} if family == "mixtral" else {"num_experts": 4, "norm_topk_prob": norm_topk_prob}
    config = config_cls(**shape, **extra)
    arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}.get(family)
    arch = arch or {"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[family]
    cfg = config.to_dict() | {"architectures": [arch], "moe_intermediate_size": 8, "intermediate_size": 8}
    return router_cls(config), ModelConfig.from_hf_config(cfg)


@pytest.mark.parametrize(
    "family,norm", [("mixtral", True), ("qwen2_moe", False), ("qwen3_moe", True), ("olmoe", False)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_ties_as_hf(family, norm, dtype):
    """Experts 1 and 3 get equal router logits (equal weight rows), tied for second place (x > 0)
    or for first (x < 0, where expert 2's row leads): the experts and weights are HF's."""
    hf_router, cfg = _hf_router(family, norm)
    u = torch.rand(16, generator=torch.Generator().manual_seed(5)) + 0.5
    gate = torch.stack([3 * u, 2 * u, -1 * u, 2 * u])  # x > 0: 0 > 1 = 3 > 2; x < 0: 2 > 1 = 3 > 0
    x = torch.rand(6, 16, generator=torch.Generator().manual_seed(6)) + 0.1
    x[3:] *= -1
    hf_router = hf_router.to(dtype)
    with torch.no_grad():
        hf_router.weight.copy_(gate)
        hf_logits, hf_weights, hf_experts = hf_router(x.to(dtype))
    assert torch.equal(hf_logits[:, 1], hf_logits[:, 3])  # a real tie
    block = SparseMoeBlock(16, cfg.moe, dtype, torch.device("cpu"))
    block.router.copy_(gate)
    ours = block.route(x.to(dtype))
    assert torch.equal(ours.experts, hf_experts)
    assert ours.weights.dtype == hf_weights.dtype and torch.equal(ours.weights, hf_weights)


# ---- what is not there yet ------------------------------------------------------------------------
# (int4 on Qwen3-MoE: the tiny Qwen2-MoE's shared expert is 48 wide, and 4-bit blocks take 32 inputs)
@pytest.mark.parametrize(
    "quantization,variant,max_rel,min_agree",
    [("int4", "qwen3_moe-norm_topk", 0.25, 0.75), ("int8", "qwen2_moe-mlp_only", 0.05, 0.9)],
)
def test_quantized_experts(model_factory, quantization, variant, max_rel, min_agree):
    """quantization='int4' / 'int8': every expert on its own Q4_1 block kernels / int8 kernels
    (per-channel weights, per-token activations; SmoothQuant on the attention and the dense MLP
    layers only: the shared expert of Qwen2-MoE and the routed ones unsmoothed); the prefill logits follow
    float32's within the quantization's error (teacher-forced top-1 agreement, relative RMS
    error), and the engine serves it without leaking blocks."""
    from kvflow.kernels.cpu.block_linear import BlockQuantKernel, block_kernels_unavailable
    from kvflow.kernels.cpu.int8_linear import Int8Kernel
    from kvflow.layers.linear_kernels import int8_available

    if quantization == "int4" and block_kernels_unavailable() is not None:
        pytest.skip(block_kernels_unavailable())
    if quantization == "int8" and not int8_available():
        pytest.skip("int8 needs a torch build with FBGEMM")
    path, _ = _model(model_factory, variant)
    prompt = [random.Random(6).randrange(2, 500) for _ in range(40)]
    fp32, llm = (
        LLM(path, quantization=q, num_kv_blocks=32, max_model_len=64, block_size=4, enable_prefix_caching=False)
        for q in (None, quantization)
    )
    assert llm.engine.runner.model.experts_paths == ["kernels"]
    kernel_cls = BlockQuantKernel if quantization == "int4" else Int8Kernel
    for block in llm.engine.runner.model.moe_blocks:
        assert all(isinstance(k, kernel_cls) for kernels in block.expert_kernels for k in kernels)
    fp32, quantized = engine_logits(fp32, prompt), engine_logits(llm, prompt)
    rel = ((quantized - fp32).pow(2).mean() / fp32.pow(2).mean()).sqrt().item()
    agree = (quantized.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    assert 0 < rel < max_rel and agree >= min_agree, (rel, agree)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_no_leaks(llm.engine)


# ---- tensor and expert parallelism ----------------------------------------------------------------
# (family variant, mode, overrides): every family split inside its experts ("tp") and with whole
# experts per rank ("ep"); Qwen2-MoE with a dense layer between its routed ones (and its shared
# expert); Qwen3-MoE with 5 experts over 2 ranks (3 and 2).
PARALLEL = {
    f"{v}-{mode}": (v, mode, {})
    for v in ("mixtral", "qwen2_moe-mlp_only", "qwen3_moe-norm_topk", "olmoe-clip_qkv")
    for mode in ("tp", "ep")
}
PARALLEL["qwen3_moe-5_experts-ep"] = ("qwen3_moe-norm_topk", "ep", {"num_experts": 5})
PARALLEL_PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def _parallel_run(path: str, tp: int, ep: bool = False):
    """The workload through 4-token blocks, a 16-token step budget (chunked prefill, several prompts
    per step) and 24 KV blocks (preemption), per-expert routing counts on."""
    llm = LLM(
        path,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=16,
        kernel_autotune="off",
        moe_expert_metrics="per_expert",
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
    )
    try:
        outs = [o.outputs[0] for o in llm.generate(_workload(), PARALLEL_PARAMS, use_tqdm=False)]
        assert_no_leaks(llm.engine)
        return outs, llm.get_stats(), llm.engine.executor.runner.model
    finally:
        llm.shutdown()


@pytest.mark.server  # starts a worker process
@pytest.mark.parametrize("variant,mode,overrides", list(PARALLEL.values()), ids=list(PARALLEL))
def test_tensor_parallel_matches_hf_and_tp1(model_factory, variant, mode, overrides):
    """TP = 2 (mp executor), experts split inside or partitioned whole: HF's greedy tokens and
    TP = 1's logprobs, under batching, chunked prefill and preemption; rank 0 holds its share of
    the experts only; the routing counts are TP = 1's (each (token, expert) pair counted once)."""
    arch, base = VARIANTS[variant]
    path, hf = model_factory(arch, **base, **overrides)
    ref, ref_stats, _ = _parallel_run(path, 1)
    got, stats, model = _parallel_run(path, 2, ep=mode == "ep")
    assert stats.num_preemptions > 0
    for p, o in zip(_workload(), got):
        assert o.token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_same_completions(got, ref, abs_tol=1e-4)
    assert stats.moe == ref_stats.moe and sum(stats.moe.tokens) > 0
    experts = hf.config.num_local_experts if arch == "mixtral" else hf.config.num_experts
    width = getattr(hf.config, "moe_intermediate_size", None) or hf.config.intermediate_size  # (Mixtral, OLMoE)
    block = model.moe_blocks[0]
    held = range((experts + 1) // 2) if mode == "ep" else range(experts)  # rank 0 holds the extra one
    assert block.experts == held
    gate_up, down = block.expert_kernels  # (the experts on the CPU's linear kernels)
    assert len(gate_up) == len(down) == len(held)
    share = width // (1 if mode == "ep" else 2)
    assert all((k.out_features, k.in_features) == (2 * share, hf.config.hidden_size) for k in gate_up)
    assert all((k.out_features, k.in_features) == (hf.config.hidden_size, share) for k in down)


def test_expert_parallel_partial_sums_add_up():
    """Each rank's grouped experts over its range of 5 experts (3 and 2, as expert_range assigns
    them, and 5 ranks of one) add up to the whole block's output (a float64 loop)."""
    from kvflow.distributed.parallel import expert_range

    assert [expert_range(5, r, 2) for r in range(2)] == [range(3), range(3, 5)]
    assert [len(expert_range(10, r, 4)) for r in range(4)] == [3, 3, 2, 2]
    g = torch.Generator().manual_seed(7)
    tokens, hidden, inter, experts, top_k = 9, 16, 8, 5, 2
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.3
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    routing = Routing(torch.rand(tokens, top_k, generator=g), chosen)
    ref = _loop_reference(x, routing, w13, w2)
    for size in (2, 5):
        for rows in (slice(None), slice(3, 4)):  # the tokens at once, and one alone (its own path)
            parts = []
            for rank in range(size):
                held = expert_range(experts, rank, size)
                sl, one = slice(held.start, held.stop), Routing(routing.weights[rows], routing.experts[rows])
                parts.append(grouped_experts(x[rows], one, w13[sl], w2[sl], first_expert=held.start).double())
            torch.testing.assert_close(sum(parts), ref[rows], atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_parallel_config_errors(model_factory):
    """Refused before any worker starts, naming the shape or the option."""
    from kvflow.distributed.parallel import local_config

    with pytest.raises(ValueError, match=r"enable_expert_parallel .* needs tensor_parallel_size > 1 \(got 1\)"):
        LLM(model_factory("qwen3_moe")[0], max_model_len=32, enable_expert_parallel=True)
    path, _ = model_factory("qwen3_moe", moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the model's expert width .*\(33\)"):
        LLM(path, max_model_len=32, num_kv_blocks=16, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"enable_expert_parallel .* LlamaForCausalLM has none"):
        LLM(model_factory("llama")[0], max_model_len=32, tensor_parallel_size=2, enable_expert_parallel=True)
    cfg = ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    with pytest.raises(ValueError, match="at least one expert per rank; the model has 4 experts"):
        local_config(dataclasses.replace(cfg, num_heads=8, num_kv_heads=8), 8, expert_parallel=True)
    local = local_config(cfg, 2, expert_parallel=True)  # whole experts: their width need not divide
    assert local.moe.moe_intermediate_size == 33 and local.moe.expert_parallel_size == 2


def _native_pass_llm(path: str, monkeypatch, **kwargs) -> LLM:
    why = native_unsupported(torch.device("cpu"), torch.float32, 4, 2, 16)
    if why is not None or not native_available(torch.float32):
        pytest.skip(f"the native kernels cannot be built here: {why}")
    monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", "native")
    return LLM(path, attention_backend="native", num_kv_blocks=32, max_model_len=64, block_size=4, **kwargs)


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe-mlp_only", "qwen3_moe-norm_topk", "olmoe"])
def test_decode_pass_takes_routed_layers(model_factory, monkeypatch, variant):
    """Every family on native kernels (Qwen2-MoE: shared expert, qkv bias and a dense layer;
    Qwen3-MoE: per-head q/k norms; OLMoE: whole-projection ones): decode steps run in the native
    decode pass with their routed layers; HF's greedy tokens; the same routing counts, and
    logprobs within float32 rounding, as the per-layer path on the same requests."""
    path, hf = _model(model_factory, variant)
    llm = _native_pass_llm(path, monkeypatch)
    assert isinstance(llm.engine.runner.attention, CpuPagedAttention)
    model = llm.engine.runner.model
    assert native_decode_unsupported(model) is None and model.native_decode is not None
    assert MOE_NATIVE_PATH in llm.get_stats().linear_kernels
    prompts = _workload()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    calls: list[bool] = []
    real = type(model.native_decode).__call__

    def counted(self, *args):
        calls.append(real(self, *args))
        return calls[-1]

    monkeypatch.setattr(type(model.native_decode), "__call__", counted)
    outs = llm.generate(prompts, params, use_tqdm=False)
    with_pass = model.routing_stats()
    assert len(calls) >= MAX_TOKENS - 1 and all(calls)  # (decode steps, none of them left the pass)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert_no_leaks(llm.engine)

    reference = _native_pass_llm(path, monkeypatch)
    reference.engine.runner.model.native_decode.max_rows = 0  # every step on the per-layer path
    ref = reference.generate(prompts, params, use_tqdm=False)
    assert_same_completions([o.outputs[0] for o in outs], [o.outputs[0] for o in ref], abs_tol=1e-4)
    assert with_pass == reference.engine.runner.model.routing_stats()
    assert with_pass.num_steps > MAX_TOKENS


def test_decode_pass_routing_tie_runs_per_layer_path(model_factory, monkeypatch, tmp_path):
    """Two experts with the same router row tie on every token that picks either: which one a
    top-k keeps is torch.topk's choice, so those steps leave the pass for the per-layer path (the
    count says so), and the tokens stay HF's."""
    import copy

    _, hf = model_factory("mixtral")
    tied = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in tied.model.layers:
            gate = layer.mlp.gate.weight
            gate[1] = gate[0]
    tied.save_pretrained(tmp_path)
    from conftest import make_tokenizer

    make_tokenizer().save_pretrained(tmp_path)
    llm = _native_pass_llm(str(tmp_path), monkeypatch)
    fused = llm.engine.runner.model.native_decode
    assert fused is not None
    prompts = _workload()
    for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(tied, p, MAX_TOKENS)
    assert fused.ties > 0
    assert_no_leaks(llm.engine)


def test_loads_stacked_expert_layout(model_factory, tmp_path):
    """A checkpoint with transformers' in-memory layout (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) instead of per-expert tensors loads to the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, hf = model_factory("qwen3_moe")
    tensors = load_file(f"{path}/model.safetensors")
    stacked: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            stacked[name] = t
    cfg = hf.config
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        e = range(cfg.num_experts)
        gate_up = [torch.cat((tensors[f"{p}{j}.gate_proj.weight"], tensors[f"{p}{j}.up_proj.weight"])) for j in e]
        stacked[p + "gate_up_proj"] = torch.stack(gate_up)
        stacked[p + "down_proj"] = torch.stack([tensors[f"{p}{j}.down_proj.weight"] for j in e])
    out = tmp_path / "stacked"
    shutil.copytree(path, out)
    save_file(stacked, str(out / "model.safetensors"))
    prompt = _workload()[4]
    torch.testing.assert_close(kvflow_prefill_logits(str(out), prompt, 6), kvflow_prefill_logits(path, prompt, 6))


def test_missing_expert_is_named(model_factory, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = model_factory("mixtral")
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    out = tmp_path / "missing"
    shutil.copytree(path, out)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights.*layers\.1\.moe\.w13"):
        kvflow_prefill_logits(str(out), [3, 4, 5], 3)
