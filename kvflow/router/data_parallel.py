"""`kvflow serve --data-parallel-size N`: N engine replicas behind the router, in one command.

The process that runs `kvflow serve` starts N replica `kvflow serve` processes (the same engine and
server flags, each on a free 127.0.0.1 port), pins each one with `taskset` to its share of the CPUs
this process may use (`os.sched_getaffinity`, split evenly: 2 CPUs / 2 replicas = one each) with
OMP_NUM_THREADS / MKL_NUM_THREADS set to that share, waits until every replica's /health answers,
then serves the router app (`app.py`, policy `--router-policy`) on the public --host / --port.
With `--data-parallel-backend ray` the replicas are started by Ray actors on the cluster's nodes
instead (`ray_replica.py`); everything below holds for them too.

- A replica that exits before it is healthy, or is not healthy within its startup timeout
  (`replica_set.STARTUP_TIMEOUT_S`), stops everything with an error naming it and its log
  (`ReplicaStartError`); so does SIGTERM / SIGINT during the start.
- SIGTERM / SIGINT once serving: the router stops accepting, gives in-flight requests
  --shutdown-grace-s, then every replica gets SIGTERM (SIGKILL to its process group after the
  grace). Each replica runs in its own process group (its children included) and gets SIGTERM
  from the kernel if this process dies without cleaning up (PR_SET_PDEATHSIG, Linux).
- A replica that exits later (a crash, the OOM killer, a failed engine step) leaves the rotation
  through the router's health checks (GET /health turns 503 naming it; requests it had not
  answered are retried on another replica or get an error, as the router does for any backend)
  and is restarted by the replica set (`replica_set.py`): the same command line (port, CPUs,
  flags), its log appended to. It is back in rotation once the router's /health probe passes.
  `--replica-max-restarts` (3) bounds the restarts of each replica within any
  `--replica-restart-window-s` (300 s), so a replica that crashes at once is not restarted
  forever; a restarted one that does not answer /health within the startup timeout is killed and
  counts as another exit. Past the bound the replica stays out of rotation (a supervisor watching
  /health restarts the whole server). When every replica is gone for good, the server exits with
  status 1.
- KV cache events: `--kv-events-config` publishes replica k's events on its ports + k (vLLM's
  offset by data-parallel rank); `--router-kv-events` gives each replica free 127.0.0.1 ports
  unless that config is given, and makes the router's cache_aware policy follow them
  (`replica_kv_events`, `subscriber_spec`).
- GET /replicas lists the replicas (URL, pid, CPUs, threads, log, running, healthy, restarts):
  their own /metrics carry the engine metrics; the public /metrics is the router's.

This module plans the replicas (`replica_specs`: command lines, CPUs, ports, environments), builds
the `ReplicaSet` (`replica_set.py`) of local processes (`local_replica.py`, built on
`kvflow.utils.processes.ManagedProcess`) or of Ray actors (`ray_replica.py`), and serves the router
app in front. No torch here: the replicas load the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvflow.router.replica import ReplicaSpec, ReplicaStartError
from kvflow.router.replica_set import ReplicaSet
from kvflow.utils.http import url_host
from kvflow.utils.processes import free_ports, pinned, usable_cpus

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvflow.config import EngineConfig, ServerConfig
    from kvflow.config.kv_events import KVEventsConfig

# What every replica runs, before its own --host / --port and the shared flags.
REPLICA_CMD = (sys.executable, "-m", "kvflow.cli.main", "serve")


def split_cpus(cpus: Sequence[int], n: int) -> list[list[int]]:
    """`n` shares of `cpus` (sorted): contiguous, sizes differing by at most one (2 CPUs / 2 replicas:
    one each; 5 / 2: three and two). With fewer CPUs than replicas, one CPU each, taken in turn
    (replicas then share CPUs)."""
    if n < 1:
        raise ValueError(f"need at least one share, got {n}")
    cpus = sorted(cpus)
    if not cpus:
        raise ValueError("no CPUs to split")
    if len(cpus) < n:
        return [[cpus[k % len(cpus)]] for k in range(n)]
    return [cpus[k * len(cpus) // n : (k + 1) * len(cpus) // n] for k in range(n)]


def replica_specs(
    n: int,
    flags: Sequence[str],
    log_dir: str,
    *,
    api_key: str | None = None,
    offload_disk_dir: str | None = None,
    kv_events_configs: Sequence[dict[str, Any]] | None = None,
    cpus: Sequence[int] | None = None,
    pin: bool | None = None,
    ports: Sequence[int] | None = None,
    base_env: dict[str, str] | None = None,
) -> list[ReplicaSpec]:
    """The replicas of `kvflow serve --data-parallel-size n`: `flags` are the engine and server flags
    every replica gets (no --host / --port / --api-key / --kv-offload-disk-dir); the API key goes in
    the environment ($KVFLOW_API_KEY: not on a command line `ps` shows), the disk tier of replica k
    is `offload_disk_dir/replica-k` (two engines must not evict each other's files), replica k's
    `--kv-events-config` is `kv_events_configs[k]` (each its own ports). `cpus`
    (default: this process's) are split by `split_cpus`; `pin` (default: taskset is installed)
    runs each replica under `taskset -c SHARE`."""
    cpus = list(cpus) if cpus is not None else usable_cpus()
    ports = list(ports) if ports is not None else free_ports(n)
    pin = shutil.which("taskset") is not None if pin is None else pin
    shares: list[list[int] | None] = list(split_cpus(cpus, n)) if cpus else [None] * n
    env0 = dict(os.environ if base_env is None else base_env)
    env0.pop("KVFLOW_API_KEY", None)
    env0.setdefault("TOKENIZERS_PARALLELISM", "false")
    specs = []
    for k, share in enumerate(shares):
        threads = len(share) if share else max(1, (os.cpu_count() or n) // n)
        if share and cpus and len(cpus) < n:
            threads = 1
        port = ports[k]
        argv = [*REPLICA_CMD, "--host", "127.0.0.1", "--port", str(port), *flags]
        if offload_disk_dir:
            argv += ["--kv-offload-disk-dir", os.path.join(offload_disk_dir, f"replica-{k}")]
        if kv_events_configs:
            argv += ["--kv-events-config", json.dumps(kv_events_configs[k])]
        pinned_to = share if (pin and share) else None
        argv = pinned(argv, pinned_to)
        env = {**env0, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        if api_key:
            env["KVFLOW_API_KEY"] = api_key
        specs.append(ReplicaSpec(k, port, argv, env, pinned_to, threads, os.path.join(log_dir, f"replica-{k}.log")))
    return specs


def replica_kv_events(
    n: int, engine_config: EngineConfig, server_config: ServerConfig, taken: Iterable[int] = ()
) -> list[KVEventsConfig]:
    """Each replica's KV events config (empty: none publishes). --kv-events-config applies to every
    replica with its ports offset by the replica's index (vLLM offsets by the data-parallel rank);
    --router-kv-events without it gives each replica a PUB and a replay socket on free 127.0.0.1
    ports (none of `taken`: the router's and the replicas' own). ValueError for a combination that
    cannot work."""
    from kvflow.config.kv_events import KVEventsConfig, endpoint_port

    given = engine_config.kv_events()
    if server_config.router_kv_events:
        if server_config.data_parallel_backend == "ray":
            raise ValueError(
                "--router-kv-events is not available with --data-parallel-backend ray yet: run the replicas "
                "with --kv-events-config and `kvflow router --policy cache_aware --router-kv-events ...`"
            )
        if given is None:
            ports = free_ports(2 * n, exclude=taken)
            return [
                KVEventsConfig(
                    enable_kv_cache_events=True,
                    endpoint=f"tcp://127.0.0.1:{ports[2 * k]}",
                    replay_endpoint=f"tcp://127.0.0.1:{ports[2 * k + 1]}",
                )
                for k in range(n)
            ]
        if not given.enabled:
            raise ValueError(
                "--router-kv-events follows the replicas' KV events, but --kv-events-config turns them off; "
                "enable them there, or drop --kv-events-config (each replica then gets ports of its own)"
            )
    if given is None or not given.enabled:
        return []
    configs = [given.for_replica(k) for k in range(n)]
    used: dict[str, int] = {}
    for k, c in enumerate(configs):
        for endpoint in (c.endpoint, c.replay_endpoint):
            if endpoint is None:
                continue
            key = str(endpoint_port(endpoint) or endpoint)
            if key in used:
                raise ValueError(
                    f"--kv-events-config with --data-parallel-size {n}: replica k publishes on the endpoint's "
                    f"port + k and replays on the replay_endpoint's port + k, so replicas {used[key]} and {k} "
                    f"would both use {endpoint}; space the two ports at least {n} apart"
                )
            used[key] = k
    return configs


def subscriber_spec(config: KVEventsConfig, host: str) -> str:
    """`PUB[,REPLAY]` (`--router-kv-events`) for a replica on `host` publishing as `config` says:
    a wildcard bind address (*, 0.0.0.0, ::) is reached at `host`."""

    def reach(endpoint: str) -> str:
        for wildcard in ("//*:", "//0.0.0.0:", "//[::]:"):
            endpoint = endpoint.replace(wildcard, f"//{host}:")
        return endpoint

    spec = reach(config.endpoint)
    return spec if config.replay_endpoint is None else f"{spec},{reach(config.replay_endpoint)}"


def check_bindable(host: str, port: int) -> None:
    """ValueError naming --port when host:port cannot be bound now (before any replica starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def add_replica_routes(app: FastAPI, replicas: ReplicaSet, policy: str) -> None:
    """GET /replicas: each replica's URL, pid, CPUs, threads, log, whether it runs and is healthy
    (the router's view: its last /health probe), and how many times it was restarted."""
    from starlette.responses import JSONResponse

    router = app.state.router

    @app.get("/replicas")
    async def list_replicas() -> JSONResponse:
        healthy = {b.url: b.healthy for b in router.policy.backends()}
        out = []
        for p, running in zip(replicas.procs, replicas.running()):
            s = p.spec
            out.append(
                {
                    "index": s.index,
                    "url": p.url,
                    "pid": p.pid,
                    "cpus": s.cpus,
                    "threads": s.threads,
                    "log": p.log_path,
                    "running": running,
                    "healthy": running and healthy.get(p.url, False),
                    "restarts": p.restarts,
                    "metrics": p.url + "/metrics",
                }
            )
        return JSONResponse({"policy": policy, "replicas": out})


def _served_name(url: str, api_key: str | None) -> str | None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return str(httpx.get(url + "/v1/models", headers=headers, timeout=10, trust_env=False).json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def serve_data_parallel(
    server_config: ServerConfig, engine_config: EngineConfig, flags: Sequence[str], *, log_dir: str | None = None
) -> int:
    """Run `kvflow serve --data-parallel-size N` until SIGTERM / SIGINT (0), a failed start (1) or
    the loss of every replica (1). `flags`: every replica's engine and server flags (see
    `replica_specs`). ValueError for a combination that cannot work (the CLI's exit status 2)."""
    from kvflow.router.app import build_router_app, serve_router
    from kvflow.router.config import RouterConfig

    n = server_config.data_parallel_size
    if engine_config.kv_transfer_config is not None:
        raise ValueError(
            "--data-parallel-size > 1 cannot be combined with --kv-transfer-config (every replica "
            "would be a P/D engine on the same kv_port): run the engines yourself behind "
            "`kvflow router --prefill ... --decode ...`"
        )
    # Checked first: a bad policy or a taken port must not cost N model loads. Not the router's own
    # port (free until the router binds it after the replicas start), nor one port twice.
    ports = free_ports(n, exclude=[server_config.port])
    events = replica_kv_events(n, engine_config, server_config, taken=[server_config.port, *ports])
    router_config = RouterConfig(
        host=server_config.host,
        port=server_config.port,
        policy=server_config.router_policy,
        backends=[f"http://127.0.0.1:{p}" for p in ports],
        router_kv_events=(
            [subscriber_spec(e, "127.0.0.1") for e in events] if events and server_config.router_kv_events else []
        ),
        otlp_traces_endpoint=server_config.otlp_traces_endpoint,  # (the replicas get the flag too)
    )
    check_bindable(server_config.host, server_config.port)
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvflow-dp-")
    on_ray = server_config.data_parallel_backend == "ray"
    # Under Ray the actors' nodes pick their own ports, and Ray, not taskset, places the CPUs.
    specs = replica_specs(
        n,
        flags,
        log_dir,
        api_key=server_config.api_key,
        offload_disk_dir=engine_config.kv_offload_disk_dir,
        kv_events_configs=[e.to_dict() for e in events] if events else None,
        ports=ports,
        pin=False if on_ray else None,
    )
    placement = None
    if on_ray:
        from kvflow.router.ray_replica import RayPlacement

        print(f"kvflow: placing {n} data-parallel replicas with Ray", file=sys.stderr, flush=True)
        placement = RayPlacement(n, max(s.threads for s in specs))
    replicas = ReplicaSet(
        specs,
        stop_timeout=server_config.shutdown_grace_s + 10.0,
        max_restarts=server_config.replica_max_restarts,
        restart_window_s=server_config.replica_restart_window_s,
        **({"factory": placement.factory} if placement is not None else {}),
    )

    signals: list[int] = []
    all_gone = threading.Event()

    def on_signal(sig: int, frame: Any) -> None:  # only a flag: never an exception mid-cleanup
        signals.append(sig)

    main = threading.current_thread() is threading.main_thread()
    handled = (signal.SIGINT, signal.SIGTERM)
    original = {s: signal.signal(s, on_signal) for s in handled} if main else {}
    try:
        print(f"kvflow: starting {n} data-parallel replicas (logs in {log_dir})", file=sys.stderr, flush=True)
        if on_ray:
            pass  # Ray places each replica's CPUs (one bundle each)
        elif not all(s.cpus for s in specs):
            print(
                "kvflow: warning: replicas are not pinned to CPUs (taskset missing or the CPUs unknown)",
                file=sys.stderr,
                flush=True,
            )
        elif len({c for s in specs for c in s.cpus or ()}) < n:
            print(f"kvflow: warning: {n} replicas but fewer CPUs: they share CPUs", file=sys.stderr, flush=True)
        try:
            replicas.launch()
        except ReplicaStartError as e:  # a Ray actor that could not start its replica
            print(f"kvflow: error: {e}", file=sys.stderr, flush=True)
            return 1
        if on_ray:  # the URLs the actors' nodes chose
            router_config = dataclasses.replace(router_config, backends=replicas.urls)
        for s, p in zip(specs, replicas.procs):
            where = (
                f"taskset -c {','.join(map(str, s.cpus))}"
                if s.cpus
                else "a Ray actor's process"
                if on_ray
                else "not pinned"
            )
            print(
                f"  {s.name}: {p.url} (pid {p.pid or '?'}, {where}, OMP_NUM_THREADS={s.threads}; "
                f"engine metrics {p.url}/metrics; log {p.log_path})",
                file=sys.stderr,
                flush=True,
            )
        try:
            if not replicas.wait_healthy(cancelled=lambda: bool(signals)):
                print("kvflow: stopped before the replicas were ready", file=sys.stderr, flush=True)
                return 128 + signals[0]
        except ReplicaStartError as e:
            print(f"kvflow: error: {e}", file=sys.stderr, flush=True)
            return 1

        names = server_config.served_model_name
        name = names[0] if names else _served_name(specs[0].url, server_config.api_key) or "the model"
        app = build_router_app(router_config)
        add_replica_routes(app, replicas, server_config.router_policy)
        if server_config.allowed_origins:  # as a single server's (api_server.build_app)
            from starlette.middleware.cors import CORSMiddleware

            app.add_middleware(
                CORSMiddleware,
                allow_origins=server_config.allowed_origins,
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        url = f"http://{url_host(server_config.host)}:{server_config.port}"

        def ready() -> None:
            print(
                f"kvflow: serving {name} at {url} (OpenAI API under {url}/v1; {n} data-parallel replicas, "
                f"router policy {server_config.router_policy}; Ctrl-C or SIGTERM to stop)",
                flush=True,
            )
            auth = " -H 'Authorization: Bearer <your key>'" if server_config.api_key else ""
            print(
                f"  try: curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
                f'-d \'{{"model": "{name}", "prompt": "The capital of France is", "max_tokens": 16}}\'',
                file=sys.stderr,
                flush=True,
            )
            print(
                f"  replicas: GET {url}/replicas; {url}/metrics is the router's, each replica's engine "
                "metrics are on its own /metrics (above)",
                file=sys.stderr,
                flush=True,
            )
            # uvicorn's signal handlers are in place now: start watching, and pass on a signal
            # that came while they were not.
            replicas.watch(stop_serving)
            if signals:
                os.kill(os.getpid(), signals[-1])

        def stop_serving() -> None:  # from the watcher thread, through uvicorn's own SIGTERM path
            all_gone.set()
            os.kill(os.getpid(), signal.SIGTERM)

        if signals:
            return 128 + signals[0]
        code = serve_router(router_config, on_ready=ready, app=app, graceful_shutdown_s=server_config.shutdown_grace_s)
        return 1 if all_gone.is_set() else code
    finally:
        replicas.stop()  # signals meanwhile only land in `signals` (uvicorn restored on_signal)
        if placement is not None:
            placement.close()
        for s, h in original.items():
            signal.signal(s, h)
