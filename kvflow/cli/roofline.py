"""`kvflow roofline`: KV size, memory fit, decode step floors, tokens/s, cost, spec-decode gains."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Roofline estimate of batched decoding. For each batch size: step time = max(memory floor,
compute floor), memory floor = (weight bytes + batch x context x KV bytes/token) / bandwidth,
compute floor = 2 x params x batch / FLOP/s; tokens/s per device = batch / step;
cost per 1M tokens = price / (3600 x tokens/s) x 1e6. Also prints the speculative-decoding table:
speed-up (1-a^(g+1)) / ((1-a)(g c+1)) and tokens per target pass (1-a^(g+1)) / (1-a).

Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE configs; presets mixtral-8x7b,
qwen3-30b-a3b, olmoe-1b-7b): all weights must fit, but a step reads the dense part (attention,
embeddings, routers, shared experts, dense layers) plus, per MoE layer, the distinct experts its
batch touches: E x (1 - ((E-k)/E)^B) on average for B tokens routed uniformly to top-k of E
experts, or the count given by --experts-touched. Compute floor = 2 x active params x batch.
"""


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _param_lines(model) -> list[tuple[str, str]]:
    if model.moe is None:
        return [("parameters", f"{model.num_params / 1e9:.3f} B")]
    m = model.moe
    shape = (
        f"{m.num_experts} experts, top-{m.top_k}, {m.num_moe_layers} of {model.num_layers} layers MoE, "
        f"expert intermediate {m.expert_intermediate_size}"
    )
    if m.shared_expert_params:
        shape += f", shared expert intermediate {m.shared_expert_intermediate_size}"
    return [
        ("parameters", f"{model.num_params / 1e9:.3f} B total, {model.active_params / 1e9:.3f} B active per token"),
        ("experts", shape),
        (
            "bytes per step",
            f"{model.dense_weight_bytes / 1e9:.3f} GB dense + {model.expert_weight_bytes / 1e6:.2f} MB "
            "per expert per MoE layer touched",
        ),
    ]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "roofline",
        help="decode roofline: KV bytes, fit, step time, tokens/s, $/1M tokens",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        default=None,
        help="preset (llama3-8b, opt-13b, mixtral-8x7b, qwen3-30b-a3b, olmoe-1b-7b), a model folder "
        "(config.json or .gguf inside), a .gguf file, or 'default' (the default model); default: llama3-8b",
    )
    src.add_argument("--config", default=None, metavar="FILE", help="a HF config.json")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100-40gb or local (measures this machine)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GBPS", help="memory bandwidth override, GB/s")
    p.add_argument("--flops", type=float, default=None, metavar="TFLOPS", help="compute override, TFLOP/s")
    p.add_argument("--memory-gb", type=float, default=None, help="device memory override, GB")
    p.add_argument(
        "--dtype", default=None, help="weight dtype (fp32, bf16, fp16, fp8, int8, int4); default: the model's own"
    )
    p.add_argument("--kv-dtype", default="bf16", help="KV cache dtype (default bf16)")
    p.add_argument("--context", type=int, default=2048, help="tokens held per sequence (default 2048)")
    p.add_argument("--price-per-hour", type=float, default=3.0, help="device price, $/hour (default 3)")
    p.add_argument("--batches", type=_ints, default=None, help="comma-separated batch sizes (default 1,2,4,...,512)")
    p.add_argument(
        "--experts-touched",
        type=_floats,
        default=None,
        metavar="N[,N...]",
        help="MoE: distinct experts a step reads per MoE layer (e.g. measured on real traffic), one count "
        "for every batch size or one per --batches entry (default: the expectation under uniform routing)",
    )
    p.add_argument(
        "--alpha",
        type=_floats,
        default=[0.5, 0.6, 0.7, 0.8, 0.9],
        help="acceptance rates for the spec-decoding table (default 0.5,0.6,0.7,0.8,0.9)",
    )
    p.add_argument("--gamma", type=_ints, default=[1, 2, 3, 4, 5, 8], help="draft lengths (default 1,2,3,4,5,8)")
    p.add_argument("--draft-cost", type=float, default=0.05, help="draft/target cost ratio c (default 0.05)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every figure to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvflow.bench import roofline as rf
    from kvflow.bench.report import dump_json, format_kv, format_table

    model = rf.resolve_model(args.model, args.config)
    if args.dtype:
        rf.dtype_bytes(args.dtype)
        model.weight_dtype = args.dtype
        model.weight_bytes_override = None
    rf.dtype_bytes(args.kv_dtype)
    if args.context < 1:
        raise ValueError("--context must be >= 1")
    if args.price_per_hour < 0:
        raise ValueError("--price-per-hour must be >= 0")
    hw = rf.resolve_hardware(args.hardware, args.bandwidth, args.flops, args.memory_gb)
    batches = args.batches or list(rf.DEFAULT_BATCHES)
    rows = rf.roofline_table(model, hw, args.context, args.kv_dtype, args.price_per_hour, batches, args.experts_touched)
    kvt = rf.kv_bytes_per_token(model, args.kv_dtype, args.context)  # (averaged over the context, with windows)
    fit = rf.max_sequences(model, hw, args.context, args.kv_dtype)

    print(
        format_kv(
            [
                (
                    "model",
                    f"{model.name}: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_heads} heads, "
                    f"{model.num_kv_heads} kv heads, head_dim {model.head_dim}",
                ),
                *_param_lines(model),
                ("weight bytes", f"{model.weight_bytes / 1e9:.3f} GB ({model.weight_dtype})"),
                ("KV bytes/token", f"{kvt:,.0f} B = {kvt / 1024:,.1f} KiB ({args.kv_dtype}){_window_note(model)}"),
                (f"KV per sequence @ {args.context}", f"{kvt * args.context / 1e9:.3f} GB"),
                *_scaled_kv_line(model, args.kv_dtype, args.context, kvt),
                (
                    "hardware",
                    f"{hw.name}: {hw.memory_bytes / 1e9:.1f} GB, {hw.bandwidth / 1e9:,.1f} GB/s, "
                    f"{hw.flops / 1e12:,.3f} TFLOP/s" + (f" ({hw.note})" if hw.note else ""),
                ),
                (f"sequences of {args.context} that fit", f"{fit:,}"),
            ],
            title="Roofline",
        )
    )
    print()
    moe = model.moe is not None
    table_rows = []
    for r in rows:
        table_rows.append(
            [
                r.batch,
                "yes" if r.fits else "NO",
                *([r.experts_touched, r.weight_bytes_read / 1e9] if moe else []),
                r.memory_needed_bytes / 1e9,
                r.memory_floor_s * 1e3,
                r.compute_floor_s * 1e3,
                r.step_s * 1e3,
                r.bound,
                r.tokens_per_s,
                r.tokens_per_s_per_user,
                r.cost_per_million,
            ]
        )
    print(
        format_table(
            [
                "batch",
                "fits",
                *(["experts/layer", "read GB"] if moe else []),
                "mem GB",
                "mem floor ms",
                "compute ms",
                "step ms",
                "bound",
                "tok/s/dev",
                "tok/s/user",
                "$/1M tok",
            ],
            table_rows,
            digits=3,
            title=f"Decode at context {args.context}, ${args.price_per_hour:g}/hour "
            "(fits=NO: weights + KV exceed device memory)"
            + (
                "\nexperts/layer: distinct experts read per MoE layer ("
                + ("given" if args.experts_touched else "expected, uniform routing")
                + "); read GB: weight bytes read per step (mem floor adds the KV)"
                if moe
                else ""
            ),
        )
    )
    print()
    spec = rf.spec_table(args.alpha, args.gamma, args.draft_cost)
    by_alpha: dict[float, dict[int, dict]] = {}
    for s in spec:
        by_alpha.setdefault(s["alpha"], {})[s["gamma"]] = s
    heads = ["alpha"] + [f"g={g}" for g in args.gamma]
    print(
        format_table(
            heads,
            [[f"{a:g}"] + [by_alpha[a][g]["speedup"] for g in args.gamma] for a in args.alpha],
            title=f"Speculative decoding: expected speed-up, draft cost c={args.draft_cost:g}",
        )
    )
    print()
    print(
        format_table(
            heads,
            [[f"{a:g}"] + [by_alpha[a][g]["expected_tokens"] for g in args.gamma] for a in args.alpha],
            title="Speculative decoding: expected tokens per target pass",
        )
    )
    if args.json:
        from dataclasses import asdict

        dump_json(
            args.json,
            {k: v for k, v in vars(args).items() if k != "func"},
            {
                "model": asdict(model),
                "hardware": asdict(hw),
                "kv_bytes_per_token": kvt,
                "active_params": model.active_params,
                "dense_weight_bytes": model.dense_weight_bytes,
                "expert_weight_bytes": model.expert_weight_bytes,
                "max_sequences": fit,
                "rows": rf.rows_as_dicts(rows),
                "speculative": spec,
            },
        )
        print(f"\nwrote {args.json}")
    return 0


def _window_note(model) -> str:
    """Which layers hold only a window (their KV bytes per token fall as the context grows)."""
    windows = [w for w in model.layer_windows if w is not None]
    if not windows:
        return ""
    full = len(model.layer_windows) - len(windows)
    return (
        f", averaged over the context: {len(windows)} layers hold only a window of {min(windows)}"
        f"{'' if len(set(windows)) == 1 else f'..{max(windows)}'} tokens, {full} layers everything"
    )


def _scaled_kv_line(model, kv_dtype: str, context: int, kvt: float) -> list[tuple[str, str]]:
    """For a quantized KV dtype, the bytes per token as kvflow's --kv-cache-dtype stores it: the
    codes plus a float32 scale per token, K/V and kv head."""
    from kvflow.bench import roofline as rf

    if str(kv_dtype).lower() not in rf.SCALED_KV_DTYPES:
        return []
    scaled = rf.kv_bytes_per_token(model, kv_dtype, context, scales=True)
    return [("KV bytes/token in kvflow", f"{scaled:,.0f} B (+{scaled - kvt:,.0f} B of per-head float32 scales)")]
