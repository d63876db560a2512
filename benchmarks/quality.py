"""Quality of the quantized CPU paths against fp32 on the default model (or any model).

    python benchmarks/quality.py                      # fp32, int8, int8 + int8 KV, gguf, int4; ~2 min
    python benchmarks/quality.py --tokens 2048 --prompts 10 --new-tokens 64   # quicker

For each mode, on the same fixed English text (docstrings of a fixed list of Python standard-library
modules, concatenated in a fixed order; the text's sha256 is printed so runs can be compared):

* perplexity, in windows of `--window` tokens, each window its own sequence;
* mean KL(p_fp32 || p_mode) of the next-token distributions over every position of the text,
  and how often the top-1 next token agrees with fp32;
* greedy agreement: 20 chat prompts, 128 greedy tokens each (ignore_eos); the fraction of the
  generated tokens identical to fp32's at the same position, and the mean length of the common
  prefix (after the first divergence the two continuations are different texts).

The windows run straight through the model runner (the engine's own weights, linear backend and
paged KV cache, quantized or not), so every position's logits are available.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import math
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

MODES = {
    "fp32": {"gguf_weights": "dequantize"},  # a GGUF's tensors dequantized to float32 at load
    "int8": {"quantization": "int8"},
    "int8 + int8 KV": {"quantization": "int8", "kv_cache_dtype": "int8"},
    "gguf": {"gguf_weights": "native"},  # a GGUF's blocks as stored, through the block kernels
    "int4": {"quantization": "int4"},  # the float weights rounded to Q4_1 blocks at load
    # float32 weights, the KV cache quantized (prefill rows read their keys from the cache too)
    "fp8_e4m3 KV": {"gguf_weights": "dequantize", "kv_cache_dtype": "fp8_e4m3"},
    "fp8_e5m2 KV": {"gguf_weights": "dequantize", "kv_cache_dtype": "fp8_e5m2"},
    "int4 KV": {"gguf_weights": "dequantize", "kv_cache_dtype": "int4"},
}

# Fixed order. Only docstrings whose object is defined in the module itself; doctest paragraphs
# (lines starting with >>>) are dropped so the text is mostly English prose.
TEXT_MODULES = (
    "textwrap",
    "string",
    "functools",
    "itertools",
    "collections",
    "heapq",
    "bisect",
    "statistics",
    "fractions",
    "decimal",
    "random",
    "json",
    "csv",
    "argparse",
    "logging",
    "pathlib",
    "shutil",
    "tempfile",
    "subprocess",
    "threading",
    "queue",
    "contextlib",
    "dataclasses",
    "enum",
    "abc",
    "typing",
    "difflib",
    "calendar",
    "datetime",
    "inspect",
    "pickle",
    "zipfile",
    "tarfile",
    "socket",
)

PROMPTS = [
    "Explain how a hash table works.",
    "Write a short poem about the sea.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for learning a new language.",
    "Describe the water cycle in simple terms.",
    "What are the main differences between Python lists and tuples?",
    "Summarize the story of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "List some healthy breakfast ideas.",
    "What causes the seasons on Earth?",
    "Explain recursion to a ten-year-old.",
    "What is the difference between weather and climate?",
    "Give advice for someone starting their first job.",
    "How does a bicycle stay upright?",
    "Describe a sunset over the mountains.",
    "What is photosynthesis?",
    "Write a short story about a lost cat that finds its way home.",
    "What are the benefits of regular exercise?",
]


def eval_text() -> str:
    parts = []
    for name in TEXT_MODULES:
        mod = importlib.import_module(name)
        docs = [inspect.getdoc(mod)]
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if getattr(obj, "__module__", None) == name:
                docs.append(inspect.getdoc(obj))
        for doc in docs:
            if not doc:
                continue
            paras = [p for p in doc.split("\n\n") if ">>>" not in p and "::" not in p]
            if paras:
                parts.append("\n\n".join(paras))
    return "\n\n".join(parts)


def window_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids`, one sequence starting at position 0, one forward pass."""
    from kvflow.attention.backend import SeqLayout

    runner = llm.engine.runner
    bs = llm.engine.config.block_size
    blocks = list(range(-(-len(ids) // bs)))  # the engine is idle and prefix caching is off
    with torch.inference_mode():
        meta = runner.attention.build_metadata([SeqLayout(0, len(ids), blocks)])
        hidden = runner.model(torch.tensor(ids), meta.positions, runner.kv_caches, meta)
        return runner.model.compute_logits(hidden)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M GGUF)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of text for perplexity / KL")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    args = ap.parse_args()

    from kvflow import LLM, SamplingParams

    modes = [m.strip() for m in args.modes.split(",")]
    if modes[0] != "fp32":
        raise SystemExit("the first mode must be fp32 (the reference)")
    t0 = time.perf_counter()
    llms = {
        m: LLM(
            args.model, max_model_len=max(args.window, 1024), num_kv_blocks=640, enable_prefix_caching=False, **MODES[m]
        )
        for m in modes
    }
    tok = llms["fp32"].tokenizer
    text = eval_text()
    ids = tok(text, add_special_tokens=False)["input_ids"][: args.tokens]
    digest = hashlib.sha256(tok.decode(ids).encode()).hexdigest()[:12]
    print(
        f"# model {llms['fp32'].engine.model_name}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"Python {platform.python_version()}"
    )
    print(
        f"# text: docstrings of {len(TEXT_MODULES)} stdlib modules, first {len(ids)} tokens "
        f"(sha256 {digest}), windows of {args.window}"
    )

    nll = dict.fromkeys(modes, 0.0)
    kl = dict.fromkeys(modes, 0.0)
    top1 = dict.fromkeys(modes, 0)
    count = 0
    for start in range(0, len(ids) - 1, args.window):
        w = ids[start : start + args.window]
        if len(w) < 2:
            break
        target = torch.tensor(w[1:])
        ref_lp = None
        for m in modes:
            lp = torch.log_softmax(window_logits(llms[m], w)[:-1].double(), dim=-1)
            nll[m] += -lp.gather(1, target[:, None]).sum().item()
            if ref_lp is None:
                ref_lp = lp
            else:
                kl[m] += (ref_lp.exp() * (ref_lp - lp)).sum().item()
                top1[m] += (lp.argmax(-1) == ref_lp.argmax(-1)).sum().item()
        count += len(w) - 1
    t_text = time.perf_counter() - t0

    chats = [llms["fp32"].apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    outs = {}
    for m in modes:
        res = llms[m].generate(chats, greedy, use_tqdm=False)
        outs[m] = [r.outputs[0].token_ids for r in res]

    ppl_ref = math.exp(nll["fp32"] / count)
    print()
    print(
        f"| mode | perplexity | vs fp32 | mean KL vs fp32 (nats) | top-1 next token = fp32 | "
        f"greedy tokens = fp32 ({args.prompts} prompts x {args.new_tokens}) | mean common prefix |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in modes:
        ppl = math.exp(nll[m] / count)
        same = sum(a == b for x, y in zip(outs[m], outs["fp32"]) for a, b in zip(x, y))
        total = sum(len(y) for y in outs["fp32"])
        prefix = []
        for x, y in zip(outs[m], outs["fp32"]):
            n = 0
            while n < min(len(x), len(y)) and x[n] == y[n]:
                n += 1
            prefix.append(n)
        ref = m == "fp32"
        print(
            f"| {m} | {ppl:.3f} | {'' if ref else f'{100 * (ppl / ppl_ref - 1):+.2f}%'} | "
            f"{'' if ref else f'{kl[m] / count:.4f}'} | {'' if ref else f'{top1[m] / count:.2%}'} | "
            f"{'' if ref else f'{same / total:.2%}'} | {'' if ref else f'{sum(prefix) / len(prefix):.1f}'} |"
        )
    print(f"\n# {count} scored positions; text part {t_text:.0f} s, total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
