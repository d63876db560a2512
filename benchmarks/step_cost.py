"""What an engine step costs by its shape: the numbers behind speculative decoding's trade-off.

    python benchmarks/step_cost.py [--batches 1,32] [--k 4]

Runs the default model (fp32) on the input-grounded prompts of `spec_decode.py`, once plainly and
once with prompt lookup at a fixed k, timing every model step; prints the median step time for each
step shape (tokens computed, sequences computing more than one) and, for the speculating engine,
its own fitted step-cost model (seconds = a + b * tokens + c * multi-token sequences + m * any
+ d * context) and the model's median prediction error.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from spec_decode import GROUNDED, cpu_line, run

from kvflow import LLM


def timed(llm: LLM) -> list[tuple[int, int, float]]:
    """Record (tokens, multi-token sequences, seconds) of every step the engine's runner executes."""
    runner, samples = llm.engine.runner, []
    execute = runner.execute

    def wrapper(out, *rest):
        t0 = time.perf_counter()
        result = execute(out, *rest)
        samples.append((out.num_tokens, sum(len(s.token_ids) > 1 for s in out.seqs), time.perf_counter() - t0))
        return result

    runner.execute = wrapper
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    print(cpu_line(None))
    for b in (int(x) for x in args.batches.split(",")):
        prompts = [GROUNDED[i % len(GROUNDED)] for i in range(max(b, len(GROUNDED)))]
        for name, spec in (
            ("plain", None),
            (f"ngram k={args.k}", {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": False}),
        ):
            llm = LLM(max_model_len=2048, num_kv_blocks=1024, speculative_config=spec)
            samples = timed(llm)
            run(llm, prompts, b, 128)
            shapes = collections.defaultdict(list)
            for tokens, chunks, seconds in samples:
                shapes[(tokens, chunks)].append(seconds)
            print(f"batch {b}, {name}: median step time by shape (steps with >= 3 samples)")
            for (tokens, chunks), times in sorted(shapes.items()):
                if len(times) >= 3:
                    print(
                        f"  {tokens:4d} tokens, {chunks:3d} multi-token sequences: "
                        f"{1000 * statistics.median(times):7.1f} ms ({len(times)} steps)"
                    )
            if spec is not None:
                a, b_, c, m, *_ = llm.engine.speculator.cost.coefficients
                print(
                    f"  fitted step-cost model: a {1000 * a:.1f} ms, b {1000 * b_:.2f} ms/token, "
                    f"c {1000 * c:.2f} ms/multi-token sequence, m {1000 * m:.2f} ms"
                )


if __name__ == "__main__":
    main()
