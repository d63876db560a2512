"""KV capacity with and without the hybrid saving: Gemma-3-shaped configs (five local layers with a
1024-token window to one global layer), one pool of bytes, 8k-token requests.

Two figures per config, both from kvflow's own bookkeeping (no tensors, no model: the KV cache
manager and the scheduler are pure bookkeeping):

- static: 8k-token requests that fit in the pool at once while they decode (each holding its 8k
  context: the full-attention blocks plus each window group's last window), the tokens that makes,
  and the same at the worst moment of a request's life (the prefill chunk that reaches 8k tokens
  also holds the chunk's span in every window group) (kvflow.core.kv_groups.requests_that_fit, what
  the start-up log reports);
- served: the real scheduler (chunked prefill, `--max-num-batched-tokens`) run over a queue of
  8k-token requests (prompt + generated tokens = 8192), a fake model answering every sampled row;
  the most requests running at once, and the preemptions on the way. With few generated tokens the
  queue drains faster than memory fills (prefill paces it), so the default generates 1024.

    python benchmarks/kv_capacity.py                   # 8 GiB pool, bf16 KV, block 16, budget 2048
    python benchmarks/kv_capacity.py --pool-gib 4 --requests 40

Figures: docs/benchmarks/results/2026-12-03-kv-capacity.md.
"""

from __future__ import annotations

import argparse
import random
import time

from kvflow.config import ModelConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_groups import kv_layout, requests_that_fit
from kvflow.core.request import Request, RequestStatus
from kvflow.core.scheduler import Scheduler
from kvflow.sampling_params import SamplingParams

# (name, layers, kv heads, head_dim): Gemma 3 text models' attention shapes (HF configs), window 1024
SHAPES = [
    ("gemma-3-1b-shaped", 26, 1, 256),
    ("gemma-3-4b-shaped", 34, 4, 256),
    ("gemma-3-12b-shaped", 48, 8, 256),
    ("gemma-3-27b-shaped", 62, 16, 128),
]
WINDOW = 1024


def gemma3_config(layers: int, kv_heads: int, head_dim: int) -> ModelConfig:
    windows = tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(layers))
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=262_144,
        hidden_size=kv_heads * head_dim,
        intermediate_size=1,
        num_layers=layers,
        num_heads=kv_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=131_072,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        sliding_window=WINDOW,
        layer_windows=windows,
    )


def serve(mc: ModelConfig, hybrid: bool, pool_bytes: int, args, num_requests: int) -> dict:
    layout = kv_layout(mc, disable_hybrid=not hybrid)
    bs = args.block_size
    layer_block_bytes = bs * 2 * mc.num_kv_heads * mc.head_dim * 2  # bf16
    num_blocks = pool_bytes // (layer_block_bytes * layout.slots)
    usable = num_blocks - layout.frees_blocks
    chunk = min(args.budget, args.tokens)
    fit = requests_that_fit(layout, usable, args.tokens, bs, 1)
    fit_prefill = requests_that_fit(layout, usable, args.tokens, bs, chunk)

    kv = KVCacheManager(num_blocks, bs, enable_caching=True, layout=layout)
    sched = Scheduler(kv, args.budget, max_num_seqs=1024)
    rng = random.Random(0)
    gen = args.gen_tokens
    for i in range(num_requests):
        prompt = [rng.randrange(262_000) for _ in range(args.tokens - gen)]
        params = SamplingParams(max_tokens=gen, ignore_eos=True)
        sched.add_request(Request(f"r{i}", f"r{i}", 0, prompt, params, gen, 0.0))
    peak = done = steps = 0
    t0 = time.perf_counter()
    while sched.has_unfinished():
        out = sched.schedule()
        steps += 1
        decoding = sum(1 for r in sched.running if r.status == RequestStatus.RUNNING)
        peak = max(peak, decoding)
        sampled = {s.request_id: [rng.randrange(262_000)] for s in out.seqs if s.sample}
        _, finished = sched.update_from_output(out, sampled)
        done += len(finished)
    kv.pool.check_consistency()
    assert kv.pool.num_free_blocks == num_blocks - layout.frees_blocks, "blocks leaked"
    return dict(
        blocks=num_blocks,
        block_layers=layout.slots,
        fit=fit,
        fit_prefill=fit_prefill,
        tokens=fit * args.tokens,
        peak=peak,
        preemptions=sched.num_preemptions,
        served=done,
        steps=steps,
        seconds=time.perf_counter() - t0,
    )


def _static_fit(mc: ModelConfig, pool_bytes: int, args) -> int:
    layout = kv_layout(mc)
    page = args.block_size * 2 * mc.num_kv_heads * mc.head_dim * 2 * layout.slots
    return requests_that_fit(layout, pool_bytes // page - 1, args.tokens, args.block_size, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-gib", type=float, default=8.0, help="KV pool, GiB (bf16 KV)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per request (prompt + generated)")
    ap.add_argument("--gen-tokens", type=int, default=1024, help="generated tokens per request")
    ap.add_argument(
        "--requests", type=int, default=0, help="requests in the served run's queue (0: twice what fits with windows)"
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = ap.parse_args()
    pool = int(args.pool_gib * 2**30)
    wanted = args.shapes.split(",")
    print(
        f"pool {args.pool_gib} GiB bf16 KV, block {args.block_size}, window {WINDOW}, {args.tokens}-token requests "
        f"({args.gen_tokens} generated), prefill chunks of {args.budget}; served: a queue of "
        f"{args.requests or 'twice the hybrid fit'} requests"
    )
    head = (
        f"{'config':<20} {'KV':<7} {'blocks':>7} {'layers/blk':>10} {'fit 8k':>7} {'ratio':>6} {'tokens':>9} "
        f"{'fit@prefill':>11} {'ran at once':>11} {'ratio':>6} {'preempt':>8} {'served':>7}"
    )
    print(head)
    for name, layers, kv_heads, head_dim in SHAPES:
        if name not in wanted:
            continue
        mc = gemma3_config(layers, kv_heads, head_dim)
        n = args.requests or 2 * _static_fit(mc, pool, args)
        full = serve(mc, False, pool, args, n)
        hyb = serve(mc, True, pool, args, n)
        for label, r in (("full", full), ("hybrid", hyb)):
            ratio = r["fit"] / full["fit"] if full["fit"] else float("inf")
            ran = r["peak"] / full["peak"] if full["peak"] else float("inf")
            print(
                f"{name:<20} {label:<7} {r['blocks']:>7} {r['block_layers']:>10} {r['fit']:>7} {ratio:>5.2f}x "
                f"{r['tokens']:>9} {r['fit_prefill']:>11} {r['peak']:>11} {ran:>5.2f}x {r['preemptions']:>8} "
                f"{r['served']:>7}"
            )


if __name__ == "__main__":
    main()
