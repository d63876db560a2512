"""Decode tokens/s at several batch sizes: kvflow vs HF transformers `generate`, same weights,
same process, plus the batch-1 memory-bandwidth floor and the share of it each reaches.

    python benchmarks/decode_speed.py                      # ~100M random Llama (issue figures)
    python benchmarks/decode_speed.py --model default      # the embedded SmolLM2-135M GGUF

The floor: the bytes of weight one decode step reads over the best read bandwidth gauged (a torch
reduction over 512 MB, in 4 KB and in 2 MB pages). The host's bandwidth drifts, so batch 1 runs
`--rounds` times, each right after a gauge, and its fastest run is reported against the floor of
the best reading.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def random_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def _buffer(n: int, huge_pages: bool) -> torch.Tensor:
    """n floats of ones; with huge_pages, in 2 MB pages where THP is on request (as kvflow's packed
    weights are), so the gauge reads memory the way the kernels do."""
    if not huge_pages or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.ones(n)
    m = mmap.mmap(-1, n * 4 + (2 << 20))
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.float32)
    start = (-t.data_ptr() % (2 << 20)) // 4
    return t[start : start + n].fill_(1.0)


def read_bandwidth_gbs(size_mb: int = 512, reps: int = 5) -> tuple[float, float]:
    """(read GB/s via a reduction, copy GB/s counting bytes read) over a buffer far larger than L3,
    the best over 4 KB and 2 MB pages."""
    best_read = best_copy = float("inf")
    for huge_pages in (False, True):
        x = _buffer(size_mb * 2**20 // 4, huge_pages)
        y = torch.empty_like(x)
        x.sum(), y.copy_(x)
        for _ in range(reps):
            t = time.perf_counter()
            x.sum()
            best_read = min(best_read, time.perf_counter() - t)
            t = time.perf_counter()
            y.copy_(x)
            best_copy = min(best_copy, time.perf_counter() - t)
        nbytes = x.numel() * 4
        del x, y
    return nbytes / best_read / 1e9, nbytes / best_copy / 1e9


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every projection kernel, the lm_head and the norms
    (the embedding is a row lookup)."""
    from kvflow.layers.linear import Linear
    from kvflow.layers.norm import RMSNorm

    total = sum(m.kernel.nbytes for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head)
    total += model.logits_kernel.nbytes
    total += sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, RMSNorm))
    return total


def kvflow_decode(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    from kvflow import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, [(7 * i + j) % 1000 + 2 for j in range(prompt_len)], params)
    decode_time, decode_tokens = 0.0, 0
    while engine.has_unfinished_requests():
        all_decode = (
            all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)
            and not engine.scheduler.waiting
        )
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if all_decode:
            decode_time += dt
            decode_tokens += engine.scheduler.num_running + sum(o.finished for o in outs)
    return decode_tokens / decode_time


def hf_decode(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.tensor([[(7 * i + j) % 1000 + 2 for j in range(prompt_len)] for i in range(batch)])
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t_prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t_total = time.perf_counter() - t
    return batch * (new_tokens - 1) / (t_total - t_prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default=None,
        help="model path, or 'default' for the embedded GGUF (default: a random ~100M Llama made here)",
    )
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--rounds", type=int, default=3, help="batch-1 runs, each after a bandwidth gauge")
    args = ap.parse_args()

    from kvflow import LLM
    from kvflow.models.loader import load_hf_model

    tmp = None
    model = None if args.model == "default" else args.model
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        random_llama(tmp.name)
        model = tmp.name
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.prompt_len + args.new_tokens
    # float32 weights (a GGUF dequantized at load): the comparison is with HF on the same floats
    llm = LLM(
        model,
        max_model_len=max_len,
        num_kv_blocks=(max(batches) + 1) * (max_len // 16 + 1),
        max_num_seqs=max(batches),
        gguf_weights="dequantize",
    )
    hf = None if args.no_hf else load_hf_model(model)

    # The host's bandwidth drifts (other tenants; figures: docs/benchmarks/results/):
    # batch 1 runs `--rounds` times, each right after a bandwidth gauge, and the fastest run is set
    # against the floor from the best reading (the strictest floor).
    wbytes = weight_bytes_per_step(llm.engine.runner.model)
    print(
        f"threads {torch.get_num_threads()}, torch {torch.__version__}; weights read per decode step: "
        f"{wbytes / 1e6:.1f} MB"
    )
    gauges: list[tuple[float, float]] = []

    def floor_ms() -> float:
        return wbytes / (max(max(g) for g in gauges) * 1e9) * 1e3

    rows = []
    for b in batches:
        runs = []
        for _ in range(args.rounds if b == 1 else 1):
            if b == 1 or not gauges:
                gauges.append(read_bandwidth_gbs())
                print(f"bandwidth: read {gauges[-1][0]:.1f} GB/s, copy {gauges[-1][1]:.1f} GB/s", end="")
            runs.append(kvflow_decode(llm, b, args.prompt_len, args.new_tokens))
            if b == 1:
                print(f"; then batch 1: {runs[-1]:.1f} tok/s")
        ref = hf_decode(hf, b, args.prompt_len, args.new_tokens) if hf is not None else float("nan")
        rows.append((b, max(runs), ref))
    print(f"batch-1 floor {floor_ms():.2f} ms/step = {1e3 / floor_ms():.1f} tok/s (best bandwidth reading)")
    print(f"{'batch':>5} {'kvflow tok/s':>13} {'HF tok/s':>9} {'ratio':>6} {'kvflow % floor':>15} {'HF % floor':>11}")
    for b, ours, ref in rows:
        floor_tps = b * 1e3 / floor_ms()  # weights dominate at small batch; KV reads are ignored here
        print(
            f"{b:>5} {ours:>13.1f} {ref:>9.1f} {ours / ref:>6.2f} {100 * ours / floor_tps:>14.0f}% "
            f"{100 * ref / floor_tps:>10.0f}%"
        )


if __name__ == "__main__":
    main()
