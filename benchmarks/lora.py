"""Multi-LoRA serving: output tok/s at batch 32 with 1, 4 and 16 distinct adapters vs the base model.

    python benchmarks/lora.py [--batch 32] [--max-tokens 64] [--rounds 3] [--ranks 8,16,64]

The default model's architecture (SmolLM2-135M: 30 layers, hidden 576, FFN 1536, 9 query / 3 KV
heads, vocabulary 49152) with random float32 weights, saved as an HF folder; PEFT adapters (files
written directly: adapter_config.json + adapter_model.safetensors) on all seven projections. For
each adapter rank: the base model alone, then batches whose rows cycle over 1, 4 and 16 distinct
adapters of that rank, run in interleaved rounds (each configuration once per round) and reported
as the median over the rounds: output tokens / wall time of `LLM.generate` (prefill included),
greedy, every request generating --max-tokens. Then the cost of an adapter swap: reading a rank-16
adapter from its folder, and a batch-1 request under a new adapter vs one already loaded.
Figures: docs/benchmarks/results/ (the LoRA sections).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from kvflow import LLM, LoRARequest, SamplingParams

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
)


def make_base(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE, initializer_range=0.02)).save_pretrained(path)


def make_adapter(path: str, rank: int, seed: int) -> str:
    """A PEFT adapter of `rank` on every projection of every layer, random A and B."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, f = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    head = h // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * head
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    dims |= {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    tensors = {}
    for i in range(SHAPE["num_hidden_layers"]):
        for m in MODULES:
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fan_in, fan_out = dims[m]
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as fh:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}, fh)
    return path


def tok_s(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--distinct", default="1,4,16")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    distinct = [int(d) for d in args.distinct.split(",")]
    work = tempfile.mkdtemp(prefix="kvflow-lora-bench-")
    base = os.path.join(work, "base")
    make_base(base)
    adapters = {
        r: [make_adapter(os.path.join(work, f"r{r}-{i}"), r, seed=1000 * r + i) for i in range(max(distinct))]
        for r in ranks
    }
    llm = LLM(
        base,
        enable_lora=True,
        max_loras=max(distinct),
        max_cpu_loras=max(distinct) * len(ranks) + 2,
        max_lora_rank=max(ranks),
        max_num_seqs=args.batch,
        max_model_len=args.prompt_len + args.max_tokens + 8,
        num_kv_blocks=args.batch * ((args.prompt_len + args.max_tokens) // 16 + 2) + 16,
        enable_prefix_caching=False,  # every configuration computes its prompts
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ids = iter(range(1, 10**6))
    requests = {r: [LoRARequest(f"r{r}-{i}", next(ids), p) for i, p in enumerate(adapters[r])] for r in ranks}
    configs: dict[str, list] = {"base": [None] * args.batch}
    for r in ranks:
        for d in distinct:
            configs[f"rank {r}, {d} adapter{'s' if d > 1 else ''}"] = [requests[r][i % d] for i in range(args.batch)]
    tok_s(llm, prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), None)  # warm-up
    for loras in configs.values():  # load every adapter once (loading is measured below)
        tok_s(llm, prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), loras)
    results: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(args.rounds):
        for name, loras in configs.items():
            results[name].append(tok_s(llm, prompts, params, loras))
    base_tps = statistics.median(results["base"])
    print(
        f"batch {args.batch}, prompt {args.prompt_len} tokens, {args.max_tokens} output tokens each; median of {args.rounds}"
    )
    print(f"{'configuration':<28} {'output tok/s':>12} {'vs base':>8}   rounds")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:<28} {med:>12.1f} {med / base_tps:>7.2f}x   {', '.join(f'{v:.1f}' for v in values)}")

    # The cost of a swap: read a new rank-16 adapter from its folder (what a request for an adapter
    # not in CPU memory waits for), and a batch-1 request under a new adapter vs a loaded one.
    manager = llm.engine.runner.lora
    fresh = [make_adapter(os.path.join(work, f"fresh-{i}"), 16, seed=7 + i) for i in range(args.rounds + 1)]
    loads, cold, warm = [], [], []
    one = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(args.rounds):
        t0 = time.perf_counter()
        manager.add(LoRARequest(f"probe-{i}", next(ids), fresh[i]))
        loads.append(time.perf_counter() - t0)
        new = LoRARequest(f"cold-{i}", next(ids), fresh[i + 1])
        t0 = time.perf_counter()
        llm.generate([prompts[0]], one, use_tqdm=False, lora_request=new)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llm.generate([prompts[0]], one, use_tqdm=False, lora_request=new)
        warm.append(time.perf_counter() - t0)
    print(
        f"adapter swap (rank 16, all projections, {SHAPE['num_hidden_layers']} layers): read from its folder "
        f"{statistics.median(loads) * 1e3:.1f} ms; a batch-1 request of 8 tokens under a new adapter "
        f"{statistics.median(cold) * 1e3:.1f} ms vs {statistics.median(warm) * 1e3:.1f} ms under a loaded one"
    )
    print(f"counters: {manager.counters}")
    llm.shutdown()


if __name__ == "__main__":
    main()
