"""`kvflow serve --data-parallel-size N`: the CPU split, the replicas' command lines, and real
servers (two replicas of a tiny random model, a subprocess under `nice -n 19`): greedy answers equal
an in-process engine's, shared prefixes stick to one replica, a replica killed under it leaves the
rotation (with --replica-max-restarts 0) or is restarted and serves again (the default), SIGTERM
leaves no process behind; a replica that cannot start is a clear error. Restart budgets and
restarted replicas' lifetimes are checked on fake replicas (no model: fast)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvflow.cli.engine_args import dataclass_flags
from kvflow.cli.main import build_parser
from kvflow.config import EngineConfig, ServerConfig
from kvflow.router.data_parallel import replica_specs, split_cpus

from server_utils import alive, descendants, parse_metrics

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

SYSTEM = (
    "You are the quick brown fox. You jump over the lazy dog whenever anyone asks, and you tell everyone "
    "about the little engine that served many requests at once. "
) * 2
STARTUP_S = 120  # about 15 s on an idle 2-core machine; generous for a loaded one (the test runs niced)


# ---- pure parts ----------------------------------------------------------------------------------------
def test_split_cpus():
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([3, 1, 2, 0], 2) == [[0, 1], [2, 3]]
    assert split_cpus(range(5), 2) == [[0, 1], [2, 3, 4]]
    assert split_cpus(range(8), 3) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert split_cpus([4], 1) == [[4]]
    assert split_cpus([0, 1], 3) == [[0], [1], [0]]  # fewer CPUs than replicas: shared, one each
    for bad in (([0], 0), ([], 2)):
        with pytest.raises(ValueError):
            split_cpus(*bad)


def test_replica_specs(tmp_path):
    specs = replica_specs(
        2,
        ["--model", "/m"],
        str(tmp_path),
        api_key="sekret",
        offload_disk_dir="/kv",
        cpus=[0, 1, 2, 3],
        pin=True,
        ports=[9001, 9002],
        base_env={"PATH": "/bin"},
    )
    a, b = specs
    assert a.argv[:3] == ["taskset", "-c", "0,1"] and b.argv[:3] == ["taskset", "-c", "2,3"]
    assert a.argv[3:] == [
        sys.executable,
        "-m",
        "kvflow.cli.main",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "9001",
        "--model",
        "/m",
        "--kv-offload-disk-dir",
        "/kv/replica-0",
    ]
    assert b.argv[-1] == "/kv/replica-1" and b.url == "http://127.0.0.1:9002"
    assert (a.env["OMP_NUM_THREADS"], a.env["MKL_NUM_THREADS"], a.threads, a.cpus) == ("2", "2", 2, [0, 1])
    assert a.env["KVFLOW_API_KEY"] == "sekret" and "sekret" not in " ".join(a.argv)  # not on a command line
    assert a.log_path == str(tmp_path / "replica-0.log") and a.name == "replica 0"
    [c] = replica_specs(1, [], str(tmp_path), cpus=[0, 1], pin=False, ports=[9003], base_env={"KVFLOW_API_KEY": "old"})
    assert c.argv[0] == sys.executable and c.cpus is None and c.env["OMP_NUM_THREADS"] == "2"
    assert "KVFLOW_API_KEY" not in c.env  # no key given: none inherited either
    shared = replica_specs(3, [], str(tmp_path), cpus=[0, 1], pin=True, ports=[1, 2, 3], base_env={})
    assert [s.cpus for s in shared] == [[0], [1], [0]] and {s.threads for s in shared} == {1}


def _serve_args(argv: list[str]):
    return build_parser().parse_args(["serve", *argv])


def test_replica_flags_round_trip():
    """What a replica is given parses back to the same engine and server options."""
    argv = [
        "--model",
        "/m",
        "--dtype",
        "bfloat16",
        "--no-enable-prefix-caching",
        "--max-model-len",
        "256",
        "--kv-cache-memory-gb",
        "0.5",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "--allowed-origins",
        "https://a.example,https://b.example",
        "--served-model-name",
        "x",
        "--shutdown-grace-s",
        "7",
        "--data-parallel-size",
        "2",
        "--router-policy",
        "round_robin",
        "--port",
        "9000",
        "--api-key",
        "k",
    ]
    args = _serve_args(argv)
    front = ("host", "port", "api_key", "data_parallel_size", "router_policy")
    flags = dataclass_flags(ServerConfig, args, exclude=front) + dataclass_flags(EngineConfig, args)
    assert "--port" not in flags and "--api-key" not in flags and "--data-parallel-size" not in flags
    assert "--block-size" not in flags  # defaults are left to the replica's own defaults
    again = _serve_args(flags)
    for name in (
        "model",
        "dtype",
        "enable_prefix_caching",
        "max_model_len",
        "kv_cache_memory_gb",
        "speculative_config",
        "allowed_origins",
        "served_model_name",
        "shutdown_grace_s",
        "block_size",
    ):
        assert getattr(again, name) == getattr(args, name), name
    assert again.data_parallel_size == 1 and again.port == 8000


def test_server_config_checks_the_new_fields():
    assert (ServerConfig().data_parallel_size, ServerConfig().router_policy) == (1, "cache_aware")
    assert (ServerConfig().replica_max_restarts, ServerConfig().replica_restart_window_s) == (3, 300.0)
    with pytest.raises(ValueError, match="data_parallel_size"):
        ServerConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="router_policy must be one of round_robin, least_loaded, cache_aware"):
        ServerConfig(router_policy="pd")
    for bad in (
        {"replica_max_restarts": -1},
        {"replica_restart_window_s": 0},
        {"replica_restart_window_s": float("nan")},
    ):
        with pytest.raises(ValueError, match="replica_max_restarts must be >= 0"):
            ServerConfig(**bad)
    args = _serve_args(["--data-parallel-size", "2", "--replica-max-restarts", "0", "--replica-restart-window-s", "60"])
    assert (args.replica_max_restarts, args.replica_restart_window_s) == (0, 60.0)


def test_local_and_ray_replicas_are_replicas(tmp_path):
    """Both implementations carry what ReplicaSet and GET /replicas read (the `Replica` protocol)."""
    from kvflow.router.local_replica import LocalReplica
    from kvflow.router.ray_replica import RayReplica
    from kvflow.router.replica import Replica, ReplicaSpec

    spec = ReplicaSpec(0, 9001, [sys.executable, "-c", "pass"], {}, None, 1, str(tmp_path / "replica-0.log"))
    local, ray = LocalReplica(spec, 5, 5), RayReplica(spec, 5, 5, placement=None)
    for r in (local, ray):
        assert isinstance(r, Replica)
        assert (r.name, r.url, r.pid, r.started, r.restarts) == ("replica 0", "http://127.0.0.1:9001", None, False, 0)
    assert isinstance(local.renewed(1), LocalReplica) and local.renewed(1).restarts == 1
    assert isinstance(ray.renewed(2), RayReplica) and ray.renewed(2).restarts == 2


def test_restart_budget():
    from kvflow.router.replica_set import RestartBudget

    b = RestartBudget(2, 300.0)
    assert b.take(0.0) and b.take(10.0) and not b.take(20.0)  # two within the window, not a third
    assert not b.take(299.0) and b.take(300.0)  # the first one has left the window
    assert not b.take(305.0) and b.take(310.0)
    assert not RestartBudget(0, 300.0).take(0.0)


def test_bad_router_policy_is_a_usage_error(capsys):
    from kvflow.cli.main import main

    assert main(["serve", "--data-parallel-size", "2", "--router-policy", "random"]) == 2
    assert "router_policy must be one of" in capsys.readouterr().err


# ---- a real server -------------------------------------------------------------------------------------
def _free_port() -> int:
    from kvflow.utils.processes import free_port

    return free_port()


def _start(model: str, port: int, tmp_path, *extra: str) -> subprocess.Popen:
    cmd = [
        "nice",
        "-n",
        "19",
        sys.executable,
        "-m",
        "kvflow.cli.main",
        "serve",
        "--data-parallel-size",
        "2",
        "--model",
        model,
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
        "--port",
        str(port),
        "--log-interval-s",
        "60",
        "--shutdown-grace-s",
        "5",
        "--served-model-name",
        "tiny",
        *extra,
    ]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the replicas' logs
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )  # its own group: the cleanup below reaches stragglers


def _output(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        return "(still running)"
    return out


@contextlib.contextmanager
def _dp_server(model: str, log_dir, *extra: str):
    """A running `kvflow serve --data-parallel-size 2` (healthy), and whatever happens, nothing of it
    left afterwards."""
    port = _free_port()
    proc = _start(model, port, log_dir, *extra)
    url = f"http://127.0.0.1:{port}"
    seen: set[int] = set()  # every process it ever had (restarted replicas included)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvflow serve --data-parallel-size 2 exited with {proc.returncode}:\n{_output(proc)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"not healthy within {STARTUP_S} s:\n{_output(proc)}")
            time.sleep(0.25)
        yield proc, url, seen
    finally:
        if proc.poll() is None:  # a failed test: leave nothing behind
            seen |= descendants(proc.pid)
            for p in seen:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for p in seen:  # a replica that outlived the server (it should not): killed, then reported
            if alive(p):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)


@pytest.fixture(scope="module")
def dp_server(tiny_llama, tmp_path_factory):
    # No restarts here: this server's test checks that a dead replica stays out of rotation.
    with _dp_server(tiny_llama[0], tmp_path_factory.mktemp("dp-logs"), "--replica-max-restarts", "0") as (proc, url, _):
        yield proc, url


def _sent(url: str) -> dict[str, float]:
    metrics = parse_metrics(httpx.get(url + "/metrics", timeout=5).text)
    prefix = 'kvflow_router:requests_total{backend="'
    return {k[len(prefix) :].split('"')[0]: v for k, v in metrics.items() if k.startswith(prefix)}


def _complete(url: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )


def test_data_parallel_server(dp_server, tiny_llama):
    from kvflow import LLM, SamplingParams

    proc, url = dp_server
    replicas = httpx.get(url + "/replicas", timeout=5).json()
    assert replicas["policy"] == "cache_aware"
    reps = replicas["replicas"]
    assert [r["index"] for r in reps] == [0, 1] and all(r["running"] and r["healthy"] for r in reps)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2 and all(r["cpus"] for r in reps):  # pinned: disjoint, even shares of our CPUs
        assert sorted(c for r in reps for c in r["cpus"]) == cpus and reps[0]["threads"] == len(cpus) // 2
    children = descendants(proc.pid)
    assert {r["pid"] for r in reps} <= children
    # what every replica answers alike comes through the router too
    assert httpx.get(url + "/v1/models/tiny", timeout=5).json()["max_model_len"] == 256
    tokens = httpx.post(url + "/tokenize", json={"prompt": "The quick brown fox"}, timeout=5).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": tokens}, timeout=5).json()["prompt"] == "The quick brown fox"

    # greedy answers equal one in-process engine's, whichever replica serves them
    prompts = ["The quick brown fox", "Paris is the capital of", SYSTEM + "What is question number 0?"]
    llm = LLM(model=tiny_llama[0], num_kv_blocks=64, max_model_len=256)
    want = [
        o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ]
    del llm
    got = []
    for p in prompts[:2]:
        resp = _complete(url, p)
        assert resp.status_code == 200, resp.text
        got.append(resp.json()["choices"][0]["text"])

    # shared-prefix requests stick to one replica (cache_aware), and its engine's prefix cache hits
    before = _sent(url)
    for q in range(4):
        resp = _complete(url, SYSTEM + f"What is question number {q}?")
        assert resp.status_code == 200, resp.text
        if q == 0:
            got.append(resp.json()["choices"][0]["text"])
    assert got == want
    after = _sent(url)
    delta = {u: after.get(u, 0) - before.get(u, 0) for u in after}
    assert sorted(delta.values()) == [0, 4], delta
    [sticky] = [u for u, d in delta.items() if d == 4]
    engine = parse_metrics(httpx.get(sticky + "/metrics", timeout=5).text)
    assert engine["kvflow:prefix_cache_hits_total"] > 0
    assert set(after) == {r["url"] for r in reps}  # per-backend counts name the replicas

    # a replica that dies: the router keeps serving on the other and /health says which one is gone
    dead = next(r for r in reps if r["url"] == sticky)
    os.killpg(dead["pid"], signal.SIGKILL)
    for q in range(3):
        resp = _complete(url, SYSTEM + f"After the crash {q}?", max_tokens=4)
        assert resp.status_code == 200, resp.text
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503 and sticky in health.json()["failed"]
    state = {r["url"]: r for r in httpx.get(url + "/replicas", timeout=5).json()["replicas"]}
    assert not state[sticky]["running"] and state[next(u for u in state if u != sticky)]["running"]

    # SIGTERM: the router and every replica stop, nothing is left behind
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert [p for p in children if alive(p)] == []
    out = _output(proc)
    assert "kvflow: serving tiny at " + url in out and "2 data-parallel replicas" in out
    assert "replica 1: http://127.0.0.1:" in out


def _replicas(url: str) -> list[dict]:
    return httpx.get(url + "/replicas", timeout=5).json()["replicas"]


def test_a_killed_replica_is_restarted(tiny_llama, tmp_path):
    """SIGKILL one replica: requests keep succeeding, it comes back (a new pid, healthy, restart 1,
    its log appended) and serves again; SIGTERM then leaves nothing behind."""
    with _dp_server(tiny_llama[0], tmp_path, "--router-policy", "round_robin") as (proc, url, seen):
        before = {r["index"]: r for r in _replicas(url)}
        seen |= {r["pid"] for r in before.values()}
        victim = before[0]
        assert victim["restarts"] == 0
        os.killpg(victim["pid"], signal.SIGKILL)
        for q in range(4):  # in rotation or not yet out of it: the router retries on the other replica
            resp = _complete(url, f"While it is down {q}", max_tokens=4)
            assert resp.status_code == 200, resp.text
        deadline = time.monotonic() + STARTUP_S
        while True:
            now = _replicas(url)[0]
            if now["pid"] is not None:
                seen.add(now["pid"])
            if now["pid"] != victim["pid"] and now["running"] and now["healthy"]:
                break
            assert time.monotonic() < deadline, f"replica 0 not back within {STARTUP_S} s: {now}"
            time.sleep(0.5)
        assert now["restarts"] == 1 and (now["url"], now["cpus"], now["log"]) == (
            victim["url"],
            victim["cpus"],
            victim["log"],
        )
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        sent = _sent(url)
        for q in range(4):  # round robin: the restarted replica gets its share
            resp = _complete(url, f"After the restart {q}", max_tokens=4)
            assert resp.status_code == 200, resp.text
        assert _sent(url)[victim["url"]] - sent.get(victim["url"], 0) >= 1
        log = open(victim["log"]).read()
        assert "---- kvflow: replica 0 exited with code -9; restart 1 ----" in log
        assert log.count("kvflow: serving tiny at") == 2, log[-2000:]  # both runs, in one log
        seen |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert [p for p in seen if alive(p)] == []
        out = _output(proc)
    assert "restarting it (restart 1" in out, out[-3000:]


def _fake_replicas(tmp_path, *scripts: str, startup_timeout: float = 30, **restarts):
    """A ReplicaSet whose replicas run `python -c SCRIPT` (no model: fast; PORT in it is its port)."""
    from kvflow.router.replica import ReplicaSpec
    from kvflow.router.replica_set import ReplicaSet

    ports = [_free_port() for _ in scripts]
    specs = [
        ReplicaSpec(
            k,
            port,
            [sys.executable, "-c", code.replace("PORT", str(port))],
            dict(os.environ),
            None,
            1,
            str(tmp_path / f"replica-{k}.log"),
        )
        for k, (code, port) in enumerate(zip(scripts, ports))
    ]
    return ReplicaSet(specs, stop_timeout=5, startup_timeout=startup_timeout, **restarts)


SLEEPER = "import time; time.sleep(120)"
# A replica that answers every GET (/health included) with 200, until it is killed.
HEALTHY = """
import http.server
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", PORT), Ok).serve_forever()
"""


def _wait_for(cond, timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def test_a_dead_replica_is_restarted_within_its_budget(tmp_path, caplog):
    caplog.set_level("INFO", logger="kvflow.router.replicas")
    replicas = _fake_replicas(tmp_path, HEALTHY, HEALTHY, max_restarts=1, restart_window_s=300)
    gone = threading.Event()
    replicas.launch()
    pids: list[int] = []
    try:
        assert replicas.wait_healthy()
        replicas.watch(gone.set, interval_s=0.05)
        first = replicas.procs[0]
        pids += [p.proc.pid for p in replicas.procs]
        os.killpg(first.proc.pid, signal.SIGKILL)
        _wait_for(lambda: replicas.procs[0] is not first and replicas.procs[0].poll_healthy(), what="a restart")
        second = replicas.procs[0]
        pids.append(second.proc.pid)
        assert second.restarts == 1 and second.port == first.port and replicas.running() == [True, True]
        assert second.proc.pid != first.proc.pid
        _wait_for(lambda: any("answers /health again after restart 1" in r.getMessage() for r in caplog.records))
        os.killpg(second.proc.pid, signal.SIGKILL)  # its budget (1 per 300 s) is spent: it stays down
        _wait_for(
            lambda: any("not restarted (1 restart(s) within 300 s already" in r.getMessage() for r in caplog.records),
            what="the budget",
        )
        time.sleep(0.3)
        assert replicas.procs[0] is second and replicas.running() == [False, True] and not gone.is_set()
        os.killpg(replicas.procs[1].proc.pid, signal.SIGKILL)  # the other's budget is its own
        _wait_for(lambda: replicas.procs[1].restarts == 1 and replicas.running()[1], what="replica 1's restart")
        pids.append(replicas.procs[1].proc.pid)
    finally:
        replicas.stop()
    assert replicas.running() == [False, False] and not any(alive(p) for p in pids)
    log = (tmp_path / "replica-0.log").read_text()
    assert log.count("serving") == 2 and "---- kvflow: replica 0 exited with code -9; restart 1 ----" in log


def test_a_restarted_replica_that_does_not_come_up_is_killed_and_counted(tmp_path, caplog):
    """Restarted, it never answers (here: the second run only sleeps): killed after the startup
    timeout, restarted again while the budget lasts, then given up on; every replica gone: on_all_gone."""
    marker = tmp_path / "ran-once"
    script = (
        f"import os, time\nif os.path.exists({str(marker)!r}):\n    time.sleep(120)\n"
        f"open({str(marker)!r}, 'w').close()\n" + HEALTHY
    )
    replicas = _fake_replicas(tmp_path, script, startup_timeout=3, max_restarts=2, restart_window_s=300)
    gone = threading.Event()
    replicas.launch()
    try:
        assert replicas.wait_healthy()
        replicas.watch(gone.set, interval_s=0.05)
        os.killpg(replicas.procs[0].proc.pid, signal.SIGKILL)
        assert gone.wait(30)
    finally:
        replicas.stop()
    logged = [r.getMessage() for r in caplog.records if r.name == "kvflow.router.replicas"]
    assert sum("did not answer /health within 3 s of its restart: killing it" in m for m in logged) == 2
    assert any("exited with code -9: out of rotation, not restarted (2 restart(s)" in m for m in logged)
    assert replicas.procs[0].restarts == 2


def test_restarted_replicas_die_with_their_parent(tmp_path):
    """A replica restarted by the watcher thread still gets SIGTERM when the server is SIGKILLed."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import os, signal, sys, time
from kvflow.router.replica import ReplicaSpec
from kvflow.router.replica_set import ReplicaSet
specs = [ReplicaSpec(0, 1, [sys.executable, "-c", {SLEEPER!r}], dict(os.environ), None, 1,
                     os.path.join({str(tmp_path)!r}, "replica-0.log"))]
r = ReplicaSet(specs, stop_timeout=5, max_restarts=1)
r.launch()
r.watch(lambda: None, interval_s=0.05)
first = r.procs[0].proc.pid
os.killpg(first, signal.SIGKILL)
while r.procs[0].proc is None or r.procs[0].proc.pid == first:
    time.sleep(0.05)
print(first, r.procs[0].proc.pid, flush=True)
time.sleep(120)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first, restarted = (int(x) for x in parent.stdout.readline().split())
        assert first != restarted and alive(restarted)
    finally:
        parent.kill()
        parent.wait()
    _wait_for(lambda: not alive(restarted), timeout=10, what="the restarted replica's end")


def test_a_replica_that_exits_stops_the_start_at_once(tmp_path):
    from kvflow.router.replica import ReplicaStartError

    replicas = _fake_replicas(tmp_path, SLEEPER, "import sys; print('no model here', flush=True); sys.exit(3)")
    start = time.monotonic()
    replicas.launch()
    try:
        with pytest.raises(ReplicaStartError) as e:
            replicas.wait_healthy()
    finally:
        replicas.stop()
    assert time.monotonic() - start < 20  # the sleeper is not waited for
    assert str(e.value).startswith(
        f"data-parallel replica 1 ({replicas.urls[1]}) exited with code 3; its log is "
        f"{tmp_path / 'replica-1.log'}, last lines:\n    no model here"
    )
    assert replicas.running() == [False, False]


def test_a_replica_that_never_answers_is_a_timeout(tmp_path):
    from kvflow.router.replica import ReplicaStartError

    replicas = _fake_replicas(tmp_path, SLEEPER, startup_timeout=1)
    replicas.launch()
    try:
        with pytest.raises(ReplicaStartError, match=r"replica 0 .* did not answer /health within 1 s; its log is"):
            replicas.wait_healthy()
    finally:
        replicas.stop()
    assert replicas.running() == [False]


def test_the_watcher_reports_when_every_replica_is_gone(tmp_path, caplog):
    import threading

    replicas = _fake_replicas(tmp_path, "import time; time.sleep(0.2)", "import time; time.sleep(0.6)")
    gone = threading.Event()
    replicas.launch()
    try:
        replicas.watch(gone.set, interval_s=0.05)
        assert gone.wait(20)
    finally:
        replicas.stop()
    logged = [r.getMessage() for r in caplog.records if r.name == "kvflow.router.replicas"]
    assert (
        sum("exited with code 0: out of rotation, not restarted (--replica-max-restarts is 0" in m for m in logged) == 2
    )
    assert any("every data-parallel replica has exited" in m for m in logged)


def test_replicas_die_with_their_parent(tmp_path):
    """Even a SIGKILL of the data-parallel process leaves no replica behind (PR_SET_PDEATHSIG)."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import os, sys, time
from kvflow.router.replica import ReplicaSpec
from kvflow.router.replica_set import ReplicaSet
specs = [ReplicaSpec(k, 1, [sys.executable, "-c", {SLEEPER!r}], dict(os.environ), None, 1,
                     os.path.join({str(tmp_path)!r}, f"replica-{{k}}.log")) for k in range(2)]
r = ReplicaSet(specs, stop_timeout=5)
r.launch()
print(" ".join(str(p.proc.pid) for p in r.procs), flush=True)
time.sleep(120)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def test_the_cli_reports_a_failed_replica(tmp_path, monkeypatch, capsys):
    """`kvflow serve --data-parallel-size 2` whose replica fails: exit 1, its name, its log, its words."""
    from kvflow.cli.main import main
    from kvflow.router import data_parallel

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(data_parallel.tempfile, "tempdir", None)  # re-read TMPDIR
    fail = "import sys; print('kvflow: error: the model is not there', flush=True); sys.exit(2)"
    monkeypatch.setattr(data_parallel, "REPLICA_CMD", (sys.executable, "-c", fail))
    port = _free_port()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert main(["serve", "--data-parallel-size", "2", "--port", str(port), "--model", "/nowhere"]) == 1
    err = capsys.readouterr().err
    assert "kvflow: error: data-parallel replica " in err and "exited with code 2; its log is " in err
    assert "    kvflow: error: the model is not there" in err
    log = err.split("its log is ", 1)[1].split(",", 1)[0]
    assert log.startswith(str(tmp_path)) and "the model is not there" in open(log).read()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # given back


def test_ray_replicas_serve_restart_and_leave_nothing(tiny_llama, tmp_path):
    """--data-parallel-backend ray: each replica is a Ray actor (a local Ray the server starts, the
    machine's CPUs, one bundle each) running its server on the node's address; requests spread over
    both; a killed replica process is restarted in place by its actor (same URL); SIGTERM stops the
    replicas, the actors and the local Ray: nothing the server started outlives it."""
    pytest.importorskip("ray")
    import shutil
    import tempfile

    # A short TMPDIR: Ray puts its sockets under it, and AF_UNIX paths stop at 107 bytes.
    short = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    try:
        _ray_replicas(tiny_llama[0], short)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _ray_replicas(model: str, tmp_dir: str) -> None:
    with _dp_server(model, tmp_dir, "--data-parallel-backend", "ray", "--router-policy", "round_robin") as (
        proc,
        url,
        seen,
    ):
        before = {r["index"]: r for r in _replicas(url)}
        assert sorted(before) == [0, 1] and all(r["running"] and r["healthy"] for r in before.values())
        assert len({r["url"] for r in before.values()}) == 2 and all(r["cpus"] is None for r in before.values())
        for q in range(4):
            resp = _complete(url, f"Ray question {q}", max_tokens=4)
            assert resp.status_code == 200, resp.text
        assert all(v >= 1 for v in _sent(url).values()) and len(_sent(url)) == 2
        seen |= descendants(proc.pid)
        victim = before[0]
        with open(f"/proc/{victim['pid']}/stat") as f:  # its parent: the Ray actor's worker process
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{parent}/cmdline") as f:
            assert "ReplicaHost" in f.read()
        os.killpg(victim["pid"], signal.SIGKILL)
        for q in range(3):
            resp = _complete(url, f"While it is down {q}", max_tokens=4)
            assert resp.status_code == 200, resp.text
        deadline = time.monotonic() + STARTUP_S
        while True:
            now = _replicas(url)[0]
            if now["pid"] != victim["pid"] and now["running"] and now["healthy"]:
                break
            assert time.monotonic() < deadline, f"replica 0 not back within {STARTUP_S} s: {now}"
            time.sleep(0.5)
        assert now["restarts"] == 1 and now["url"] == victim["url"]
        seen |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        left = [p for p in seen if alive(p)]
        assert left == [], [open(f"/proc/{p}/cmdline").read() for p in left if alive(p)]
        out = _output(proc)
    assert "placing 2 data-parallel replicas with Ray" in out, out[-3000:]
