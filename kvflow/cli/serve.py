"""`kvflow serve`: the OpenAI-compatible HTTP server (every engine and server option is a flag)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvflow.cli.engine_args import (
    add_dataclass_args,
    add_engine_args,
    dataclass_flags,
    dataclass_from_args,
    engine_config_from_args,
)

# ServerConfig fields the data-parallel front end keeps to itself: the replicas listen on their
# own 127.0.0.1 ports and get the API key in their environment.
_FRONT_END_FIELDS = (
    "host",
    "port",
    "api_key",
    "data_parallel_size",
    "router_policy",
    "replica_max_restarts",
    "replica_restart_window_s",
    "data_parallel_backend",
    "router_kv_events",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvflow.config import ServerConfig

    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/responses, /v1/models, /health, /metrics, /tokenize, /detokenize). "
        "Binds 127.0.0.1 unless --host says otherwise. SIGTERM drains and exits 0; a failed "
        "engine step exits 1. --data-parallel-size N serves N engine replicas behind one "
        "router (--router-policy).",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model gives it (vLLM's `vllm serve MODEL`): a HF model folder or a .gguf file",
    )
    add_dataclass_args(p, ServerConfig, "server options")
    add_engine_args(p)
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="kvflow log level (default: info: start-up and the periodic stats line)",
    )
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from kvflow.config import ServerConfig

    logging.getLogger("kvflow").setLevel(args.log_level.upper())
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"kvflow serve: the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.api_key is None and os.environ.get("KVFLOW_API_KEY"):
        args.api_key = os.environ["KVFLOW_API_KEY"]
    server_config = dataclass_from_args(ServerConfig, args)  # validate before loading the model
    engine_config = engine_config_from_args(args)
    if server_config.data_parallel_size > 1:
        from kvflow.config import EngineConfig
        from kvflow.router.data_parallel import serve_data_parallel

        flags = [
            *dataclass_flags(ServerConfig, args, exclude=_FRONT_END_FIELDS),
            # one disk tier and one pair of KV event ports per replica (replica_specs gives them)
            *dataclass_flags(EngineConfig, args, exclude=("kv_offload_disk_dir", "kv_events_config")),
            "--log-level",
            args.log_level,
        ]
        return serve_data_parallel(server_config, engine_config, flags)

    from kvflow.engine.engine_thread import EngineThread
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints.openai.api_server import serve

    # Loaded, warmed up and stepped on one thread (see kvflow.engine.engine_thread for why).
    engine_thread = EngineThread()
    engine = engine_thread.call(lambda: LLMEngine(engine_config))
    name = (server_config.served_model_name or [engine.model_name])[0]

    def ready(url: str) -> None:
        print(f"kvflow: serving {name} at {url} (OpenAI API under {url}/v1; Ctrl-C or SIGTERM to stop)", flush=True)
        auth = " -H 'Authorization: Bearer <your key>'" if server_config.api_key else ""
        print(
            f"  try: curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
            f'-d \'{{"model": "{name}", "prompt": "The capital of France is", "max_tokens": 16}}\'',
            file=sys.stderr,
            flush=True,
        )

    return serve(engine, server_config, on_ready=ready, engine_thread=engine_thread)
