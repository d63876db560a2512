"""Mixture-of-Experts GGUF files as llama.cpp lays them out (3-D `ffn_{gate,up,down}_exps` experts,
the `ffn_gate_inp` router, Qwen2-MoE's `ffn_*_shexp` shared expert), written by the tests' own
writer (gguf_files.write_moe_gguf) from the weights of a tiny HF model of each family:

* read as HF holds the model (config, every tensor), and dequantized, HF's logits and greedy tokens;
* quantized experts (Q8_0, Q4_K) run as stored: each expert's slice of the 3-D tensor is its own
  block-quantized weight on the block kernels (the bytes gguf-py decodes for that slice; each
  projection within the kernels' float32 bound of the float64 product; a row's result independent
  of its batch); the model's logits follow the dequantized path's within the activation
  quantization's noise, greedy tokens equal while the margins allow;
* a layer whose experts come in mixed float and block types runs them in float (dequantized);
* the metadata cache serves a MoE file's second load;
* under tensor parallelism (experts split inside or whole per rank), HF's greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.kernels.cpu.block_linear import BlockQuantKernel, block_kernels_unavailable
from kvflow.layers.moe import Routing, grouped_experts
from kvflow.models import gguf_cache, gguf_loader
from kvflow.models.gguf_loader import load_gguf
from kvflow.quantization.gguf_blocks import BlockQuantized
from kvflow.worker.model_runner import MOE_BLOCKS_PATH, MOE_KERNELS_PATH, MOE_NATIVE_PATH

from conftest import assert_no_leaks, hf_greedy, kvflow_prefill_logits
from gguf_files import write_moe_gguf

# (family, overrides of the tiny HF model): every family; Qwen2-MoE with its shared expert (64 wide,
# so Q8_0 blocks fit its down projection) and a dense layer between routed ones; Qwen3-MoE
# renormalising its top-k (llama.cpp's default for qwen3moe) and not (the file says so); OLMoE
# with clip_qkv.
VARIANTS = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1], "shared_expert_intermediate_size": 64}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe-no_norm_topk": ("qwen3_moe", {"norm_topk_prob": False}),
    "olmoe": ("olmoe", {"clip_qkv": 1.0}),
}
PROMPTS = [[5, 9, 33, 2, 71, 100, 12, 8, 40, 41, 42], [300, 7, 7, 19], [44, 45, 46, 47, 48, 49, 50, 51, 52]]
# (K/V in float32 on both paths: the block path's bfloat16 default would add its rounding to what
# the comparisons below bound, the block kernels' own noise)
ENGINE = dict(
    max_model_len=64,
    num_kv_blocks=32,
    block_size=4,
    kernel_autotune="off",
    enable_prefix_caching=False,
    kv_cache_dtype="float32",
)
EPS32 = 2.0**-23

needs_block_kernels = pytest.mark.skipif(
    block_kernels_unavailable() is not None, reason=f"block kernels unavailable: {block_kernels_unavailable()}"
)


def _gguf(model_factory, tmp_path, variant: str, **types) -> tuple[str, str, torch.nn.Module]:
    arch, overrides = VARIANTS[variant]
    folder, hf = model_factory(arch, **overrides)
    path = tmp_path / f"{variant}.gguf"
    write_moe_gguf(path, folder, **types)
    return str(path), folder, hf


def _hf_tensors(folder: str, cfg: dict) -> dict[str, torch.Tensor]:
    """The HF folder's tensors under the names a MoE GGUF loads as: stacked experts, `mlp.` keys."""
    from safetensors.torch import load_file

    raw = load_file(f"{folder}/model.safetensors")
    out = {k.replace("block_sparse_moe.", "mlp."): v for k, v in raw.items() if ".experts." not in k}
    mixtral = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    for i in range(cfg["num_hidden_layers"]):
        for part in ("gate_proj", "up_proj", "down_proj"):
            keys = [f"model.layers.{i}.mlp.experts.{e}.{part}.weight" for e in range(experts)]
            keys += [f"model.layers.{i}.block_sparse_moe.experts.{e}.{mixtral[part]}.weight" for e in range(experts)]
            found = [raw[k] for k in keys if k in raw]
            if found:
                out[f"model.layers.{i}.mlp.experts.{part}"] = torch.stack(found)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reads_as_hf_holds_the_model(model_factory, tmp_path, variant):
    """The config is HF's (experts, top-k, widths, renormalisation, shared expert, dense layers,
    q/k norms, clip_qkv), every tensor HF's, bit for bit (float32 file; Q/K rows un-permuted for
    Mixtral only, the shared gate's [hidden] row back to [1, hidden])."""
    path, folder, _ = _gguf(model_factory, tmp_path, variant)
    ck = load_gguf(path)
    hf_cfg = json.loads((Path(folder) / "config.json").read_text())
    ours, theirs = ModelConfig.from_hf_config(ck.hf_config), ModelConfig.from_hf_config(hf_cfg)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # (stored as float32)
    ours.rms_norm_eps = theirs.rms_norm_eps
    assert ours == theirs
    expected = _hf_tensors(folder, hf_cfg)
    assert set(ck.tensors) == set(expected)
    for name, t in ck.tensors.items():
        assert torch.equal(t, expected[name].float()), name


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_dequantized_matches_hf(model_factory, tmp_path, variant):
    """Float experts, `--gguf-weights dequantize`: HF's prefill logits (chunked through the paged
    cache) and HF's greedy tokens for three prompts in one batch."""
    path, _, hf = _gguf(model_factory, tmp_path, variant)
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(kvflow_prefill_logits(path, prompt, chunk=4), ref, atol=1e-4, rtol=0)
    llm = LLM(path, gguf_weights="dequantize", **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    summary = llm.get_stats().linear_kernels
    assert MOE_KERNELS_PATH in summary or MOE_NATIVE_PATH in summary  # (as the autotune chose for one row)
    assert_no_leaks(llm.engine)


@pytest.mark.server  # starts a worker process
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_tensor_parallel_matches_hf(model_factory, tmp_path, ep):
    """A GGUF's experts (Qwen2-MoE: shared expert, a dense layer) split over 2 ranks, inside or
    whole per rank (each rank keeping its slices of the 3-D tensors): dequantized at load, as
    under TP every GGUF is, HF's greedy tokens for three prompts in one batch."""
    path, _, hf = _gguf(model_factory, tmp_path, "qwen2_moe")
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=ep, **ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
        assert llm.engine.executor.runner.model.moe_blocks[0].experts == (range(2) if ep else range(4))
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


# ---- quantized experts, as stored ------------------------------------------------------------------
def _file_tensor(path: str, name: str) -> tuple[np.ndarray, Q]:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return np.array(t.data), Q(t.tensor_type)


def _dequantized(raw: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).astype(np.float64)


def _magnitude(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """|scale x value| + |offset| per weight: the terms the kernel sums (Q4_K's offset apart, so
    cancellation between the two cannot shrink the bound below what float32 arithmetic does)."""
    w = _dequantized(raw, qtype)
    if qtype != Q.Q4_K:
        return np.abs(w)
    zero = raw.reshape(*raw.shape[:-1], -1, 144).copy()
    zero[..., 16:] = 0  # every value 0: what is left is the offset
    offset = _dequantized(zero.reshape(raw.shape), qtype)
    return np.abs(w - offset) + np.abs(offset)


def _quantized_activations(x: torch.Tensor) -> np.ndarray:
    """x as the kernel sees it: per 32 values, round(x / dx) * dx with dx = max|x| / 127."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / torch.where(dx > 0, dx, 1)) * dx).reshape(x.shape).numpy()


def _check_expert_kernels(path: str, model, layer: int, fmt: str) -> None:
    """Layer `layer`'s experts on the block kernels: expert e's gate | up kernel holds exactly the
    e-th slices of ffn_gate_exps / ffn_up_exps (as gguf-py decodes them), its down kernel the e-th
    of ffn_down_exps; each gate | up product within the kernels' float32 bound (test_block_linear's
    derivation: (blocks + 10) float32 epsilons of the sum of the absolute terms)."""
    block = model.layers[layer].moe
    gate_up, down = block.expert_kernels
    raw = {p: _file_tensor(path, f"blk.{layer}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")}
    x = torch.randn(7, block.router.shape[1], generator=torch.Generator().manual_seed(layer))
    xq = _quantized_activations(x)
    for e in range(block.num_experts):
        assert isinstance(gate_up[e], BlockQuantKernel) and gate_up[e].formats == [fmt, fmt]
        w = np.concatenate([_dequantized(raw[p][0][e], raw[p][1]) for p in ("gate", "up")])
        np.testing.assert_array_equal(gate_up[e].dequantized_weight().double().numpy(), w)
        np.testing.assert_array_equal(
            down[e].dequantized_weight().double().numpy(), _dequantized(raw["down"][0][e], raw["down"][1])
        )
        mag = np.concatenate([_magnitude(raw[p][0][e], raw[p][1]) for p in ("gate", "up")])
        bound = (x.shape[1] / 32 + 10) * EPS32 * (np.abs(xq) @ mag.T) + 1e-30
        err = np.abs(gate_up[e](x).double().numpy() - xq @ w.T)
        assert (err <= bound).all(), f"expert {e}: max err / bound {(err / bound).max():.2f}"


def _logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids`, one sequence from position 0, one forward pass."""
    from kvflow.attention.backend import SeqLayout

    runner = llm.engine.runner
    blocks = list(range(-(-len(ids) // llm.engine.config.block_size)))
    with torch.inference_mode():
        meta = runner.attention.build_metadata([SeqLayout(0, len(ids), blocks)])
        return runner.model.compute_logits(runner.model(torch.tensor(ids), meta.positions, runner.kv_caches, meta))


@needs_block_kernels
@pytest.mark.parametrize(
    "variant,fmt,overrides",
    [
        ("qwen2_moe", "Q8_0", {}),  # with the shared expert in Q8_0 too
        ("mixtral", "Q4_K", {"hidden_size": 256, "intermediate_size": 256}),  # K-quant rows: 256 wide
    ],
    ids=["Q8_0-qwen2_moe", "Q4_K-mixtral"],
)
def test_quantized_experts_run_as_stored(model_factory, tmp_path, variant, fmt, overrides):
    arch, base = VARIANTS[variant]
    folder, _ = model_factory(arch, **{**base, **overrides})
    path = str(tmp_path / f"{variant}-{fmt}.gguf")
    write_moe_gguf(path, folder, experts=Q[fmt], shared=Q[fmt])
    native, deq = (LLM(path, gguf_weights=mode, **ENGINE) for mode in ("native", "dequantize"))
    runner, model = native.engine.runner, native.engine.runner.model
    assert runner.linear_backend == "gguf" and model.experts_paths == ["blocks"]
    assert MOE_BLOCKS_PATH in native.get_stats().linear_kernels
    for i in model.moe_layers:
        _check_expert_kernels(path, model, i, fmt)
        block = model.layers[i].moe
        assert block.w13.numel() == 0 and block.w2.numel() == 0  # the float stacks are gone
        if block.shared_gate_up is not None:
            assert block.shared_gate_up.kernel.formats == [fmt, fmt] and block.shared_down.kernel.formats == [fmt]
        # Grouped by expert on the block kernels: a row's experts' result does not depend on its
        # batch (the router's F.linear, HF's op, is not held to that).
        h = torch.randn(9, block.router.shape[1], generator=torch.Generator().manual_seed(i))
        with torch.inference_mode():
            routing = block.route(h)
            batched = grouped_experts(h, routing, *block.expert_kernels)
            for r in range(h.shape[0]):
                one = Routing(routing.weights[r : r + 1], routing.experts[r : r + 1])
                assert torch.equal(grouped_experts(h[r : r + 1], one, *block.expert_kernels), batched[r : r + 1]), r
    # The experts as stored: Q8_0 34 bytes per 32 weights, Q4_K 144 per 256, against float32's 4 each.
    held = [sum(b.expert_bytes() for b in m.moe_blocks) for m in (model, deq.engine.runner.model)]
    assert held[0] < 0.4 * held[1]

    # The model: logits within the activation quantization's noise of the dequantized path's
    # (the dense K-quant test's bound); greedy tokens (three prompts in one batch) the same as the
    # dequantized path's up to a position where its top-2 margin is within twice the two paths'
    # logit difference, if any (a near tie either path may break its way).
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    refs = [o.outputs[0].token_ids for o in deq.generate(PROMPTS, sp, use_tqdm=False)]
    outs = [o.outputs[0].token_ids for o in native.generate(PROMPTS, sp, use_tqdm=False)]
    for prompt, ref, out in zip(PROMPTS, refs, outs):
        ids = prompt + ref
        a, b = _logits(native, ids), _logits(deq, ids)
        assert (a - b).abs().max().item() < 0.1 * b.std().item()
        gen = slice(len(prompt) - 1, len(ids) - 1)  # the positions that chose the 12 tokens
        top2 = b[gen].topk(2, dim=-1).values
        close = (top2[:, 0] - top2[:, 1]) <= 2 * (a[gen] - b[gen]).abs().amax(-1) + 1e-4
        first = next((j for j, (x, y) in enumerate(zip(out, ref)) if x != y), len(ref))
        assert first == len(ref) or close[first], (prompt, out, ref, close.tolist())
    assert_no_leaks(native.engine)


def test_mixed_expert_types_run_in_float(model_factory, tmp_path):
    """A layer whose experts are Q8_0 gate / down and F16 up: the block ones are dequantized into
    float experts at load (one path per layer), run on float kernels, so the native load is the
    dequantized one, logits and all."""
    path, _, _ = _gguf(model_factory, tmp_path, "qwen3_moe", expert_types={"gate": Q.Q8_0, "up": Q.F16, "down": Q.Q8_0})
    native, deq = (LLM(path, gguf_weights=mode, **ENGINE) for mode in ("native", "dequantize"))
    model = native.engine.runner.model
    assert model.experts_paths in (["kernels"], ["native"]) and not model.has_block_weights
    torch.testing.assert_close(_logits(native, PROMPTS[2]), _logits(deq, PROMPTS[2]), atol=1e-5, rtol=0)


def test_missing_expert_tensor_is_named(model_factory, tmp_path):
    arch, overrides = VARIANTS["olmoe"]
    folder, _ = model_factory(arch, **overrides)
    path = tmp_path / "broken.gguf"
    write_moe_gguf(path, folder, drop=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ValueError, match=r"lacks tensors \['model\.layers\.1\.mlp\.experts\.up_proj'\]"):
        load_gguf(path)


def test_old_per_expert_layout_is_named(tmp_path):
    """Before llama.cpp stacked the experts (2024), Mixtral GGUFs held one 2-D tensor per expert."""
    path = tmp_path / "old-mixtral.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_expert_count(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((16, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate\.0\.weight' is one expert of llama\.cpp's old"):
        load_gguf(path)


@pytest.mark.parametrize("keep_blocks", [False, True])
def test_metadata_cache_serves_a_moe_file(model_factory, tmp_path, monkeypatch, keep_blocks):
    """The second load of a MoE GGUF parses nothing and gives the same config and tensors (3-D
    expert blocks included)."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    parses = []
    real = gguf_loader._open
    monkeypatch.setattr(gguf_loader, "_open", lambda p: parses.append(p) or real(p))
    path, _, _ = _gguf(model_factory, tmp_path, "qwen2_moe", experts=Q.Q8_0, shared=Q.Q8_0)
    first = load_gguf(path, keep_blocks=keep_blocks)
    assert len(parses) == 1 and gguf_cache.entry_path(path).is_file()
    second = load_gguf(path, keep_blocks=keep_blocks)
    assert len(parses) == 1, "the second load parsed the file again"
    assert first.hf_config == second.hf_config and list(first.tensors) == list(second.tensors)
    experts = first.tensors["model.layers.0.mlp.experts.gate_proj"]
    assert isinstance(experts, BlockQuantized) == keep_blocks
    for name, x in first.tensors.items():
        y = second.tensors[name]
        if isinstance(x, BlockQuantized):
            assert x.format == y.format and torch.equal(x.data, y.data), name
        else:
            assert torch.equal(x, y), name
