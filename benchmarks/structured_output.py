"""What structured outputs cost on the default model: grammar compile time (the compiler's
one-time vocabulary pass, a mid-size schema's first compile, and a cached lookup), and the
per-step mask overhead (filling the constrained rows' bitmasks + applying them to the logits) as
a share of the step time, at batch 1 and 32; and the two ways of applying a bitmask.

    .venv/bin/python benchmarks/structured_output.py [--batches 1,32] [--rounds 3] [--max-tokens 64]

Each round runs the batch once constrained (every request with the schema) and once free (the
same prompts, no grammar), interleaved; medians over rounds are printed, with each round's value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from spec_decode import cpu_line

from kvflow import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_id": {"type": "string", "pattern": "INV-[0-9]{6}"},
        "date": {"type": "string", "pattern": "[0-9]{4}-[0-9]{2}-[0-9]{2}"},
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 60},
                        "city": {"type": "string", "maxLength": 40},
                        "country": {"type": "string", "enum": ["FR", "DE", "GB", "US", "JP"]},
                    },
                    "required": ["street", "city", "country"],
                },
            },
            "required": ["name", "address"],
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 16},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "unit_price": {"type": "number", "minimum": 0},
                    "category": {"enum": ["book", "food", "tool", "other"]},
                },
                "required": ["sku", "quantity", "unit_price"],
            },
        },
        "paid": {"type": "boolean"},
        "notes": {"anyOf": [{"type": "string", "maxLength": 80}, {"type": "null"}]},
    },
    "required": ["invoice_id", "date", "currency", "customer", "items", "paid"],
}
TOPICS = [
    "a bookshop in Paris",
    "a hardware store in Berlin",
    "a bakery in London",
    "a toy shop in Tokyo",
    "a garden centre in Lyon",
    "a bike repair shop in Boston",
    "a tea shop in Kyoto",
    "a print shop in Leeds",
]


def _without(schema, keyword: str):
    if isinstance(schema, dict):
        return {k: _without(v, keyword) for k, v in schema.items() if k != keyword}
    if isinstance(schema, list):
        return [_without(v, keyword) for v in schema]
    return schema


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Write the invoice of order {i} from {TOPICS[i % len(TOPICS)]} as JSON."}]
        for i in range(n)
    ]


class StepTimer:
    """Wall time of engine steps, and of the runner's logit_bias + mask application in them."""

    def __init__(self, llm: LLM) -> None:
        self.step_s = self.apply_s = 0.0
        engine, runner = llm.engine, llm.engine.runner
        step, constrain = engine.step, runner._constrain

        def timed_step():
            t = time.perf_counter()
            try:
                return step()
            finally:
                self.step_s += time.perf_counter() - t

        def timed_constrain(*a, **k):
            t = time.perf_counter()
            try:
                return constrain(*a, **k)
            finally:
                self.apply_s += time.perf_counter() - t

        engine.step, runner._constrain = timed_step, timed_constrain


def run(llm: LLM, timer: StepTimer, batch: int, max_tokens: int, constrained: bool) -> dict[str, float]:
    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec)
    so = llm.engine.structured
    fill0, masks0 = so.stats.mask_seconds_total, so.stats.mask_steps_total
    timer.step_s = timer.apply_s = 0.0
    steps0 = llm.engine.get_stats().num_steps
    outs = llm.chat(prompts(batch), params, use_tqdm=False)
    steps = llm.engine.get_stats().num_steps - steps0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_s = max(o.metrics.last_token_time for o in outs) - min(o.metrics.first_token_time for o in outs)
    fill = so.stats.mask_seconds_total - fill0
    return {
        "step_ms": 1000 * timer.step_s / max(steps, 1),
        "fill_ms": 1000 * fill / max(steps, 1),
        "apply_ms": 1000 * timer.apply_s / max(steps, 1),
        "share": (fill + timer.apply_s) / timer.step_s,
        "tok_s": tokens / max(decode_s, 1e-9),
        "mask_steps": so.stats.mask_steps_total - masks0,
        "finished": sum(o.outputs[0].finish_reason == "stop" for o in outs) / len(outs),
    }


def kernels(vocab: int, batch: int = 32) -> None:
    """kvflow's bitmask application against xgrammar's CPU kernel, on rows that allow few tokens
    (what a grammar mostly leaves), as the engine applies them."""
    import torch
    import xgrammar as xgr

    from kvflow.structured_output.manager import GrammarBitmask, apply_bitmask

    mask = torch.zeros(batch, xgr.get_bitmask_shape(1, vocab)[1], dtype=torch.int32)
    mask[:, 5] = 0x0F0F0F0F
    rows, logits = list(range(batch)), torch.randn(batch, vocab)
    for name, fn in (
        (
            "xgrammar apply_token_bitmask_inplace",
            lambda: xgr.apply_token_bitmask_inplace(logits, mask, indices=rows, vocab_size=vocab),
        ),
        ("kvflow apply_bitmask", lambda: apply_bitmask(logits, GrammarBitmask(mask, rows))),
    ):
        fn()
        t = time.perf_counter()
        for _ in range(30):
            fn()
        print(f"{name}, {batch} x {vocab}: {1000 * (time.perf_counter() - t) / 30:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    print(cpu_line(None))
    llm = LLM(max_model_len=1024)
    so = llm.engine.structured

    t = time.perf_counter()
    so.warm_up().result()
    print(
        f"compiler (vocabulary of {llm.engine.model_config.vocab_size} tokens, once per model): "
        f"{1000 * (time.perf_counter() - t):.0f} ms"
    )
    # xgrammar expands a maxLength string into one state per character: those dominate compile time
    for name, schema in (("invoice schema", SCHEMA), ("the same without maxLength", _without(SCHEMA, "maxLength"))):
        t = time.perf_counter()
        so.compiled(StructuredOutputsParams(json=schema))
        first = time.perf_counter() - t
        cached = []
        for _ in range(100):
            t = time.perf_counter()
            so.compiled(StructuredOutputsParams(json=json.loads(json.dumps(schema))))  # equal, a new object
            cached.append(time.perf_counter() - t)
        print(
            f"{name} ({len(json.dumps(schema))} characters): first compile {1000 * first:.1f} ms, "
            f"cached lookup {1e6 * statistics.median(cached):.0f} us"
        )

    kernels(llm.engine.model_config.vocab_size)
    timer = StepTimer(llm)
    run(llm, timer, 2, 8, True)  # warm-up
    print("batch | mode        | step ms | mask fill ms | mask apply ms | mask share of step | decode tok/s | finished")
    for batch in (int(b) for b in args.batches.split(",")):
        rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for _ in range(args.rounds):
            for constrained in (True, False):
                rows[constrained].append(run(llm, timer, batch, args.max_tokens, constrained))
        for constrained in (True, False):
            r = rows[constrained]

            def med(k: str, r: list[dict] = r) -> float:
                return statistics.median(x[k] for x in r)

            share = "/".join(f"{100 * x['share']:.1f}" for x in r)
            print(
                f"{batch:5d} | {'constrained' if constrained else 'free':11s} | {med('step_ms'):7.1f} | "
                f"{med('fill_ms'):12.2f} | {med('apply_ms'):13.2f} | {100 * med('share'):5.1f}% ({share}) | "
                f"{med('tok_s'):12.1f} | {med('finished'):.0%}"
            )


if __name__ == "__main__":
    main()
