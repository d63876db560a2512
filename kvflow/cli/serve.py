"""`kvflow serve`: the OpenAI-compatible HTTP server (every engine and server option is a flag)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvflow.cli.engine_args import add_dataclass_args, add_engine_args, dataclass_from_args, engine_config_from_args

_SERVER_HELP = {
    "host": "address to bind; 0.0.0.0 exposes the server to the network",
    "port": "TCP port",
    "api_key": "require 'Authorization: Bearer KEY' on every API route (/health and /metrics stay open); "
               "also read from $KVFLOW_API_KEY",
    "served_model_name": "the model name clients send and /v1/models lists (None: the model's name)",
    "max_waiting_requests": "admission control: past this many waiting sequences, requests get 503 + Retry-After",
    "max_request_body_bytes": "larger request bodies get 413",
    "log_interval_s": "seconds between stats log lines while busy",
    "shutdown_grace_s": "on SIGTERM, seconds in-flight requests get to finish before they are aborted",
    "allowed_origins": "CORS: origins that browsers may call the API from (comma-separated; "
                       "'*' for any); without it no CORS headers are sent",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvflow.config import ServerConfig

    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize). "
                    "Binds 127.0.0.1 unless --host says otherwise. SIGTERM drains and exits 0; a failed "
                    "engine step exits 1.")
    add_dataclass_args(p, ServerConfig, "server options", _SERVER_HELP)
    add_engine_args(p)
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="kvflow log level (default: info: start-up and the periodic stats line)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from kvflow.config import ServerConfig

    logging.getLogger("kvflow").setLevel(args.log_level.upper())
    if args.api_key is None and os.environ.get("KVFLOW_API_KEY"):
        args.api_key = os.environ["KVFLOW_API_KEY"]
    server_config = dataclass_from_args(ServerConfig, args)  # validate before loading the model
    engine_config = engine_config_from_args(args)

    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints.openai.api_server import serve

    engine = LLMEngine(engine_config)
    name = server_config.served_model_name or engine.model_name

    def ready(url: str) -> None:
        print(f"kvflow: serving {name} at {url} (OpenAI API under {url}/v1; Ctrl-C or SIGTERM to stop)",
              flush=True)
        auth = " -H 'Authorization: Bearer <your key>'" if server_config.api_key else ""
        print(f"  try: curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{{\"model\": \"{name}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'",
              file=sys.stderr, flush=True)

    return serve(engine, server_config, on_ready=ready)
