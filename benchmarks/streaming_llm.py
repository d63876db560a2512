"""StreamingLLM: perplexity of the default model over a text far longer than its context, per
512-token window of the text, with attention sinks + a recent window vs the window alone (the
StreamingLLM paper's collapse: evicting the first tokens ruins attention) vs dense attention
re-computed over the last max_model_len tokens for every block (the paper's quality reference: what
the text costs the model with a full context, at O(context) work per block).

The text: licence, README and metadata files shipped in the installed packages (no download). It is
teacher-forced through the engine's own pieces, one KV block (16 tokens) per step: the model
runner's forward pass over its paged KV cache, the sink policy (kvflow.core.attention_sinks, the
same `plan` the scheduler calls) dropping whole blocks, and the runner's key re-rotation
(kvflow.worker.kv_rerotate) rolling positions inside the cache. The log-probability of every next
text token comes from the logits of every row of the step.

    python benchmarks/streaming_llm.py                          # context 512, 4096 text tokens
    python benchmarks/streaming_llm.py --context 256 --tokens 2048
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def shipped_text(min_chars: int) -> str:
    """Licence, README and METADATA files of the installed packages, concatenated (sorted: the same
    text every run on the same environment)."""
    site = [p for p in sys.path if p.endswith("site-packages")]
    files: list[str] = []
    for root in site:
        for pattern in ("*.dist-info/LICENSE*", "*.dist-info/licenses/*", "*.dist-info/METADATA", "*/README*"):
            files.extend(glob.glob(os.path.join(root, pattern)))
    parts, size = [], 0
    for path in sorted(set(files)):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        size += len(text)
        if size >= min_chars:
            break
    return "\n\n".join(parts)


def score(runner, ids: list[int], mode: str, context: int, sinks: int, block_size: int) -> list[float]:
    """Negative log-likelihood of ids[1:] (one per predicted token), the text teacher-forced
    block by block. mode: recompute (each block scored by a fresh dense pass over the `context`
    tokens that end with it: StreamingLLM's "sliding window with re-computation", the quality
    reference at O(context) work per block), sinks (`sinks` sink tokens + the rest of the context as
    the window) or window (no sinks, the whole context as the window)."""
    import torch

    from kvflow.core.attention_sinks import StreamingKV
    from kvflow.worker.kv_rerotate import KeyRerotation

    policy = None
    if mode in ("sinks", "window"):
        policy = StreamingKV.create(sinks if mode == "sinks" else 0, None, block_size, context)
    rotary = runner.model.rotary
    rerotate = KeyRerotation(rotary.cos, rotary.sin_signed, runner.model.cfg.head_dim)
    free = list(range(runner.kv_caches[0].data.shape[0]))
    table: list[int] = []
    nll: list[float] = []
    done, cache_len = 0, 0
    limit = len(ids) - 1
    with torch.inference_mode():
        while mode == "recompute" and done < limit:
            n = min(block_size, limit - done)
            start = max(0, done + n - context)
            span = ids[start : done + n]
            blocks = free[: -(-len(span) // block_size)]
            hidden = runner.run_model([span], [0], [blocks])
            logits = runner.model.compute_logits(hidden[-n:]).float()
            target = torch.tensor(ids[done + 1 : done + n + 1])
            nll.extend((-logits.log_softmax(-1).gather(1, target[:, None])[:, 0]).tolist())
            done += n
        while done < limit:
            n = min(block_size, limit - done)
            if policy is not None:
                drop, n = policy.plan(cache_len, n)
                if drop:
                    start = policy.sink_blocks
                    free.extend(table[start : start + drop])
                    del table[start : start + drop]
                    rerotate.apply_(runner.kv_caches, table[start:], drop * block_size)
                    cache_len -= drop * block_size
            while len(table) * block_size < cache_len + n:
                table.append(free.pop(0))
            hidden = runner.run_model([ids[done : done + n]], [cache_len], [table])
            logits = runner.model.compute_logits(hidden).float()
            target = torch.tensor(ids[done + 1 : done + n + 1])
            nll.extend((-logits.log_softmax(-1).gather(1, target[:, None])[:, 0]).tolist())
            done += n
            cache_len += n
    return nll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--context", type=int, default=512, help="max_model_len: the cache never holds more")
    ap.add_argument("--tokens", type=int, default=4096, help="text tokens to score")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window-tokens", type=int, default=512, help="perplexity reported per this many text tokens")
    ap.add_argument("--gguf-weights", default="native", choices=("native", "dequantize"))
    args = ap.parse_args()

    from kvflow import LLM

    block_size = 16
    llm = LLM(
        model=args.model,
        max_model_len=args.context,
        block_size=block_size,
        num_kv_blocks=-(-args.context // block_size) + 2,
        enable_prefix_caching=False,
        gguf_weights=args.gguf_weights,
    )
    engine = llm.engine
    runner = engine.runner
    text = shipped_text(args.tokens * 6)
    ids = engine.tokenize(text, True)[: args.tokens + 1]
    if len(ids) < args.tokens + 1:
        raise SystemExit(f"only {len(ids)} tokens of shipped text found; lower --tokens")
    print(f"model {engine.model_name}; context (max_model_len) {args.context}; text {len(ids) - 1} tokens scored")

    results = {}
    for mode in ("recompute", "sinks", "window"):
        t = time.perf_counter()
        results[mode] = score(runner, ids, mode, args.context, args.sinks, block_size)
        print(f"{mode}: {len(results[mode])} tokens in {time.perf_counter() - t:.1f} s", flush=True)

    w = args.window_tokens
    labels = {
        "recompute": f"dense over the last {args.context} (re-computed)",
        "sinks": f"{args.sinks} sinks + window {args.context - block_size * -(-args.sinks // block_size)}",
        "window": f"window {args.context} alone",
    }
    print()
    print(f"| text tokens | {' | '.join(labels[m] for m in results)} |")
    print("|---|" + "---|" * len(results))
    for lo in range(0, args.tokens, w):
        cells = []
        for mode in results:
            chunk = results[mode][lo : lo + w]
            cells.append(f"{math.exp(sum(chunk) / len(chunk)):.2f}" if len(chunk) == min(w, args.tokens - lo) else "-")
        print(f"| {lo}-{min(lo + w, args.tokens)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
