"""kvflow on a GGUF's own blocks against llama.cpp's llama-bench on the same file, in one run.

    python benchmarks/gguf_vs_llamacpp.py --llama-bench /path/to/llama.cpp/build/bin/llama-bench
        [--model FILE | --kquant-model 100m|1b]

llama.cpp: built from the sources in the llama-cpp-python 0.3.36 sdist (`cmake -B build -G Ninja
-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && ninja -C build llama-bench`). Its
figures are `llama-bench -m FILE -t T -p 128 -n 128` (pp128: a 128-token prompt; tg128: 128 tokens
generated one at a time; each the mean of its 5 repetitions). kvflow's, on the same threads: batch-1
decode (one request alone, 128 greedy tokens after an 8-token prompt, decode steps only: the
engine's whole step, sampling and detokenizing included) and prefill (a fresh 128-token prompt,
max_tokens=1, the whole step). The two alternate for `--rounds` rounds, so the drift of a shared
machine falls on both; medians are reported, with every round's value. Modes: `gguf` (the file's
blocks through the block kernels, the default) and, with `--modes`, `fp32` (dequantized at load),
`int8`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).parent))
from cpu_speed import Prompts, cpu_name, decode_tok_s, prefill_tok_s

# Llama shapes for --kquant-model: hidden, layers, MLP width, heads, KV heads
KQUANT_SHAPES = {"100m": (768, 12, 2048, 12, 4), "1b": (2048, 22, 5632, 32, 4)}


def write_kquant_model(shape: str, path: str) -> None:
    """A random Llama of `shape` as a Q4_K_M-like GGUF (the tests' writer): Q4_K q / k / o / gate /
    up, Q6_K v / down, random blocks with fp16 scales in [0, 0.01); a tiny vocabulary, so the
    logits cost nothing in either engine."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType as Q

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_files import write_tiny

    hidden, layers, ffn, heads, kv = KQUANT_SHAPES[shape]
    hd = hidden // heads
    rng = np.random.default_rng(0)

    def blocks(fmt: Q, rows: int, cols: int) -> np.ndarray:
        size, scale_at = (144, (0, 2)) if fmt == Q.Q4_K else (210, (208,))
        data = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
        for at in scale_at:
            d = (rng.random((rows, cols // 256)) * 0.01).astype(np.float16)
            data[:, :, at : at + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
        return data.reshape(rows, -1)

    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv * hd, hidden),
        "attn_v": (kv * hd, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    raw = {}
    for i in range(layers):
        for name, (rows, cols) in shapes.items():
            fmt = Q.Q6_K if name in ("attn_v", "ffn_down") else Q.Q4_K
            raw[f"blk.{i}.{name}.weight"] = (fmt, blocks(fmt, rows, cols))
    write_tiny(
        path, tied=True, layers=layers, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv, raw_blocks=raw, context=2048
    )


MODES = {"gguf": {"gguf_weights": "native"}, "fp32": {"gguf_weights": "dequantize"}, "int8": {"quantization": "int8"}}


def llama_bench(binary: str, model: str, threads: int, timeout_s: float) -> dict[str, float]:
    out = subprocess.run(
        [binary, "-m", model, "-t", str(threads), "-p", "128", "-n", "128", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    ).stdout
    result = {}
    for row in json.loads(out):
        test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        result[test] = float(row["avg_ts"])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    ap.add_argument(
        "--kquant-model",
        choices=sorted(KQUANT_SHAPES),
        default=None,
        help="instead of --model: a random Llama of this size written as a Q4_K_M-like GGUF (Q4_K, Q6_K)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="gguf", help="comma-separated subset of " + ", ".join(MODES))
    args = ap.parse_args()

    import torch

    from kvflow import LLM
    from kvflow.models.default_model import default_model_path

    torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    if args.kquant_model:
        model = str(Path(tempfile.mkdtemp()) / f"kquant-{args.kquant_model}.gguf")
        write_kquant_model(args.kquant_model, model)
    modes = [m.strip() for m in args.modes.split(",")]
    llms = {m: LLM(model, max_model_len=1024, num_kv_blocks=64, enable_prefix_caching=False, **MODES[m]) for m in modes}
    first = llms[modes[0]]
    prompts = Prompts(first.tokenizer, seed=0)
    flags = (
        sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx", "amx", "fma", "f16c"))})
        if os.path.exists("/proc/cpuinfo")
        else []
    )
    print(
        f"# {cpu_name()} ({', '.join(flags)}), {args.threads} threads; torch {torch.__version__}; "
        f"Python {platform.python_version()}; model {Path(model).name}"
    )
    for m, llm in llms.items():
        runner = llm.engine.runner
        print(
            f"# kvflow {m}: linear backend {runner.linear_backend}, weights {runner.model.weight_bytes() / 1e6:.1f} MB"
        )

    for llm in llms.values():  # warm-up: first calls build caches and fault pages in
        decode_tok_s(llm, prompts.ids(8), 16)
        prefill_tok_s(llm, prompts.ids(128))
    runs: dict[str, list[float]] = {}
    for r in range(args.rounds):
        lc = llama_bench(args.llama_bench, model, args.threads, timeout_s=600)
        runs.setdefault("llama.cpp tg128", []).append(lc["tg128"])
        runs.setdefault("llama.cpp pp128", []).append(lc["pp128"])
        for m, llm in llms.items():
            runs.setdefault(f"kvflow {m} decode", []).append(decode_tok_s(llm, prompts.ids(8), 128))
            runs.setdefault(f"kvflow {m} prefill", []).append(prefill_tok_s(llm, prompts.ids(128)))
        print(f"# round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()), flush=True)

    med = {k: statistics.median(v) for k, v in runs.items()}
    print("\n| engine | batch-1 decode tok/s | vs llama.cpp tg128 | prefill (128 tokens) tok/s | vs llama.cpp pp128 |")
    print("|---|---|---|---|---|")
    print(
        f"| llama.cpp (llama-bench -t {args.threads}) | {med['llama.cpp tg128']:.1f} | | {med['llama.cpp pp128']:.1f} | |"
    )
    for m in modes:
        d, p = med[f"kvflow {m} decode"], med[f"kvflow {m} prefill"]
        print(
            f"| kvflow {m} | {d:.1f} | {d / med['llama.cpp tg128']:.2f}x | {p:.1f} | {p / med['llama.cpp pp128']:.2f}x |"
        )
    print(
        f"\n# medians of {args.rounds} rounds; every round: "
        + "; ".join(f"{k} " + "/".join(f"{x:.1f}" for x in v) for k, v in runs.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
