"""kvflow against OpenVINO GenAI at matched precisions, offline, the same prompts, one after the other
on the same CPUs.

    python benchmarks/openvino_peer.py --ov-python /path/to/ov-venv/bin/python --ov-models DIR
        [--precisions fp32,bf16,int8,int4] [--rounds 3] [--batch 64] [--input-len 256] [--output-len 128]

OpenVINO GenAI (`openvino-genai` with `optimum-intel` and `nncf` in a virtualenv of its own, torch
pinned there too) runs models converted from the HF copy of the default model that
`benchmarks/serve_peers.py` writes (`--hf-dir`): `optimum-cli export openvino --model HF_DIR
--weight-format {fp32,int8,int4} --task text-generation-with-past DIR/{fp32,int8,int4}`, int4 with
`--group-size 32 --ratio 1.0` (made once by this script when missing; torchvision / torchaudio /
torchcodec uninstalled in that virtualenv, as for vLLM's). Its side runs in that virtualenv (`--worker`, this file again): an
`LLMPipeline` with a `SchedulerConfig` (continuous batching), `INFERENCE_PRECISION_HINT` f32 for
fp32 and int8 / int4 weights' activations where the matched kvflow path computes in float32, bf16
for bf16.

Matched precisions (weights / activations):
- fp32: kvflow on the HF copy, float32 / OpenVINO fp32 IR, f32;
- bf16: kvflow `--dtype bfloat16` on the HF copy / the fp32 IR with bf16 inference precision;
- int8: kvflow `--quantization int8` (W8A8, per-channel weights) / OpenVINO int8 weights (per
  channel), f32 activations;
- int4: kvflow's default (the GGUF's Q4_1 blocks, int8 activations) / OpenVINO int4 weights
  (asymmetric, groups of 32 as Q4_1's), f32 activations.

Per round and precision, kvflow then OpenVINO: `--batch` prompts of `--input-len` tokens at once,
`--output-len` tokens each (ignore EOS): output tok/s over the whole call; batch-1 decode tok/s (a
32-token prompt, `--output-len` tokens, less the time of 1 token); time to first token of one
512- and one 2,048-token prompt (max 1 new token). Medians over `--rounds` are printed side by
side. Prompts are random token ids decoded to text once, the same text for both.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PRECISIONS = ("fp32", "bf16", "int8", "int4")
IR_FORMAT = {"fp32": "fp32", "bf16": "fp32", "int8": "int8", "int4": "int4"}
HINT = {"fp32": "f32", "bf16": "bf16", "int8": "f32", "int4": "f32"}


def measure(run: Callable[[list[str], int], float], doc: dict, output_len: int) -> dict[str, float]:
    """Both engines' protocol over `run(prompts, new tokens) -> seconds`: a warm-up, the batch at
    once, batch-1 decode (less a 1-token run's time), then each long prompt once (a second run of
    the same prompt would be a prefix-cache hit)."""
    run(doc["short"][:1], 4)  # (compilation, first-call set-up)
    out = {}
    batch = doc["batch"]
    out["batched tok/s"] = len(batch) * output_len / run(batch, output_len)
    one = run(doc["short"][:1], 1)
    out["batch-1 decode tok/s"] = (output_len - 1) / max(1e-9, run(doc["short"][:1], output_len) - one)
    out["TTFT 512 s"] = run([doc["p512"]], 1)
    out["TTFT 2048 s"] = run([doc["p2048"]], 1)
    return out


# ---- OpenVINO's side (runs in its own virtualenv: imports nothing of kvflow) ---------------------
def worker(model_dir: str, precision: str, prompts_file: str, output_len: int) -> None:
    import openvino_genai as ov_genai

    doc = json.loads(Path(prompts_file).read_text())
    sched = ov_genai.SchedulerConfig()
    sched.cache_size = 4  # GB of KV, as the kvflow side's pool
    pipe = ov_genai.LLMPipeline(model_dir, "CPU", scheduler_config=sched, INFERENCE_PRECISION_HINT=HINT[precision])

    def run(prompts: list[str], new: int) -> float:
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.ignore_eos = new, new, True
        t0 = time.perf_counter()
        pipe.generate(prompts if len(prompts) > 1 else prompts[0], cfg)
        return time.perf_counter() - t0

    print("RESULT " + json.dumps(measure(run, doc, output_len)), flush=True)


# ---- kvflow's side -------------------------------------------------------------------------------
def make_prompts(tokenizer, batch: int, input_len: int) -> dict[str, list[str] | str]:
    import random

    rng = random.Random(0)
    vocab = [i for i in range(1000, tokenizer.vocab_size) if tokenizer.decode([i]).strip().isalpha()]

    def text(n: int) -> str:
        ids = [rng.choice(vocab) for _ in range(n)]
        return tokenizer.decode(ids)

    return {
        "batch": [text(input_len) for _ in range(batch)],
        "short": [text(32)],
        "p512": text(512),
        "p2048": text(2048),
    }


def kvflow_engine(precision: str, hf_dir: Path):
    from kvflow import LLM

    common = dict(kv_cache_memory_gb=4, max_model_len=4096)
    if precision == "int4":
        return LLM(**common)  # the default: the GGUF's Q4_1 blocks
    return LLM(
        str(hf_dir),
        dtype="bfloat16" if precision == "bf16" else "float32",
        quantization="int8" if precision == "int8" else None,
        **common,
    )


def kvflow_measure(llm, doc: dict, output_len: int) -> dict[str, float]:
    from kvflow import SamplingParams

    def run(prompts: list[str], new: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    return measure(run, doc, output_len)


def convert(ov_python: str, hf_dir: Path, out: Path, fmt: str) -> None:
    if (out / "openvino_model.xml").exists():
        return
    cli = str(Path(ov_python).parent / "optimum-cli")
    cmd = [cli, "export", "openvino", "--model", str(hf_dir), "--weight-format", fmt]
    if fmt == "int4":  # groups of 32 with a scale and an offset each, as Q4_1's blocks; every layer
        cmd += ["--group-size", "32", "--ratio", "1.0"]
    subprocess.run([*cmd, "--task", "text-generation-with-past", str(out)], check=True)


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ov-python", required=True, help="python of the virtualenv with openvino-genai")
    ap.add_argument("--ov-models", type=Path, required=True, help="where the converted models are (made once)")
    ap.add_argument("--hf-dir", type=Path, default=Path.home() / ".cache" / "kvflow" / "hf-default-model")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_peers import write_hf_copy

    from kvflow.bench.report import cpu_line

    precisions = args.precisions.split(",")
    if bad := set(precisions) - set(PRECISIONS):
        ap.error(f"unknown precisions {sorted(bad)}; choose from {', '.join(PRECISIONS)}")
    if not (args.hf_dir / "config.json").exists():
        write_hf_copy(args.hf_dir)
    for fmt in sorted({IR_FORMAT[p] for p in precisions}):
        convert(args.ov_python, args.hf_dir, args.ov_models / fmt, fmt)
    from transformers import AutoTokenizer

    doc = make_prompts(AutoTokenizer.from_pretrained(str(args.hf_dir)), args.batch, args.input_len)
    prompts_file = args.ov_models / "prompts.json"
    prompts_file.write_text(json.dumps(doc))
    print(cpu_line(), flush=True)
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd in range(1, args.rounds + 1):
        for p in precisions:
            llm = kvflow_engine(p, args.hf_dir)
            got = kvflow_measure(llm, doc, args.output_len)
            llm.shutdown()
            del llm
            results.setdefault(("kvflow", p), []).append(got)
            print(f"round {rnd} {p} kvflow: {json.dumps({k: round(v, 3) for k, v in got.items()})}", flush=True)
            cmd = [args.ov_python, __file__, "--worker", str(args.ov_models / IR_FORMAT[p]), p, str(prompts_file)]
            proc = subprocess.run([*cmd, str(args.output_len)], capture_output=True, text=True, check=True)
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
            got = json.loads(line.removeprefix("RESULT "))
            results.setdefault(("openvino", p), []).append(got)
            print(f"round {rnd} {p} openvino: {json.dumps({k: round(v, 3) for k, v in got.items()})}", flush=True)
    metrics = list(next(iter(results.values()))[0])
    print("\n| precision | metric | kvflow | OpenVINO GenAI | kvflow / OpenVINO (higher is better) |")
    print("|---|---|---|---|---|")
    for p in precisions:
        for m in metrics:
            k = statistics.median(r[m] for r in results["kvflow", p])
            o = statistics.median(r[m] for r in results["openvino", p])
            ratio = o / k if m.endswith(" s") else k / o  # (a time: lower is better)
            print(f"| {p} | {m} | {k:.3f} | {o:.3f} | {ratio:.2f}x |")
    print(f"(medians of {args.rounds} rounds; every round above)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5], int(sys.argv[5]))
        sys.exit(0)
    sys.exit(main())
