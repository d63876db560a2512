"""bf16 greedy output against HF transformers in bf16 on the same weights (exactness is promised
for float32 only; this reports how close bf16 comes), with float32 as the yardstick.

    python benchmarks/bf16_agreement.py [--model PATH] [--prompts 20] [--new-tokens 64]

Chat prompts of benchmarks/quality.py, greedy, ignore_eos. For each pair of runs: the share of
generated tokens identical at the same position, the share of prompts whose whole continuation is
identical, and the mean common prefix (after the first divergence the texts differ). Pairs: kvflow
bf16 vs HF bf16 (the must-show), HF bf16 vs HF fp32 (how far bf16 itself moves HF), kvflow bf16 vs
kvflow fp32, and kvflow fp32 vs HF fp32 (exact: 100% expected). A GGUF is dequantized at load on
both sides. kvflow's bf16 path is the one this CPU gets (`linear kernels ...` at start-up; the
native GEMV takes bf16 weights through AVX512-BF16 dot products where the CPU has them).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch


def _prompts() -> list[str]:
    spec = importlib.util.spec_from_file_location("quality", Path(__file__).with_name("quality.py"))
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    return quality.PROMPTS


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = None, 0, False
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), generation_config=gc, max_new_tokens=new_tokens, min_new_tokens=new_tokens
        )
    return out[0, len(ids) :].tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float, float]:
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    total = sum(len(p) for p in a)
    whole = sum(p == q for p, q in zip(a, b))
    prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
    return same / total, whole / len(a), sum(prefix) / len(prefix)


def main() -> int:
    from kvflow import LLM, SamplingParams
    from kvflow.bench.report import cpu_line
    from kvflow.models.loader import load_hf_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded GGUF)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    print(cpu_line())
    runs: dict[str, list[list[int]]] = {}
    prompt_ids = None
    for dtype in ("bfloat16", "float32"):
        llm = LLM(args.model, dtype=dtype, gguf_weights="dequantize", max_model_len=1024, num_kv_blocks=256)
        tok = llm.engine.tokenizer
        chats = [
            tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in _prompts()[: args.prompts]
        ]
        prompt_ids = [tok.encode(c, add_special_tokens=False) for c in chats]
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        outs = llm.generate(prompt_ids, params, use_tqdm=False)
        runs[f"kvflow {dtype}"] = [o.outputs[0].token_ids for o in outs]
        print(f"kvflow {dtype}: {llm.engine.get_stats().linear_kernels}", flush=True)
        del llm
    for dtype in (torch.bfloat16, torch.float32):
        hf = load_hf_model(args.model, dtype)
        runs[f"HF {str(dtype).removeprefix('torch.')}"] = [hf_greedy(hf, ids, args.new_tokens) for ids in prompt_ids]
        del hf
    print(f"\n{args.prompts} chat prompts x {args.new_tokens} greedy tokens\n")
    print("| pair | tokens identical | prompts identical throughout | mean common prefix |")
    print("|---|---|---|---|")
    for a, b in (
        ("kvflow bfloat16", "HF bfloat16"),
        ("HF bfloat16", "HF float32"),
        ("kvflow bfloat16", "kvflow float32"),
        ("kvflow float32", "HF float32"),
    ):
        same, whole, prefix = agreement(runs[a], runs[b])
        print(f"| {a} vs {b} | {100 * same:.1f}% | {100 * whole:.0f}% | {prefix:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
