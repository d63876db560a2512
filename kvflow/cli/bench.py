"""`kvflow bench serve` (any OpenAI-compatible server) and `kvflow bench throughput` (offline engine vs HF)."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from kvflow.cli.engine_args import add_engine_args, dataclass_kwargs


def _positive(cast: type, what: str):
    """An argparse type: `cast(s)`, which must be > 0 (inf allowed for floats)."""

    def parse(s: str):
        try:
            v = cast(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected {what} > 0, got {s}")
        return v

    return parse


_rate = _positive(float, "a request rate in requests/s (or inf)")
_positive_int = _positive(int, "an integer")
_positive_float = _positive(float, "a number")


def add_dataset_args(p: argparse.ArgumentParser, default_num_prompts: int) -> None:
    from_ = p.add_argument_group("workload")
    from_.add_argument(
        "--dataset",
        default="random",
        help="random, translation, generation, summarisation, reasoning, sharegpt-like, "
        "shared-prefix, jsonl or mixed (default random)",
    )
    from_.add_argument(
        "--num-prompts",
        type=_positive_int,
        default=default_num_prompts,
        help=f"number of requests (default {default_num_prompts}; shared-prefix uses "
        "--num-groups x --prompts-per-group)",
    )
    from_.add_argument("--input-len", default=None, help="random: prompt tokens, N or MIN:MAX (default 128)")
    from_.add_argument(
        "--output-len",
        default=None,
        help="random/shared-prefix/jsonl: output tokens, N or MIN:MAX (default 128; shared-prefix 64)",
    )
    from_.add_argument(
        "--scale",
        type=_positive_float,
        default=1.0,
        help="multiply the profile/sharegpt-like lengths (e.g. 0.1 on a CPU)",
    )
    from_.add_argument("--max-input-len", type=_positive_int, default=None, help="cap on prompt tokens")
    from_.add_argument("--max-output-len", type=_positive_int, default=None, help="cap on output tokens")
    from_.add_argument("--prefix-len", type=_positive_int, default=512, help="shared-prefix: system prompt tokens P")
    from_.add_argument("--question-len", type=_positive_int, default=32, help="shared-prefix: question tokens Q")
    from_.add_argument("--num-groups", type=_positive_int, default=4, help="shared-prefix: groups G")
    from_.add_argument("--prompts-per-group", type=_positive_int, default=8, help="shared-prefix: requests per group R")
    from_.add_argument(
        "--shared-prefix-order",
        choices=("shuffled", "grouped"),
        default="shuffled",
        help="shared-prefix: request order (default shuffled, seeded)",
    )
    from_.add_argument("--dataset-path", default=None, help='jsonl: the file (one {"prompt", "output_len"} per line)')
    from_.add_argument("--token-ids", action="store_true", help="send token-id prompts instead of text")
    add_mixed_args(p)
    from_.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals (default 0)")
    from_.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer (model folder or .gguf; 'default' = the default model's) used to "
        "build exact-length prompts; without one, prompts are common words (~1 token each)",
    )


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {s!r}") from None
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {s}")
    return v


def parse_weights(spec: str) -> dict[str, float]:
    """'heavy:10,light:1' -> {'heavy': 10.0, 'light': 1.0} (names with positive weights)."""
    weights: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, w = part.strip().rpartition(":")
        try:
            weight = float(w) if sep else math.nan
        except ValueError:
            weight = math.nan
        if not name or not weight > 0:
            raise ValueError(f"expected NAME:WEIGHT[,NAME:WEIGHT...] with weights > 0, got {spec!r}")
        weights[name] = weight
    return weights


def add_mixed_args(p: argparse.ArgumentParser) -> None:
    """Flags of the mixed dataset: the class mix, each class's SLOs, and optional clients."""
    from kvflow.bench.datasets import BATCH, INTERACTIVE

    g = p.add_argument_group("mixed dataset (interactive + batch requests in one stream)")
    g.add_argument("--mixed-batch-fraction", type=_fraction, default=0.2, help="share of batch requests (default 0.2)")
    for cls in (INTERACTIVE, BATCH):
        for name in ("ttft", "tpot"):
            default = getattr(cls, f"{name}_slo_ms")
            g.add_argument(
                f"--{cls.name}-{name}-slo-ms",
                type=_positive_float,
                default=default,
                help=f"{name.upper()} SLO of {cls.name} requests, sent as {name}_slo_ms (default {default:g})",
            )
    g.add_argument(
        "--mixed-users",
        default=None,
        help="send each request as one of these clients (the body's `user`), in these proportions: "
        "NAME:WEIGHT,... (e.g. heavy:10,light:1)",
    )


def mixed_classes(args: argparse.Namespace) -> tuple:
    """The (interactive, batch) classes with the SLOs the flags give."""
    from dataclasses import replace

    from kvflow.bench.datasets import BATCH, INTERACTIVE

    return tuple(
        replace(
            cls,
            ttft_slo_ms=getattr(args, f"{cls.name}_ttft_slo_ms"),
            tpot_slo_ms=getattr(args, f"{cls.name}_tpot_slo_ms"),
        )
        for cls in (INTERACTIVE, BATCH)
    )


def workload_spec(args: argparse.Namespace):
    from kvflow.bench.datasets import WorkloadSpec

    return WorkloadSpec(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        scale=args.scale,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        prefix_len=args.prefix_len,
        question_len=args.question_len,
        num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group,
        shared_prefix_order=args.shared_prefix_order,
        path=args.dataset_path,
        token_ids=args.token_ids,
        mixed_batch_fraction=args.mixed_batch_fraction,
        mixed_classes=mixed_classes(args),
        mixed_users=parse_weights(args.mixed_users) if args.mixed_users else None,
    )


def add_client_args(s: argparse.ArgumentParser, default_timeout: float) -> None:
    """How the client talks to the server: endpoint, arrivals shape, SLO flags, sampling, timeouts."""
    s.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default completions)",
    )
    s.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    s.add_argument("--api-key", default=None, help="sent as a Bearer token if given")
    s.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        help="gamma shape of the gaps (1 = Poisson, <1 burstier); mean gap stays 1/rate",
    )
    s.add_argument("--max-concurrency", type=_positive_int, default=None, help="cap on requests in flight")
    for name, what in (
        ("ttft", "time to first token"),
        ("tpot", "time per output token"),
        ("e2el", "end-to-end latency"),
        ("itl", "every inter-token gap"),
    ):
        s.add_argument(f"--slo-{name}-ms", type=_positive_float, default=None, help=f"SLO on {what} for goodput (ms)")
    s.add_argument("--percentiles", default="50,90,99", help="latency percentiles (default 50,90,99)")
    s.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos=true (a vLLM extension)",
    )
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    s.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    s.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=default_timeout,
        help=f"seconds per request (default {default_timeout:g})",
    )
    s.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: serve (any OpenAI-compatible server) or throughput (offline)",
        description="Benchmarks. `serve` measures TTFT/TPOT/ITL/E2EL/goodput against a "
        "running server; `throughput` measures offline tokens/s.",
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="{serve,throughput}")
    sub.required = True

    s = sub.add_parser(
        "serve",
        help="latency/throughput of a running OpenAI-compatible server",
        description="Stream requests to an OpenAI-compatible server and measure TTFT, TPOT, "
        "ITL (gaps between content chunks, TTFT excluded), E2EL, throughput and goodput.",
    )
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default http://127.0.0.1:8000)")
    s.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="requests/s, Poisson arrivals (default inf: all at once)"
    )
    s.add_argument("--sweep-rates", default=None, help="comma-separated rates, one run each (e.g. 0.5,1,2,4)")
    add_client_args(s, default_timeout=3600.0)
    s.add_argument("--result-json", default=None, help="write config, machine info and every request's figures here")
    s.add_argument("--plot-dir", default=None, help="write TTFT/TPOT CDF PNGs (and sweep plots) in this folder")
    add_dataset_args(s, 100)
    s.set_defaults(func=run_serve)

    t = sub.add_parser(
        "throughput",
        help="offline throughput of the kvflow engine and/or HF transformers",
        description="Offline throughput (all requests at once, MLPerf 'Offline'). --backend hf uses "
        "static batches (each batch generates its longest output; only each request's "
        "own output_len tokens count as useful).",
    )
    t.add_argument("--backend", choices=("kvflow", "hf", "both"), default="kvflow", help="default kvflow")
    t.add_argument(
        "--hf-batch-size", type=_positive_int, default=8, help="static batch size of the hf backend (default 8)"
    )
    t.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed 2-token warm-up request of each backend",
    )
    t.add_argument("--result-json", default=None, help="write config, machine info and per-request figures here")
    t.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_dataset_args(t, 32)
    add_engine_args(t, exclude=_WORKLOAD_FLAGS)
    t.set_defaults(func=run_throughput)


# ----------------------------------------------------------------------------------------------
# serve
# ----------------------------------------------------------------------------------------------


def _serve_tokenizer(args: argparse.Namespace) -> Any:
    import os

    from kvflow.bench.datasets import load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if args.model and os.path.exists(args.model):
        return load_tokenizer(args.model)
    return None


def serve_config(args: argparse.Namespace, base_url: str, request_rate: float = math.inf):
    """The ServeConfig of the client flags (add_client_args), for the server at `base_url`."""
    import json

    from kvflow.bench.metrics import SLO
    from kvflow.bench.serve_client import ServeConfig

    try:
        percentiles = tuple(float(x) for x in args.percentiles.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--percentiles must be comma-separated numbers, got {args.percentiles!r}") from None
    if not percentiles or any(not 0 <= q <= 100 for q in percentiles):
        raise ValueError("--percentiles must be numbers in [0, 100]")
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not valid JSON ({e.msg})") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    return ServeConfig(
        base_url=base_url,
        endpoint=args.endpoint,
        model=args.model,
        request_rate=request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=extra,
        request_timeout=args.request_timeout,
        disable_tqdm=args.disable_tqdm,
        api_key=args.api_key,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms, args.slo_itl_ms),
        percentiles=percentiles,
    )


def build_workload(args: argparse.Namespace, tokenizer: Any) -> list:
    """The requests of the workload flags (add_dataset_args), with a one-line description printed."""
    from kvflow.bench.datasets import generate_requests

    if tokenizer is None:
        print(
            "note: no --tokenizer: prompts are common English words (about one token each); "
            "prompt lengths are approximate"
        )
    requests = generate_requests(workload_spec(args), tokenizer)
    print(
        f"workload: {len(requests)} requests, dataset {args.dataset}, "
        f"{sum(r.prompt_len for r in requests):,} prompt tokens, {sum(r.output_len for r in requests):,} output tokens asked"
    )
    return requests


def run_serve(args: argparse.Namespace) -> int:
    import os

    from kvflow.bench.report import dump_json, plot_cdfs, plot_sweep, run_report, sweep_table
    from kvflow.bench.serve_client import config_dict, parse_rates, run_benchmark, run_sweep

    cfg = serve_config(args, args.base_url, args.request_rate)
    rates = parse_rates(args.sweep_rates) if args.sweep_rates else None
    tokenizer = _serve_tokenizer(args)
    requests = build_workload(args, tokenizer)

    results = run_sweep(requests, cfg, rates, tokenizer) if rates else [run_benchmark(requests, cfg, tokenizer)]
    for r in results:
        print()
        print(run_report(r))
    if len(results) > 1:
        print()
        print(sweep_table(results))
    if args.result_json:
        conf = config_dict(cfg)
        conf.update(workload=vars(workload_spec(args)), sweep_rates=rates, tokenizer=args.tokenizer)
        dump_json(args.result_json, conf, [r.to_dict() for r in results])
        print(f"\nwrote {args.result_json}")
    if args.plot_dir:
        paths = plot_cdfs(results, args.plot_dir)
        sweep = plot_sweep(results, args.plot_dir)
        if sweep:
            paths.append(sweep)
        for p in paths:
            print(f"wrote {os.path.join(p)}")
    return 0 if all(r.metrics.completed > 0 for r in results) else 1


# ----------------------------------------------------------------------------------------------
# throughput
# ----------------------------------------------------------------------------------------------


# --seed and --tokenizer belong to the workload here; the engine keeps its defaults for those.
_WORKLOAD_FLAGS = ("seed", "tokenizer")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    from kvflow.config import EngineConfig

    kwargs = dataclass_kwargs(EngineConfig, args)
    return {k: v for k, v in kwargs.items() if k not in _WORKLOAD_FLAGS}


def _kvflow_records(outputs: list) -> list:
    from kvflow.bench.metrics import RequestRecord

    records = []
    for i, out in enumerate(outputs):
        m = out.metrics
        comp = out.outputs[0] if out.outputs else None
        n_out = len(comp.token_ids) if comp is not None else 0
        err = getattr(out, "error", None)
        records.append(
            RequestRecord(
                request_id=getattr(out, "request_id", i),
                prompt_len=len(out.prompt_token_ids),
                expected_output_len=n_out,
                arrival_time=m.arrival_time,
                send_time=m.arrival_time,
                first_token_time=m.first_token_time,
                end_time=m.finished_time,
                output_tokens=n_out,
                success=err is None and m.finished_time is not None,
                error=err or "",
            )
        )
    return records


def run_kvflow_throughput(args: argparse.Namespace, spec: Any) -> dict:
    """Offline run on the kvflow engine. Returns a dict with records, metrics, stats, requests, tokenizer."""
    try:
        from kvflow import LLM, SamplingParams
    except ImportError as e:
        raise SystemExit(f"kvflow: error: the kvflow engine is not available ({e})") from None
    from kvflow.bench.datasets import generate_requests, load_tokenizer
    from kvflow.bench.metrics import compute_metrics

    llm = LLM(**_engine_kwargs(args))
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else llm.tokenizer
    requests = generate_requests(spec, tokenizer)
    prompts = [r.prompt for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in requests]
    if args.warmup:  # one short untimed request: first-call set-up is not throughput
        llm.generate(prompts[:1], [SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)], use_tqdm=False)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - t0
    records = _kvflow_records(outputs)
    for rec, req in zip(records, requests):
        rec.expected_output_len = req.output_len
    stats = _stats_dict(llm.get_stats()) if hasattr(llm, "get_stats") else {}
    metrics = compute_metrics(records, elapsed)
    del llm
    return {
        "backend": "kvflow",
        "elapsed_s": elapsed,
        "records": records,
        "metrics": metrics,
        "useful_output_tokens": sum(r.output_tokens for r in records if r.success),
        "stats": stats,
        "requests": requests,
        "tokenizer": tokenizer,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def _stats_dict(stats: Any) -> dict:
    """Engine stats as a plain dict, whether the engine returns a dict, a dataclass or an object."""
    import dataclasses

    if stats is None:
        return {}
    if isinstance(stats, dict):
        return dict(stats)
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


def _batch_input(tokenizer: Any, prompts: list, pad_id: int):
    import torch

    ids = []
    for p in prompts:
        if isinstance(p, str):
            ids.append(list(tokenizer(p)["input_ids"]))
        else:
            ids.append(list(p))
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, width - len(x) :] = 1
    return input_ids, mask, [len(x) for x in ids]


def run_hf_throughput(args: argparse.Namespace, requests: list, tokenizer: Any) -> dict:
    """Static batches through HF `generate` (greedy, left padding, min_new_tokens = max_new_tokens = the
    batch's longest output_len). Useful tokens = each request's own output_len."""
    import torch

    from kvflow.bench.metrics import RequestRecord, compute_metrics

    try:
        from kvflow.models.loader import load_hf_model
    except ImportError as e:
        raise SystemExit(f"kvflow: error: the HF reference loader is not available ({e})") from None

    model = load_hf_model(args.model)
    model.eval()
    pad_id = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else tokenizer.eos_token_id
    if pad_id is None:
        pad_id = 0
    bs = args.hf_batch_size
    records: list[RequestRecord] = []
    token_ids: list[list[int]] = []
    generated = 0
    pbar = None
    if not args.disable_tqdm:
        from tqdm.auto import tqdm

        pbar = tqdm(total=len(requests), desc="hf static batches", unit="req")
    if args.warmup:  # one short untimed generate: first-call set-up is not throughput
        ids, mask, _ = _batch_input(tokenizer, [requests[0].prompt], pad_id)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=2,
                min_new_tokens=2,
                do_sample=False,
                pad_token_id=pad_id,
            )
    t0 = time.perf_counter()
    for start in range(0, len(requests), bs):
        batch = requests[start : start + bs]
        o = max(r.output_len for r in batch)
        input_ids, mask, lens = _batch_input(tokenizer, [r.prompt for r in batch], pad_id)
        b0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=o,
                min_new_tokens=o,
                do_sample=False,
                pad_token_id=pad_id,
            )
        b1 = time.perf_counter()
        generated += (out.shape[1] - input_ids.shape[1]) * out.shape[0]
        token_ids += [
            out[j, input_ids.shape[1] : input_ids.shape[1] + r.output_len].tolist() for j, r in enumerate(batch)
        ]
        for j, r in enumerate(batch):
            records.append(
                RequestRecord(
                    request_id=start + j,
                    prompt_len=lens[j],
                    expected_output_len=r.output_len,
                    arrival_time=t0,
                    send_time=b0,
                    end_time=b1,
                    output_tokens=r.output_len,
                    success=True,
                )
            )
        if pbar is not None:
            pbar.update(len(batch))
    elapsed = time.perf_counter() - t0
    if pbar is not None:
        pbar.close()
    metrics = compute_metrics(records, elapsed)
    return {
        "backend": "hf",
        "elapsed_s": elapsed,
        "records": records,
        "metrics": metrics,
        "useful_output_tokens": sum(r.output_len for r in requests),
        "generated_tokens_incl_padding": generated,
        "stats": {"hf_batch_size": bs},
        "token_ids": token_ids,
    }


def _throughput_row(res: dict) -> list:
    m = res["metrics"]
    return [
        res["backend"],
        m.completed,
        res["elapsed_s"],
        m.request_throughput,
        m.output_throughput,
        m.total_token_throughput,
        m.ttft_ms.get("mean"),
        m.ttft_ms.get("median"),
        m.tpot_ms.get("median"),
    ]


def run_throughput(args: argparse.Namespace) -> int:
    from kvflow.bench.datasets import generate_requests
    from kvflow.bench.report import dump_json, format_kv, format_table

    spec = workload_spec(args)
    results: list[dict] = []
    requests = tokenizer = None
    if args.backend in ("kvflow", "both"):
        res = run_kvflow_throughput(args, spec)
        requests, tokenizer = res.pop("requests"), res.pop("tokenizer")
        results.append(res)
    if args.backend in ("hf", "both"):
        if requests is None:
            tokenizer = _hf_tokenizer(args)
            requests = generate_requests(spec, tokenizer)
        results.append(run_hf_throughput(args, requests, tokenizer))

    print()
    print(
        f"workload: {len(requests)} requests, dataset {args.dataset}, "
        f"{sum(r.prompt_len for r in requests):,} prompt tokens, {sum(r.output_len for r in requests):,} output tokens"
    )
    print(
        format_table(
            [
                "backend",
                "requests",
                "elapsed s",
                "req/s",
                "out tok/s",
                "total tok/s",
                "TTFT mean ms",
                "TTFT p50 ms",
                "TPOT p50 ms",
            ],
            [_throughput_row(r) for r in results],
            title="Offline throughput",
        )
    )
    for r in results:
        if r["backend"] == "kvflow" and r["stats"]:
            print(
                format_kv(
                    [(k, v) for k, v in r["stats"].items()],
                    digits=4,
                    title="kvflow engine stats" + (" (incl. warm-up)" if args.warmup else ""),
                )
            )
        if r["backend"] == "hf":
            useful, gen = r["useful_output_tokens"], r["generated_tokens_incl_padding"]
            print(
                f"hf static batching: {gen:,} tokens generated, {useful:,} useful ({100 * useful / max(gen, 1):.1f}%)"
            )
    if len(results) == 2:
        a, b = results[0]["metrics"], results[1]["metrics"]
        ratio = a.output_throughput / b.output_throughput if b.output_throughput > 0 else math.nan
        print(f"kvflow / hf output throughput: {ratio:.2f}x")
        same = sum(x == y for x, y in zip(results[0]["token_ids"], results[1]["token_ids"]))
        print(
            f"greedy outputs identical to hf: {same}/{len(requests)} requests "
            f"(hf pads its static batches, which can flip near-ties)"
        )
    if args.result_json:
        doc = [
            {
                **{k: v for k, v in r.items() if k not in ("records", "token_ids")},
                "requests": [rec.to_dict() for rec in r["records"]],
            }
            for r in results
        ]
        conf = {k: v for k, v in vars(args).items() if k != "func"}
        dump_json(args.result_json, conf, doc)
        print(f"wrote {args.result_json}")
    return 0 if all(r["metrics"].completed == len(requests) for r in results) else 1


def _hf_tokenizer(args: argparse.Namespace) -> Any:
    from kvflow.bench.datasets import load_tokenizer

    return load_tokenizer(args.tokenizer or args.model or "default")
