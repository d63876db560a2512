"""`kvflow serve --data-parallel-size N`: the CPU split, the replicas' command lines, and one real
server (two replicas of a tiny random model, a subprocess under `nice -n 19`): greedy answers equal
an in-process engine's, shared prefixes stick to one replica, a replica killed under it leaves the
rotation, SIGTERM leaves no process behind; a replica that cannot start is a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_utils import parse_metrics

from kvflow.cli.engine_args import dataclass_flags
from kvflow.cli.main import build_parser
from kvflow.config import EngineConfig, ServerConfig
from kvflow.router.replicas import replica_specs, split_cpus

SYSTEM = ("You are the quick brown fox. You jump over the lazy dog whenever anyone asks, and you tell everyone "
          "about the little engine that served many requests at once. ") * 2
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
    specs = replica_specs(2, ["--model", "/m"], str(tmp_path), api_key="sekret", offload_disk_dir="/kv",
                          cpus=[0, 1, 2, 3], pin=True, ports=[9001, 9002], base_env={"PATH": "/bin"})
    a, b = specs
    assert a.argv[:3] == ["taskset", "-c", "0,1"] and b.argv[:3] == ["taskset", "-c", "2,3"]
    assert a.argv[3:] == [sys.executable, "-m", "kvflow.cli.main", "serve", "--host", "127.0.0.1", "--port", "9001",
                          "--model", "/m", "--kv-offload-disk-dir", "/kv/replica-0"]
    assert b.argv[-1] == "/kv/replica-1" and b.url == "http://127.0.0.1:9002"
    assert (a.env["OMP_NUM_THREADS"], a.env["MKL_NUM_THREADS"], a.threads, a.cpus) == ("2", "2", 2, [0, 1])
    assert a.env["KVFLOW_API_KEY"] == "sekret" and "sekret" not in " ".join(a.argv)  # not on a command line
    assert a.log_path == str(tmp_path / "replica-0.log") and a.name == "replica 0"
    [c] = replica_specs(1, [], str(tmp_path), cpus=[0, 1], pin=False, ports=[9003],
                        base_env={"KVFLOW_API_KEY": "old"})
    assert c.argv[0] == sys.executable and c.cpus is None and c.env["OMP_NUM_THREADS"] == "2"
    assert "KVFLOW_API_KEY" not in c.env  # no key given: none inherited either
    shared = replica_specs(3, [], str(tmp_path), cpus=[0, 1], pin=True, ports=[1, 2, 3], base_env={})
    assert [s.cpus for s in shared] == [[0], [1], [0]] and {s.threads for s in shared} == {1}


def _serve_args(argv: list[str]):
    return build_parser().parse_args(["serve", *argv])


def test_replica_flags_round_trip():
    """What a replica is given parses back to the same engine and server options."""
    argv = ["--model", "/m", "--dtype", "bfloat16", "--no-enable-prefix-caching", "--max-model-len", "256",
            "--kv-cache-memory-gb", "0.5", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
            "--allowed-origins", "https://a.example,https://b.example", "--served-model-name", "x",
            "--shutdown-grace-s", "7", "--data-parallel-size", "2", "--router-policy", "round_robin",
            "--port", "9000", "--api-key", "k"]
    args = _serve_args(argv)
    front = ("host", "port", "api_key", "data_parallel_size", "router_policy")
    flags = dataclass_flags(ServerConfig, args, exclude=front) + dataclass_flags(EngineConfig, args)
    assert "--port" not in flags and "--api-key" not in flags and "--data-parallel-size" not in flags
    assert "--block-size" not in flags  # defaults are left to the replica's own defaults
    again = _serve_args(flags)
    for name in ("model", "dtype", "enable_prefix_caching", "max_model_len", "kv_cache_memory_gb",
                 "speculative_config", "allowed_origins", "served_model_name", "shutdown_grace_s", "block_size"):
        assert getattr(again, name) == getattr(args, name), name
    assert again.data_parallel_size == 1 and again.port == 8000


def test_server_config_checks_the_new_fields():
    assert (ServerConfig().data_parallel_size, ServerConfig().router_policy) == (1, "cache_aware")
    with pytest.raises(ValueError, match="data_parallel_size"):
        ServerConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="router_policy must be one of round_robin, least_loaded, cache_aware"):
        ServerConfig(router_policy="pd")


def test_bad_router_policy_is_a_usage_error(capsys):
    from kvflow.cli.main import main

    assert main(["serve", "--data-parallel-size", "2", "--router-policy", "random"]) == 2
    assert "router_policy must be one of" in capsys.readouterr().err


# ---- a real server -------------------------------------------------------------------------------------
def _free_port() -> int:
    from kvflow.bench.servers import free_port

    return free_port()


def _start(model: str, port: int, tmp_path, *extra: str) -> subprocess.Popen:
    cmd = ["nice", "-n", "19", sys.executable, "-m", "kvflow.cli.main", "serve", "--data-parallel-size", "2",
           "--model", model, "--num-kv-blocks", "64", "--max-model-len", "256", "--port", str(port),
           "--log-interval-s", "60", "--shutdown-grace-s", "5", "--served-model-name", "tiny", *extra]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the replicas' logs
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own group: the cleanup below reaches stragglers


def _output(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        return "(still running)"
    return out


def _descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def dp_server(tiny_llama, tmp_path_factory):
    port = _free_port()
    proc = _start(tiny_llama[0], port, tmp_path_factory.mktemp("dp-logs"))
    url = f"http://127.0.0.1:{port}"
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
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"not healthy within {STARTUP_S} s:\n{_output(proc)}")
        time.sleep(0.25)
    yield proc, url
    if proc.poll() is None:  # a failed test: leave nothing behind
        for p in _descendants(proc.pid):
            try:
                os.killpg(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _sent(url: str) -> dict[str, float]:
    metrics = parse_metrics(httpx.get(url + "/metrics", timeout=5).text)
    prefix = 'kvflow_router:requests_total{backend="'
    return {k[len(prefix):].split('"')[0]: v for k, v in metrics.items() if k.startswith(prefix)}


def _complete(url: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)


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
    children = _descendants(proc.pid)
    assert {r["pid"] for r in reps} <= children
    # what every replica answers alike comes through the router too
    assert httpx.get(url + "/v1/models/tiny", timeout=5).json()["max_model_len"] == 256
    tokens = httpx.post(url + "/tokenize", json={"prompt": "The quick brown fox"}, timeout=5).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": tokens}, timeout=5).json()["prompt"] == "The quick brown fox"

    # greedy answers equal one in-process engine's, whichever replica serves them
    prompts = ["The quick brown fox", "Paris is the capital of", SYSTEM + "What is question number 0?"]
    llm = LLM(model=tiny_llama[0], num_kv_blocks=64, max_model_len=256)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                             ignore_eos=True))]
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
    assert not state[sticky]["running"] and state[[u for u in state if u != sticky][0]]["running"]

    # SIGTERM: the router and every replica stop, nothing is left behind
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert [p for p in children if _alive(p)] == []
    out = _output(proc)
    assert "kvflow: serving tiny at " + url in out and "2 data-parallel replicas" in out
    assert "replica 1: http://127.0.0.1:" in out


def _fake_replicas(tmp_path, *scripts: str, startup_timeout: float = 30):
    """A ReplicaSet whose replicas run `python -c SCRIPT` (no model: fast)."""
    from kvflow.router.replicas import ReplicaSet, ReplicaSpec

    specs = [ReplicaSpec(k, _free_port(), [sys.executable, "-c", code], dict(os.environ), None, 1,
                         str(tmp_path / f"replica-{k}.log")) for k, code in enumerate(scripts)]
    return ReplicaSet(specs, stop_timeout=5, startup_timeout=startup_timeout)


SLEEPER = "import time; time.sleep(120)"


def test_a_replica_that_exits_stops_the_start_at_once(tmp_path):
    from kvflow.router.replicas import ReplicaStartError

    replicas = _fake_replicas(tmp_path, SLEEPER, "import sys; print('no model here', flush=True); sys.exit(3)")
    start = time.monotonic()
    replicas.launch()
    try:
        with pytest.raises(ReplicaStartError) as e:
            replicas.wait_healthy()
    finally:
        replicas.stop()
    assert time.monotonic() - start < 20  # the sleeper is not waited for
    assert str(e.value).startswith(f"data-parallel replica 1 ({replicas.urls[1]}) exited with code 3; its log is "
                                   f"{tmp_path / 'replica-1.log'}, last lines:\n    no model here")
    assert replicas.running() == [False, False]


def test_a_replica_that_never_answers_is_a_timeout(tmp_path):
    from kvflow.router.replicas import ReplicaStartError

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
    assert sum("exited with code 0: out of rotation, not restarted" in m for m in logged) == 2
    assert any("every data-parallel replica has exited" in m for m in logged)


def test_replicas_die_with_their_parent(tmp_path):
    """Even a SIGKILL of the data-parallel process leaves no replica behind (PR_SET_PDEATHSIG)."""
    parent = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
from kvflow.router.replicas import ReplicaSet, ReplicaSpec
specs = [ReplicaSpec(k, 1, [sys.executable, "-c", {SLEEPER!r}], dict(os.environ), None, 1,
                     os.path.join({str(tmp_path)!r}, f"replica-{{k}}.log")) for k in range(2)]
r = ReplicaSet(specs, stop_timeout=5)
r.launch()
print(" ".join(str(p.proc.pid) for p in r.procs), flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_the_cli_reports_a_failed_replica(tmp_path, monkeypatch, capsys):
    """`kvflow serve --data-parallel-size 2` whose replica fails: exit 1, its name, its log, its words."""
    from kvflow.cli.main import main
    from kvflow.router import replicas

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(replicas.tempfile, "tempdir", None)  # re-read TMPDIR
    fail = "import sys; print('kvflow: error: the model is not there', flush=True); sys.exit(2)"
    monkeypatch.setattr(replicas, "REPLICA_CMD", (sys.executable, "-c", fail))
    port = _free_port()
    assert main(["serve", "--data-parallel-size", "2", "--port", str(port), "--model", "/nowhere"]) == 1
    err = capsys.readouterr().err
    assert "kvflow: error: data-parallel replica " in err and "exited with code 2; its log is " in err
    assert "    kvflow: error: the model is not there" in err
    log = err.split("its log is ", 1)[1].split(",", 1)[0]
    assert log.startswith(str(tmp_path)) and "the model is not there" in open(log).read()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are given back
