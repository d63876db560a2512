"""Time to first token with a prefix-cache hit against cold, and where a hit's time goes.

    .venv/bin/python benchmarks/prefix_hit.py [--model PATH] [--cached 1024] [--new 48] [--rounds 5]
        [engine options: --dtype, --quantization, --max-model-len]

One offline `LLM` (the default model unless --model: a GGUF or an HF folder) with prefix caching.
Each round sends, one at a time, with max_tokens 1 (the time of `generate` is the TTFT):

* cold: a prompt of --cached + --new tokens whose first block nobody has computed (a fresh
  prefix each round);
* hit: the same --cached tokens followed by --new different ones, right after the cold request:
  the engine reuses the cached prefix's blocks and computes the --new tokens.

Prompts are random token ids (seeded per round). Printed: per round the two TTFTs, then their
medians and cold / hit, and each one's time by phase (medians over the rounds): the model's forward
pass split into the prefill attention (the attention backend's calls) and the rest of the layers
(linears, norms, rotary, cache writes), then the step outside the forward pass (logits, sampling,
the runner's input building), and the engine outside the step (scheduling, the prefix lookup,
detokenization, the output). The split comes from timers wrapped around the engine's own methods
by this script (each wrapped call adds ~1 us).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


class Timer:
    """Seconds spent in a method while wrapped (recursive calls counted once)."""

    def __init__(self, obj, name: str) -> None:
        self.total, self._depth = 0.0, 0
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            self._depth += 1
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.total += time.perf_counter() - t

        setattr(obj, name, timed)

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded default model)")
    ap.add_argument("--cached", type=int, default=1024, help="tokens of the shared prefix (default 1024)")
    ap.add_argument("--new", type=int, default=48, help="tokens after it (default 48)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--max-model-len", type=int, default=2048)
    a = ap.parse_args()

    from kvflow import LLM, SamplingParams
    from kvflow.models.default_model import default_model_path

    llm = LLM(
        a.model or default_model_path(),
        dtype=a.dtype,
        quantization=a.quantization,
        max_model_len=max(a.max_model_len, a.cached + a.new + 1),
        enable_prefix_caching=True,
    )
    engine = llm.engine
    runner = engine.runner
    vocab = runner.model.cfg.vocab_size
    timers = {
        "step": Timer(runner, "execute"),
        "forward": Timer(runner.model, "forward"),
        "attention": Timer(runner.attention, "_attend"),
    }
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft(ids: list[int]) -> tuple[float, dict[str, float]]:
        for t in timers.values():
            t.take()
        t0 = time.perf_counter()
        out = llm.generate([ids], one, use_tqdm=False)
        wall = time.perf_counter() - t0
        assert len(out[0].outputs[0].token_ids) == 1
        return wall, {k: t.take() for k, t in timers.items()}

    def by_phase(wall: float, split: dict[str, float]) -> dict[str, float]:
        return {
            "prefill attention": split["attention"],
            "rest of the layers (linears, norms, rotary, cache writes)": split["forward"] - split["attention"],
            "step outside the forward (logits, sampling, inputs)": split["step"] - split["forward"],
            "engine outside the step (scheduling, prefix lookup, output)": wall - split["step"],
        }

    def tokens(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    warm = random.Random(12345)  # (first calls build the libraries, the autotune's stored plans, ...)
    ttft(tokens(warm, a.cached + a.new))
    ttft(tokens(warm, a.cached + a.new))
    colds, hits, phases = [], [], []
    for r in range(a.rounds):
        rng = random.Random(r)
        prefix = tokens(rng, a.cached)
        cold, cold_split = ttft(prefix + tokens(rng, a.new))
        hit, split = ttft(prefix + tokens(rng, a.new))
        colds.append(cold)
        hits.append(hit)
        phases.append({"cold": by_phase(cold, cold_split), "hit": by_phase(hit, split)})
        print(f"round {r + 1}: cold {cold * 1e3:.1f} ms, hit {hit * 1e3:.1f} ms ({cold / hit:.1f}x)", flush=True)

    stats = engine.get_stats() if hasattr(engine, "get_stats") else llm.get_stats()
    cold_m, hit_m = statistics.median(colds), statistics.median(hits)
    print()
    print(f"model: {a.model or 'default (SmolLM2-135M-Instruct Q4_1 GGUF)'}; {torch.get_num_threads()} threads")
    print(f"kernels: {stats.linear_kernels}")
    print(f"prompt: {a.cached} cached + {a.new} new tokens; medians of {a.rounds} rounds")
    print(f"TTFT cold {cold_m * 1e3:.1f} ms, with the prefix hit {hit_m * 1e3:.1f} ms: {cold_m / hit_m:.1f}x lower")
    print(f"time by phase, ms (medians):{'cold':>36s}{'hit':>9s}")
    for name in phases[0]["hit"]:
        cold_v, hit_v = (statistics.median(p[kind][name] for p in phases) for kind in ("cold", "hit"))
        print(f"  {name:62s} {cold_v * 1e3:7.1f}  {hit_v * 1e3:7.1f}")


if __name__ == "__main__":
    main()
