"""Tensor parallelism on this machine: decode throughput of TP = 1 (all threads in one process) vs
TP = N (one worker process per rank, the cores split between them), and the all-reduce's share.

    python benchmarks/tensor_parallel.py [--model default|random-500m|PATH] [--tp 2] [--batches 1,8,32]
        [--prompt-len 32] [--decode-steps 48]

For each batch size B: B distinct random prompts of --prompt-len tokens are prefilled (untimed),
then --decode-steps decode steps are timed (greedy, ignore_eos). Decode tok/s = B x steps / time.
Under TP the time rank 0 spends in all-reduces (including waiting for the other ranks to arrive)
is measured by wrapping its TPGroup.all_reduce. `random-500m` is a randomly initialised Llama of
~440M parameters (hidden 1280, 20 layers, 20 heads / 4 KV heads, FFN 3584, vocab 32000) written to
a temporary folder; `default` is the embedded SmolLM2-135M (9 heads, 3 KV heads: TP must divide 3).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from kvflow import LLM, SamplingParams
from kvflow.distributed.parallel import TPGroup


def random_llama(path: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1280,
        intermediate_size=3584,
        num_hidden_layers=20,
        num_attention_heads=20,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return path


def cpu_line() -> str:
    import subprocess

    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    have = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in flags]
    return f"{name}; {', '.join(have) or 'no avx2'}"


class AllReduceTimer:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._orig = TPGroup.all_reduce

    def __enter__(self) -> AllReduceTimer:
        timer, orig = self, self._orig

        def timed(group, t):
            t0 = time.perf_counter()
            out = orig(group, t)
            timer.seconds += time.perf_counter() - t0
            timer.calls += 1
            return out

        TPGroup.all_reduce = timed
        return self

    def __exit__(self, *exc) -> None:
        TPGroup.all_reduce = self._orig


def decode_rate(
    llm: LLM, ar: AllReduceTimer, batch: int, prompt_len: int, steps: int, vocab: int, seed: int
) -> tuple[float, float, int]:
    """(decode tok/s, all-reduce seconds per step, steps timed)."""
    rng = random.Random(seed)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [rng.randrange(10, vocab) for _ in range(prompt_len)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token), untimed
    ar.seconds = 0.0
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    seconds = time.perf_counter() - t0
    return batch * n / seconds, ar.seconds / max(n, 1), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random-500m", help="default | random-500m | a model folder or .gguf")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size to compare with 1 (default 2)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=48)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = None if args.model == "default" else args.model
    if args.model == "random-500m":
        model = random_llama(tempfile.mkdtemp(prefix="kvflow-tp-bench-"))
    print(f"CPU: {cpu_line()}")
    rows = []
    for tp in (1, args.tp):
        timer = AllReduceTimer().__enter__()  # before the model: its row-parallel layers keep the method
        # float32 on every TP size (ranks shard float weights; a GGUF is dequantized for both)
        llm = LLM(model, tensor_parallel_size=tp, max_model_len=512, kv_cache_memory_gb=1.0, gguf_weights="dequantize")
        timer.__exit__()
        vocab = llm.engine.model_config.vocab_size
        decode_rate(llm, timer, 2, args.prompt_len, 4, vocab, seed=99)  # warm-up
        for b in batches:
            rate, ar, n = decode_rate(llm, timer, b, args.prompt_len, args.decode_steps, vocab, seed=b)
            step = b / rate
            rows.append((tp, b, rate, step * 1000, ar * 1000, 100 * ar / step if step else 0.0))
            print(
                f"TP={tp} batch={b}: {rate:.1f} tok/s, {step * 1000:.1f} ms/step, all-reduce "
                f"{ar * 1000:.2f} ms/step ({100 * ar / step:.1f}%) over {n} steps",
                flush=True,
            )
        llm.shutdown()
    print(f"\nmodel: {args.model}; prompt {args.prompt_len} tokens, {args.decode_steps} decode steps timed")
    print(f"{'TP':>3} {'batch':>5} {'tok/s':>8} {'ms/step':>8} {'allreduce ms':>12} {'share':>6} {'vs TP=1':>7}")
    base = {b: rate for tp, b, rate, *_ in rows if tp == 1}
    for tp, b, rate, step, ar, share in rows:
        print(f"{tp:>3} {b:>5} {rate:>8.1f} {step:>8.1f} {ar:>12.2f} {share:>5.1f}% {rate / base[b]:>6.2f}x")


if __name__ == "__main__":
    main()
