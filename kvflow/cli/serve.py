"""`kvflow serve`: the OpenAI-compatible HTTP server (every engine and server option is a flag)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvflow.cli.engine_args import (add_dataclass_args, add_engine_args, dataclass_flags, dataclass_from_args,
                                    engine_config_from_args)

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
    "data_parallel_size": "data parallelism: start this many engine replicas (processes on 127.0.0.1 ports, "
                          "each pinned with taskset to an even share of this process's CPUs, OMP_NUM_THREADS "
                          "= that share) behind one router on --host/--port; every other flag applies to "
                          "each replica. GET /replicas lists them (see docs/router.md)",
    "router_policy": "with --data-parallel-size > 1: how requests are spread over the replicas: round_robin, "
                     "least_loaded (fewest running + waiting requests) or cache_aware (the replica that holds "
                     "most of the prompt's prefix, unless loads are imbalanced)",
    "replica_max_restarts": "with --data-parallel-size > 1: a replica that exits while serving is restarted "
                            "(same port, CPUs and flags), at most this many times within "
                            "--replica-restart-window-s; past that it stays out of rotation (0: never restarted)",
    "replica_restart_window_s": "the window of --replica-max-restarts, in seconds",
    "data_parallel_backend": "with --data-parallel-size > 1: mp (replica processes on this machine) or ray "
                             "(each replica a Ray actor running its server on a node of the cluster named by "
                             "RAY_ADDRESS, or of a local Ray started for it)",
}
# ServerConfig fields the data-parallel front end keeps to itself: the replicas listen on their
# own 127.0.0.1 ports and get the API key in their environment.
_FRONT_END_FIELDS = ("host", "port", "api_key", "data_parallel_size", "router_policy", "replica_max_restarts",
                     "replica_restart_window_s", "data_parallel_backend")


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvflow.config import ServerConfig

    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize). "
                    "Binds 127.0.0.1 unless --host says otherwise. SIGTERM drains and exits 0; a failed "
                    "engine step exits 1. --data-parallel-size N serves N engine replicas behind one "
                    "router (--router-policy).")
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
    if server_config.data_parallel_size > 1:
        from kvflow.config import EngineConfig
        from kvflow.router.replicas import serve_data_parallel

        flags = [*dataclass_flags(ServerConfig, args, exclude=_FRONT_END_FIELDS),
                 *dataclass_flags(EngineConfig, args, exclude=("kv_offload_disk_dir",)),  # one dir per replica
                 "--log-level", args.log_level]
        return serve_data_parallel(server_config, engine_config, flags)

    from kvflow.engine.engine_thread import EngineThread
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints.openai.api_server import serve

    # Loaded, warmed up and stepped on one thread (see kvflow.engine.engine_thread for why).
    engine_thread = EngineThread()
    engine = engine_thread.call(lambda: LLMEngine(engine_config))
    name = server_config.served_model_name or engine.model_name

    def ready(url: str) -> None:
        print(f"kvflow: serving {name} at {url} (OpenAI API under {url}/v1; Ctrl-C or SIGTERM to stop)",
              flush=True)
        auth = " -H 'Authorization: Bearer <your key>'" if server_config.api_key else ""
        print(f"  try: curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{{\"model\": \"{name}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'",
              file=sys.stderr, flush=True)

    return serve(engine, server_config, on_ready=ready, engine_thread=engine_thread)
