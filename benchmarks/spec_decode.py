"""Speculative decoding on the default model: decode tok/s with and without it, in one process.

    python benchmarks/spec_decode.py [--batches 1,8,32] [--max-tokens 128] [--k 4[,8]] [--rounds 3]
        [--gguf-weights native|dequantize]   # dequantize: the float32 path

Workloads: `chat` (open-ended questions) and `grounded` (repeat / lightly edit a given passage,
where prompt lookup finds the continuation in the prompt); greedy, each answer ending at EOS or
--max-tokens. Methods: prompt lookup (`ngram`) and the model's own int8 copy as the draft
(`int8 draft`), each adaptive and with a fixed speculation length. For every batch size and workload it
runs plain decoding, then each method, greedy, and prints decode tok/s (tokens after each
request's first one, over the time from the first first-token to the last token), the speed-up,
the mean acceptance length, per-position acceptance, and measured tokens per target pass next to
(1 - a^(k+1)) / (1 - a) at the measured acceptance rate a. Outputs are checked identical to plain
decoding's.

`--bound` adds, per batch and workload, the ceiling of any prompt-lookup policy on this machine:
an oracle that gives each request, at each step, exactly the drafts that will be accepted (up to
the largest --k; none where the lookup finds nothing), run through the greedy outputs of plain
decoding with each step timed as the steps of as many rows took in this run (median by row count;
a straight-line fit where none ran). The same simulation of each fixed k is printed beside it, to
compare with the measured fixed-k speed-ups, and the same oracle over the best copy from any
earlier occurrence of each token (what no choice of n-gram or occurrence can beat).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

import numpy as np

from kvflow import LLM, SamplingParams
from kvflow.engine.step_records import DECODE, VERIFY
from kvflow.spec_decode.ngram_proposer import NgramProposer

PASSAGE = (
    "The KV cache is the centre of an inference engine. Each request keeps the keys and values of "
    "every token it has seen, so that the next token attends to them without recomputing them. "
    "Paging splits this memory into fixed-size blocks, so that requests of any length share one pool "
    "without fragmentation, and blocks with the same content can be shared between requests."
)
CODE = (
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
    "    return total / len(values)\n"
)
PASSAGE2 = (
    "A scheduler decides, at every step, which requests run and how many of their tokens. Decodes "
    "come first, one token each; prefill chunks fill what is left of the token budget. When memory "
    "runs out, the most recent request is preempted and recomputed later from its tokens."
)
CODE2 = (
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n"
    "        self.counts[key] = self.counts.get(key, 0) + 1\n\n    def top(self, n):\n"
    "        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]\n"
)
# Tasks whose answer is mostly in the prompt. (Asking SmolLM2-135M to quote sentences out of order
# or to add docstrings gets new text instead, which prompt lookup barely speeds up; figures:
# docs/benchmarks/results/.)
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this code with the function `mean` renamed to `average`, changing nothing else:\n\n{CODE}",
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE2}",
    f"Copy this code exactly:\n\n{CODE2}",
]
CHAT = [
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea.",
    "Explain how a bicycle works to a child.",
    "Give me three tips for learning to cook.",
]


def run(llm: LLM, prompts: list[str], batch: int, max_tokens: int) -> tuple[list[list[int]], float, list[list[int]]]:
    """All prompts, `batch` at a time: their output tokens, decode tok/s over the groups' decode
    phases, and their prompts' tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens, decoded, seconds, prompt_ids = [], 0, 0.0, []
    for i in range(0, len(prompts), batch):
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts[i : i + batch]], params, use_tqdm=False)
        seconds += max(o.metrics.last_token_time for o in outs) - min(o.metrics.first_token_time for o in outs)
        decoded += sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        tokens += [o.outputs[0].token_ids for o in outs]
        prompt_ids += [list(o.prompt_token_ids) for o in outs]
    return tokens, decoded / seconds, prompt_ids


def step_times(llm: LLM, first: int) -> list[tuple[int, float]]:
    """(rows, seconds) of the engine's recorded steps from index `first` that only decoded or verified."""
    return [
        (sum(n for _, _, n, _, _ in r.seqs), r.duration_s)
        for r in llm.engine.step_records.steps
        if r.index >= first and r.seqs and all(kind in (DECODE, VERIFY) for _, kind, _, _, _ in r.seqs)
    ]


def copy_accepted(prompt: list[int], out: list[int], k_max: int) -> list[tuple[int, int]]:
    """Per output token t, (k_max, n): n the most tokens after t (at most k_max) that any earlier
    occurrence of token t in the sequence is followed by. Prompt lookup copies from an occurrence
    of the sequence's last n-gram, so no lookup policy, whichever occurrence it picks, drafts more
    accepted tokens than this."""
    row = []
    for t in range(len(out)):
        seq = prompt + list(out[: t + 1])
        want = out[t + 1 : t + 1 + k_max]
        best = 0
        for j in range(len(seq) - 1):
            if seq[j] != seq[-1]:
                continue
            n = 0
            while n < len(want) and j + 1 + n < len(seq) and seq[j + 1 + n] == want[n]:
                n += 1
            best = max(best, n)
        row.append((k_max, best))
    return row


class Bound:
    """Speculation replayed over fixed greedy outputs: `accepted[i][t]` is how many of the drafts
    prompt lookup proposes after output token t of request i (at most k_max) match the tokens that
    follow; a step's time is what steps of as many rows took (`times`)."""

    def __init__(
        self,
        prompts: list[list[int]],
        outputs: list[list[int]],
        lookup: tuple[int, int],
        k_max: int,
        times: list[tuple[int, float]],
    ) -> None:
        proposer = NgramProposer(lookup[0], lookup[1], k_max)
        self.accepted = []
        self.copyable = []  # the same for the best copy any lookup could make (see `copy_accepted`)
        for prompt, out in zip(prompts, outputs):
            row = []
            for t in range(len(out)):
                drafts = proposer.propose(prompt + list(out[: t + 1]))
                n = 0
                while n < len(drafts) and t + 1 + n < len(out) and drafts[n] == out[t + 1 + n]:
                    n += 1
                row.append((len(drafts), n))
            self.accepted.append(row)
            self.copyable.append(copy_accepted(prompt, out, k_max))
        by_rows: dict[int, list[float]] = {}
        for rows, seconds in times:
            by_rows.setdefault(rows, []).append(seconds)
        self.median = {r: statistics.median(v) for r, v in by_rows.items() if len(v) >= 3}
        x = np.array([r for r, _ in times], dtype=np.float64)
        y = [s for _, s in times] or [0.0]
        # A straight line through the steps where they ran at several row counts, else their median.
        self.fit = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (0.0, statistics.median(y))

    def seconds(self, rows: int) -> float:
        return self.median[rows] if rows in self.median else float(np.polyval(self.fit, rows))

    def replay(self, batch: int, drafts, table: list[list[tuple[int, int]]] | None = None) -> float:
        """Seconds to decode every output, `batch` requests at a time as `run` does; drafts(found,
        accepted) is how many drafts a request gets where lookup found `found` of which `accepted` match
        (per `table`: `accepted` unless given, e.g. `copyable`)."""
        table = self.accepted if table is None else table
        total = 0.0
        for g in range(0, len(table), batch):
            group = table[g : g + batch]
            at = [0] * len(group)
            while any(a < len(req) for a, req in zip(at, group)):
                rows, moves = 0, []
                for i, req in enumerate(group):
                    if at[i] >= len(req):
                        continue
                    found, ok = req[at[i]]
                    k = min(drafts(found, ok), found, len(req) - at[i] - 1)
                    rows += 1 + k
                    moves.append((i, 1 + min(k, ok)))
                total += self.seconds(rows)
                for i, n in moves:
                    at[i] += n
        return total


def cpu_line(quantization: str | None) -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_line = next((ln for ln in flags.splitlines() if "Model name" in ln), "").split(":")[-1].strip()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f" {f} " in flags + " "]
    return f"CPU: {model_line}; {', '.join(isa)}; quantization: {quantization}"


def _counts(llm: LLM) -> list[int]:
    """Cumulative: generated tokens, (request, pass) pairs, drafts, draft tokens, accepted, per position."""
    st, spec = llm.engine.get_stats(), llm.engine.speculator
    head = [st.generation_tokens_total, st.sampling_rows_total]
    if spec is None:
        return head + [0, 0, 0]
    s = spec.stats
    return head + [s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, *s.accepted_per_pos]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", default="4", help="num_speculative_tokens; several (4,8): each method at each, interleaved")
    ap.add_argument("--quantization", default=None)
    ap.add_argument(
        "--gguf-weights",
        choices=("native", "dequantize"),
        default="native",
        help="the default GGUF's blocks as stored (native) or float32 (dequantize: the float32 path)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are printed")
    ap.add_argument("--lookup", default="2,4", help="ngram prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--workloads", default="grounded,chat")
    ap.add_argument("--methods", default="ngram,int8", help="besides none: ngram, int8 (self-draft)")
    ap.add_argument("--bound", action="store_true", help="also the oracle ceiling of prompt lookup (see above)")
    args = ap.parse_args()
    print(cpu_line(args.quantization) + f"; gguf weights: {args.gguf_weights}")
    common = dict(
        quantization=args.quantization,
        gguf_weights=args.gguf_weights,
        max_model_len=2048,
        num_kv_blocks=1024,
        step_record_capacity=1 << 16 if args.bound else 0,
    )
    lo, hi = (int(x) for x in args.lookup.split(","))
    ngram = {"method": "ngram", "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    ks = [int(x) for x in args.k.split(",")]
    methods: dict[str, dict | None] = {"none": None}
    for k in ks:
        tag = f" k={k}" if len(ks) > 1 else ""
        for name, cfg in (("ngram", ngram), ("int8", {"method": "draft_model", "quantization": "int8"})):
            if name not in args.methods.split(","):
                continue
            label = "ngram" if name == "ngram" else "int8 draft"
            methods[label + tag] = {**cfg, "num_speculative_tokens": k}
            methods[label.split()[0] + tag + " fixed"] = {**cfg, "num_speculative_tokens": k, "adaptive": False}
    engines = {name: LLM(speculative_config=cfg, **common) for name, cfg in methods.items()}
    print(
        f"{'workload':9} {'batch':>5} {'method':16} {'tok/s':>8} {'x':>6} {'accept len':>10} "
        f"{'alpha':>6} {'tok/pass':>8} {'formula':>8}  per-position acceptance"
    )
    for workload in args.workloads.split(","):
        base_prompts = GROUNDED if workload == "grounded" else CHAT
        for b in (int(x) for x in args.batches.split(",")):
            prompts = [base_prompts[i % len(base_prompts)] for i in range(max(b, len(base_prompts)))]
            speeds: dict[str, list[float]] = {name: [] for name in engines}
            totals: dict[str, list[int]] = {}
            outputs: dict[str, list[list[int]]] = {}
            times: list[tuple[int, float]] = []  # (rows, seconds) of every engine's decode / verify steps
            for _ in range(args.rounds):  # methods interleaved, so host drift hits them alike
                for name, llm in engines.items():
                    run(llm, prompts[:1], 1, 4)  # warm-up (kernels, caches)
                    before, first_step = _counts(llm), llm.engine.step_records.next_index
                    tokens, speed, prompt_ids = run(llm, prompts, b, args.max_tokens)
                    if args.bound:
                        times += step_times(llm, first_step)
                    speeds[name].append(speed)
                    outputs[name] = tokens
                    after = _counts(llm)
                    totals[name] = [x + (y - z) for x, y, z in zip(totals.get(name, [0] * len(after)), after, before)]
            ref = statistics.median(speeds["none"])
            for name in engines:
                speed = statistics.median(speeds[name])
                same = "" if outputs[name] == outputs["none"] else "  OUTPUT DIFFERS"
                if name == "none":
                    print(f"{workload:9} {b:>5} {name:16} {speed:8.1f} {1:6.2f} {'':>10} {'':>6} {'1.00':>8} {'':>8}")
                    continue
                generated, passes, drafts, dtok, acc, *per_pos = totals[name]
                alpha = acc / dtok if dtok else 0.0
                k = methods[name]["num_speculative_tokens"]
                formula = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
                per_pass = generated / max(1, passes)  # tokens per target pass of a request, all passes
                print(
                    f"{workload:9} {b:>5} {name:16} {speed:8.1f} {speed / ref:6.2f} "
                    f"{(1 + acc / drafts) if drafts else 0:10.2f} {alpha:6.2f} {per_pass:8.2f} {formula:8.2f}  "
                    f"[{', '.join(f'{p / drafts if drafts else 0:.2f}' for p in per_pos)}] ({dtok} drafts; "
                    f"x per round {', '.join(f'{v / r:.2f}' for v, r in zip(speeds[name], speeds['none']))}){same}"
                )
            if args.bound:
                bound = Bound(prompt_ids, outputs["none"], (lo, hi), max(ks), times)
                plain = bound.replay(b, lambda found, ok: 0)
                fixed = ", ".join(f"k={k} {plain / bound.replay(b, lambda found, ok, k=k: k):.2f}" for k in ks)
                oracle = plain / bound.replay(b, lambda found, ok: ok)
                copy = plain / bound.replay(b, lambda found, ok: ok, bound.copyable)
                print(
                    f"{workload:9} {b:>5} {'bound':16} {'':>8} {oracle:6.2f}  "
                    f"oracle drafts (k <= {max(ks)}), replayed with this run's step times; fixed k replayed: {fixed}; "
                    f"the best copy from any earlier occurrence {copy:.2f}"
                )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
