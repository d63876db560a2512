"""Prefill once: one long document, questions arriving over time, a main KV pool too small to
keep the document between them (unrelated traffic evicts it). TTFT of the questions with no
offload tier, a CPU tier, a disk tier, and the disk tier after an engine restart.

    python benchmarks/long_document.py                 # default model, 4000-token document
    python benchmarks/long_document.py --questions 8   # quicker
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(
    label: str,
    llm_kwargs: dict,
    doc: list[int],
    questions: list[list[int]],
    fillers: list[list[int]],
    answer_tokens: int,
    persist: bool = False,
) -> dict:
    from kvflow import LLM, SamplingParams

    llm = LLM(**llm_kwargs)
    answer = SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True)
    filler = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttfts, cached = [], []
    for q, f in zip(questions, fillers):
        out = llm.generate([doc + q], answer, use_tqdm=False)[0]
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        cached.append(out.num_cached_tokens)
        llm.generate([f], filler, use_tqdm=False)  # unrelated traffic pushes the document out
    stats = llm.get_stats()
    if persist:
        llm.shutdown()
    off = stats.kv_offload
    return {
        "label": label,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_first": ttfts[0],
        "ttft_rest": statistics.mean(ttfts[1:]) if len(ttfts) > 1 else float("nan"),
        "cached_mean": statistics.mean(cached),
        "loaded": off.loaded if off else 0,
        "cpu_hits": off.cpu.hits if off else 0,
        "disk_hits": off.disk.hits if off else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--doc-tokens", type=int, default=4000)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--filler-tokens", type=int, default=4000)
    ap.add_argument("--pool-blocks", type=int, default=320, help="main KV pool (16-token blocks)")
    args = ap.parse_args()

    rng = random.Random(0)
    doc = tokens(rng, args.doc_tokens)
    questions = [tokens(rng, args.question_tokens) for _ in range(args.questions)]
    fillers = [tokens(rng, args.filler_tokens) for _ in range(args.questions)]
    base = dict(
        model=args.model,
        max_model_len=args.doc_tokens + args.question_tokens + args.answer_tokens + 16,
        num_kv_blocks=args.pool_blocks,
    )
    doc_gb = 1.2 * args.doc_tokens * 46080 / 2**30  # room for the document in a tier (default model)
    disk = tempfile.mkdtemp(prefix="kvflow-disk-tier-")
    results = [
        run("no tier", base, doc, questions, fillers, args.answer_tokens),
        run("CPU tier", {**base, "kv_offload_cpu_gb": max(doc_gb, 0.5)}, doc, questions, fillers, args.answer_tokens),
        run(
            "disk tier",
            {**base, "kv_offload_disk_dir": disk},
            doc,
            questions,
            fillers,
            args.answer_tokens,
            persist=True,
        ),
        run(
            "disk tier after restart",
            {**base, "kv_offload_disk_dir": disk},
            doc,
            questions,
            fillers,
            args.answer_tokens,
        ),
    ]
    print(
        f"document {args.doc_tokens} tokens, {args.questions} questions of {args.question_tokens} tokens, "
        f"{args.filler_tokens} filler tokens between questions, main pool {args.pool_blocks} x 16 tokens"
    )
    print(
        f"{'tier':<24} {'TTFT mean s':>11} {'1st q s':>8} {'later q s':>9} {'cached tok':>10} "
        f"{'blocks loaded':>13} {'cpu hits':>8} {'disk hits':>9}"
    )
    for r in results:
        print(
            f"{r['label']:<24} {r['ttft_mean']:>11.3f} {r['ttft_first']:>8.3f} {r['ttft_rest']:>9.3f} "
            f"{r['cached_mean']:>10.0f} {r['loaded']:>13} {r['cpu_hits']:>8} {r['disk_hits']:>9}"
        )


if __name__ == "__main__":
    main()
