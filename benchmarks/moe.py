"""A Mixture-of-Experts model against a dense model with the same active parameters, and against HF
transformers' MoE forward on the same weights: decode at batch 1 / 8 / 32 and prefill, with the
bytes-read floor of MoE decode.

    python benchmarks/moe.py [--hidden 1024] [--layers 16] [--experts 8] [--top-k 2]
        [--expert-width 2816] [--dtype bfloat16] [--batches 1,8,32] [--new-tokens 32]
        [--prefill-len 512] [--rounds 3] [--skip-hf]

Two random-initialised HF folders are saved first (seed 0): a Mixtral (--experts experts of width
--expert-width, top --top-k, softmax over the top-k; 16 / 4 heads of 64) of about 1.1B parameters,
0.36B active per token at the defaults, and a Mistral of the same attention whose one MLP is as
wide as the --top-k experts together (--top-k x --expert-width): the same active parameters. Per
round, in this order: kvflow MoE, kvflow dense, HF MoE (transformers' own MixtralForCausalLM on the
MoE folder's weights, in the same dtype):

- decode tok/s at each batch: B distinct 16-token prompts, greedy, --new-tokens tokens each; the
  time of a 1-token run of the same prompts (their prefill) is subtracted, prefix caching off.
  HF: the prompts' forward, then --new-tokens - 1 forwards of one token per sequence with the
  cache (`past_key_values`), argmax; timed from after the prompts' forward.
- prefill tok/s: 4 prompts of --prefill-len tokens, one output token (kvflow), or one forward of
  the [4, --prefill-len] batch (HF).

Medians over --rounds interleaved rounds (in turns, the order reversed every other round); the
ratios MoE / dense (batch-1 decode time) and kvflow / HF (decode tok/s), of the medians and as the
median of each round's own ratio, are the issue's targets. The floor: bytes one batch-1 decode
step must read (the dense part but the embedding table, plus the experts a token touches,
`kvflow.bench.roofline`) over the read bandwidth gauged here (decode_speed.py's reduction over a
buffer far larger than the last-level cache), as tok/s. Figures: docs/benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

PROMPT_LEN = 16
PREFILL_BATCH = 4


def make_models(root: Path, a: argparse.Namespace) -> tuple[Path, Path]:
    """The MoE and the dense folder (random weights, seed 0), saved in `a.dtype`."""
    from transformers import MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(
        vocab_size=32000,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64,
        num_key_value_heads=max(1, a.hidden // 256),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        sliding_window=None,
    )
    dtype = getattr(torch, a.dtype)
    out = []
    for name, cls, cfg in (
        (
            "moe",
            MixtralForCausalLM,
            MixtralConfig(
                **common, intermediate_size=a.expert_width, num_local_experts=a.experts, num_experts_per_tok=a.top_k
            ),
        ),
        ("dense", MistralForCausalLM, MistralConfig(**common, intermediate_size=a.top_k * a.expert_width)),
    ):
        torch.manual_seed(0)
        model = cls(cfg).to(dtype)
        model.save_pretrained(root / name)
        out.append(root / name)
        del model
    return out[0], out[1]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 31000, (n, length), generator=g).tolist()


# ---- kvflow ------------------------------------------------------------------------------------------
def kvflow_decode(llm, batch: int, new_tokens: int, seed: int) -> float:
    from kvflow import SamplingParams

    ps = prompts(batch, PROMPT_LEN, seed)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(ps, one, use_tqdm=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(ps, full, use_tqdm=False)
    return batch * (new_tokens - 1) / (time.perf_counter() - t0 - first)


def kvflow_prefill(llm, length: int, seed: int) -> float:
    from kvflow import SamplingParams

    ps = prompts(PREFILL_BATCH, length, seed)
    t0 = time.perf_counter()
    llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return PREFILL_BATCH * length / (time.perf_counter() - t0)


# ---- HF transformers ---------------------------------------------------------------------------------
@torch.inference_mode()
def hf_decode(model, batch: int, new_tokens: int, seed: int) -> float:
    ids = torch.tensor(prompts(batch, PROMPT_LEN, seed))
    out = model(input_ids=ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return batch * (new_tokens - 1) / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_prefill(model, length: int, seed: int) -> float:
    ids = torch.tensor(prompts(PREFILL_BATCH, length, seed))
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return PREFILL_BATCH * length / (time.perf_counter() - t0)


def floor(moe_dir: Path, dtype: str) -> tuple[float, float, float]:
    """(weight bytes a batch-1 MoE decode step reads, read bandwidth B/s gauged now, the tok/s
    they allow). The bytes: every weight but the experts a token is not routed to and the
    embedding table (a row lookup)."""
    from decode_speed import read_bandwidth_gbs  # (benchmarks/, on the path when run as a script)

    from kvflow.bench.roofline import dtype_bytes, model_from_hf_config

    spec = model_from_hf_config(json.loads((moe_dir / "config.json").read_text()), "moe")
    spec.weight_dtype = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    step = spec.step_weight_bytes(experts_touched=spec.moe.top_k)
    step -= spec.vocab_size * spec.hidden_size * dtype_bytes(spec.weight_dtype)
    bw = read_bandwidth_gbs()[0] * 1e9
    return step, bw, bw / step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=2816)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true", help="leave HF transformers out")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (the first token is the prompt's)")

    from transformers import MixtralForCausalLM

    from kvflow import LLM

    with tempfile.TemporaryDirectory(prefix="kvflow-moe-bench-") as tmp:
        moe_dir, dense_dir = make_models(Path(tmp), a)
        opts = dict(
            dtype=a.dtype,
            max_model_len=a.prefill_len + 64,
            enable_prefix_caching=False,
            max_num_batched_tokens=max(2048, PREFILL_BATCH * a.prefill_len),
        )
        runners: dict[str, dict] = {}
        runners["kvflow MoE"] = {"llm": LLM(str(moe_dir), **opts)}
        runners["kvflow dense"] = {"llm": LLM(str(dense_dir), **opts)}
        if not a.skip_hf:
            hf = MixtralForCausalLM.from_pretrained(moe_dir, dtype=getattr(torch, a.dtype)).eval()
            runners["HF MoE"] = {"hf": hf}
        cols = [*(f"decode b{b}" for b in batches), "prefill"]
        results: dict[str, dict[str, list[float]]] = {n: {c: [] for c in cols} for n in runners}
        for r in range(a.rounds):
            # In turns, the order reversed every other round (a drift of the host's speed within a
            # round then favours neither side).
            order = list(runners.items()) if r % 2 == 0 else list(runners.items())[::-1]
            for name, run in order:
                for b in batches:
                    if "llm" in run:
                        rate = kvflow_decode(run["llm"], b, a.new_tokens, seed=r)
                    else:
                        rate = hf_decode(run["hf"], b, a.new_tokens, seed=r)
                    results[name][f"decode b{b}"].append(rate)
                if "llm" in run:
                    results[name]["prefill"].append(kvflow_prefill(run["llm"], a.prefill_len, seed=100 + r))
                else:
                    results[name]["prefill"].append(hf_prefill(run["hf"], a.prefill_len, seed=100 + r))
                print(
                    f"round {r + 1}: {name}: " + ", ".join(f"{c} {results[name][c][-1]:.1f}" for c in cols), flush=True
                )
        step, bw, floor_rate = floor(moe_dir, a.dtype)
        kernels = runners["kvflow MoE"]["llm"].engine.runner.kernel_summary()

    med = {n: {c: statistics.median(v) for c, v in cols_.items()} for n, cols_ in results.items()}
    total = a.layers * a.experts * 3 * a.hidden * a.expert_width
    print(
        f"\nMoE: hidden {a.hidden}, {a.layers} layers, {a.experts} experts of width {a.expert_width}, top-{a.top_k} "
        f"({total / 1e9:.2f}B expert parameters); dense: MLP width {a.top_k * a.expert_width}; {a.dtype}; "
        f"{torch.get_num_threads()} threads"
    )
    print(f"kvflow MoE kernels: {kernels}")
    print(f"{'':14}" + "".join(f"{c + ' tok/s':>18}" for c in cols) + "   (medians; rounds in the log above)")
    for name in runners:
        print(f"{name:14}" + "".join(f"{med[name][c]:18.1f}" for c in cols))
    for b in batches:
        c = f"decode b{b}"
        per_round = [d / m for d, m in zip(results["kvflow dense"][c], results["kvflow MoE"][c])]
        target = " (target <= 1.3x)" if b == 1 else ""
        print(
            f"MoE / dense, {c} time per token: {med['kvflow dense'][c] / med['kvflow MoE'][c]:.2f}x of the medians, "
            f"{statistics.median(per_round):.2f}x the median of the rounds' ratios{target}"
        )
    if "HF MoE" in med:
        for c in cols:
            per_round = [k / h for k, h in zip(results["kvflow MoE"][c], results["HF MoE"][c])]
            print(
                f"kvflow / HF MoE, {c}: {med['kvflow MoE'][c] / med['HF MoE'][c]:.2f}x of the medians, "
                f"{statistics.median(per_round):.2f}x the median of the rounds' ratios"
            )
    at = f"; kvflow at {med['kvflow MoE']['decode b1'] / floor_rate:.0%} of it" if 1 in batches else ""
    print(
        f"batch-1 MoE decode floor: {step / 1e6:.0f} MB read per step at {bw / 1e9:.1f} GB/s (read gauge) -> "
        f"{floor_rate:.1f} tok/s{at}"
    )


if __name__ == "__main__":
    main()
