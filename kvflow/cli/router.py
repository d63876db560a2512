"""`kvflow router`: the HTTP proxy in front of kvflow servers (prefill/decode or replicas)."""

from __future__ import annotations

import argparse
import logging
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvflow.router.config import RouterConfig
    from kvflow.router.policies import POLICIES

    d = RouterConfig.__dataclass_fields__
    p = subparsers.add_parser(
        "router",
        help="route requests over kvflow servers (prefill/decode disaggregation, replicas)",
        description="An OpenAI-compatible proxy in front of kvflow servers. With --prefill and --decode "
        "(the pd policy) each request is prefilled on a prefill engine (kv_producer), then "
        "generated on a decode engine (kv_consumer) that fetches the prompt's KV; with "
        "--backend the requests are spread over equal replicas (--policy round_robin, "
        "least_loaded or cache_aware), unhealthy ones left out. "
        "Binds 127.0.0.1 unless --host says otherwise.",
    )
    p.add_argument(
        "--host",
        default=d["host"].default,
        help="address to bind; 0.0.0.0 exposes the router to the network (default: %(default)s)",
    )
    p.add_argument("--port", type=int, default=d["port"].default, help="TCP port (default: %(default)s)")
    p.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=None,
        help="how requests are routed: pd (--prefill/--decode); over --backend replicas: "
        "round_robin (each in turn), least_loaded (fewest running + waiting requests), "
        "cache_aware (the best score of expected prefix-cache hit against load) "
        "(default: pd with --prefill/--decode, else round_robin)",
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        default=[],
        metavar="URL",
        help="prefill engines (kv_producer), e.g. http://127.0.0.1:8100; chosen round robin",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        default=[],
        metavar="URL",
        help="decode engines (kv_consumer), e.g. http://127.0.0.1:8200; chosen round robin",
    )
    p.add_argument(
        "--max-local-prefill-length",
        type=int,
        default=d["max_local_prefill_length"].default,
        metavar="TOKENS",
        help=d["max_local_prefill_length"].metadata["help"] + " (default: %(default)s)",
    )
    p.add_argument(
        "--backend",
        nargs="+",
        default=[],
        metavar="URL",
        help="replicas for a data-parallel policy, e.g. http://127.0.0.1:8100",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=d["timeout_s"].default,
        help="give up on an upstream silent this long: a prefill's answer, a non-streamed "
        "completion, the next chunk of a stream (default: %(default)s)",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=d["connect_timeout_s"].default,
        help="give up connecting to an upstream after this long (then: fall back or 502) (default: %(default)s)",
    )
    p.add_argument(
        "--health-timeout-s",
        type=float,
        default=d["health_timeout_s"].default,
        help="per backend, for GET /health and the background probes and scrapes (default: %(default)s)",
    )
    g = p.add_argument_group("replicas (--backend)")
    g.add_argument(
        "--health-interval-s",
        type=float,
        default=d["health_interval_s"].default,
        help="probe each replica's /health this often; one that fails leaves the rotation "
        "until it passes again (default: %(default)s)",
    )
    g.add_argument(
        "--load-poll-s",
        type=float,
        default=d["load_poll_s"].default,
        help="least_loaded, cache_aware: scrape each replica's /metrics for its load this "
        "often; the router's own in-flight changes count in between (default: %(default)s)",
    )
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=d["cache_threshold"].default,
        help="cache_aware: a replica's prefix match below this share of the prompt counts as none "
        "(0: every match counts, weighed against load by the score) (default: %(default)s)",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=d["balance_abs_threshold"].default,
        help="cache_aware: loads are imbalanced (route to the least loaded, ignoring prefixes) "
        "when max - min exceeds this and max exceeds --balance-rel-threshold x min "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=d["balance_rel_threshold"].default,
        help="cache_aware: see --balance-abs-threshold (default: %(default)s)",
    )
    g.add_argument(
        "--cache-max-chars",
        type=int,
        default=d["cache_max_chars"].default,
        help="cache_aware (and pd with --max-local-prefill-length, per decode engine): characters of "
        "prompt text remembered per replica; the least recently used are forgotten beyond (default: %(default)s)",
    )
    for name in ("load_cost_tokens", "kv_usage_weight"):
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=float,
            default=d[name].default,
            help=d[name].metadata["help"] + " (default: %(default)s)",
        )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help=d["otlp_traces_endpoint"].metadata["help"],
    )
    g.add_argument(
        "--router-kv-events",
        nargs="+",
        default=[],
        metavar="PUB[,REPLAY]",
        help=d["router_kv_events"].metadata["help"],
    )
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="router log level (default: %(default)s)",
    )
    p.set_defaults(func=run_router)


def config_from_args(args: argparse.Namespace):
    from kvflow.router.config import RouterConfig

    return RouterConfig(
        host=args.host,
        port=args.port,
        policy=args.policy,
        backends=args.backend,
        prefill=args.prefill,
        decode=args.decode,
        max_local_prefill_length=args.max_local_prefill_length,
        timeout_s=args.timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        health_timeout_s=args.health_timeout_s,
        health_interval_s=args.health_interval_s,
        load_poll_s=args.load_poll_s,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        cache_max_chars=args.cache_max_chars,
        load_cost_tokens=args.load_cost_tokens,
        kv_usage_weight=args.kv_usage_weight,
        router_kv_events=args.router_kv_events,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def run_router(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # ValueError (a wrong flag) -> `kvflow: error: ...`, exit 2
    logging.getLogger("kvflow").setLevel(args.log_level.upper())

    from kvflow.router.app import serve_router
    from kvflow.utils.http import url_host

    url = f"http://{url_host(config.host)}:{config.port}"
    if config.is_pd:
        where = f"prefill {', '.join(config.prefill)} -> decode {', '.join(config.decode)}"
        if config.max_local_prefill_length:
            where += f"; prompts of at most {config.max_local_prefill_length} tokens to compute prefilled on decode"
    else:
        where = f"{config.policy} over {', '.join(config.backends)}"

    def ready() -> None:
        print(f"kvflow: router at {url} ({where}; Ctrl-C to stop)", file=sys.stderr, flush=True)

    return serve_router(config, on_ready=ready)
