"""The Grafana dashboard in deploy/grafana: well formed and naming only metrics kvflow exports (no
server needed), then proven on a real Prometheus: two tiny-model engines behind a cache_aware
router, scraped every second under a short load, and every PromQL expression of the dashboard
evaluated through Prometheus' HTTP API: each must parse and return data."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.metrics import MetricWrapperBase

from kvflow.config import EngineConfig, ServerConfig
from kvflow.metrics import EngineMetrics
from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvflow.router.app import build_router_app
from kvflow.router.config import RouterConfig
from kvflow.router.metrics import RouterMetrics
from kvflow.utils.processes import ManagedProcess, free_port

from server_utils import LiveServer, ThreadServer, parse_metrics, wait_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvflow-dashboard.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
METRIC_NAME = re.compile(r"\bkvflow(?:_router)?:[A-Za-z0-9_]+")
# What the test puts in place of Grafana's variables: a rate window that spans the whole run
# (Prometheus has scraped every second since before the first request), and "All" engines.
VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}
MODEL = "tiny"
# Targets ("panel / refId") the load below must move above zero: data that is there and shows it.
POSITIVE = (
    "Time to first token / C",
    "Time per output token (per request) / C",
    "Inter-token latency / C",
    "Goodput / A",
    "Prefix cache hit rate / B",
    "Token throughput / B",
    "Mean acceptance length / A",
    "Grammar compile time / A",
    "Constrained requests and grammar cache hits / A",
    "Requests per replica / A",
    "Replica health / A",
    "Router time to first byte / C",
)


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    """Every panel but rows (and the panels of collapsed rows)."""
    out = []
    for p in dashboard["panels"]:
        if p["type"] == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def _expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every target."""
    return [(f"{p['title']} / {t['refId']}", t["expr"]) for p in _panels(dashboard) for t in p["targets"]]


def _concrete(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def _exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each family a kvflow engine's or router's /metrics exposes: name -> (type, label names),
    read from the metric objects that /metrics renders."""
    families: dict[str, tuple[str, tuple[str, ...]]] = {}
    for owner in (EngineMetrics(), RouterMetrics()):
        for metric in vars(owner).values():
            if isinstance(metric, MetricWrapperBase):
                families[metric._name] = (metric._type, tuple(metric._labelnames))
    return families


def _sample_names(families: dict[str, tuple[str, tuple[str, ...]]]) -> dict[str, tuple[str, ...]]:
    """The sample names a query can select -> their label names (histograms add `le` to _bucket)."""
    names: dict[str, tuple[str, ...]] = {}
    for name, (kind, labels) in families.items():
        if kind == "counter":
            names[name + "_total"] = labels
        elif kind == "histogram":
            names[name + "_bucket"] = (*labels, "le")
            names[name + "_sum"] = names[name + "_count"] = labels
        else:
            names[name] = labels
    return names


# ---- the dashboard file, no server ------------------------------------------------------------------
def test_dashboard_is_well_formed():
    d = _dashboard()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"] == "kvflow"
    assert d["__inputs"] == [
        {
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "description": "The Prometheus that scrapes kvflow",
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }
    ]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert set(variables) == {"DS_PROMETHEUS", "instance"}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["instance"]["allValue"] == ".*" and variables["instance"]["includeAll"]
    ids = [p["id"] for p in d["panels"]] + [q["id"] for p in d["panels"] for q in p.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    panels = _panels(d)
    assert len(panels) >= 20
    for p in panels:
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["title"] and p["description"], p
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"], f"{p['title']}: no target"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"].strip(), (p["title"], t)
    for where, expr in _expressions(d):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), where
        leftover = _concrete(expr)
        assert "$" not in leftover, f"{where}: a variable the dashboard does not define: {expr}"
    # what the issue asks to see, each in some panel
    titles = " | ".join(p["title"] for p in panels)
    for wanted in (
        "Time to first token",
        "Time per output token",
        "Inter-token latency",
        "Goodput",
        "SLO attainment",
        "running and waiting",
        "KV cache usage",
        "Prefix cache hit rate",
        "Preemptions",
        "acceptance",
        "Grammar compile time",
        "per replica",
    ):
        assert wanted in titles, wanted


def test_dashboard_names_only_exported_metrics():
    """Each metric name and each label a dashboard expression groups or filters by is one a kvflow
    engine's or router's /metrics exposes (checked against the metric objects, so a renamed metric
    or label fails here before any Prometheus)."""
    samples = _sample_names(_exported())
    target_labels = {"instance", "job"}  # added by Prometheus to every scraped sample
    used: set[str] = set()
    for where, expr in _expressions(_dashboard()):
        names = METRIC_NAME.findall(expr)
        assert names, f"{where}: no kvflow metric in {expr}"
        for name in names:
            assert name in samples, f"{where}: {name} is not exported (exported: {sorted(samples)})"
        used.update(names)
        allowed = target_labels.union(*(samples[n] for n in names))
        for group in re.findall(r"\b(?:by|ignoring|on)\s*\(([^)]*)\)", expr):
            for label in filter(None, (s.strip() for s in group.split(","))):
                assert label in allowed, f"{where}: label {label!r} is not on {names}"
        for label in re.findall(r"[{,]\s*([A-Za-z_][A-Za-z0-9_]*)\s*=~?", expr):
            assert label in allowed, f"{where}: label {label!r} is not on {names}"
    # the panels the issue lists use these; a dashboard that dropped one would not show it
    for name in (
        "kvflow:time_to_first_token_seconds_bucket",
        "kvflow:request_time_per_output_token_seconds_bucket",
        "kvflow:inter_token_latency_seconds_bucket",
        "kvflow:request_slo_attained_total",
        "kvflow:num_requests_running",
        "kvflow:num_requests_waiting",
        "kvflow:kv_cache_usage_perc",
        "kvflow:prefix_cache_hits_total",
        "kvflow:num_preemptions_total",
        "kvflow:spec_decode_num_accepted_tokens_total",
        "kvflow:structured_output_compile_seconds_bucket",
        "kvflow_router:requests_total",
    ):
        assert name in used, name


def test_prometheus_config_example_names_kvflow_jobs():
    text = PROMETHEUS_CONFIG.read_text()
    assert "scrape_configs:" in text and "job_name: kvflow" in text and "job_name: kvflow-router" in text
    assert "metrics_path: /metrics" in text


def test_tpot_histogram_is_per_request():
    """kvflow:request_time_per_output_token_seconds, the dashboard's TPOT: one observation per
    finished request of two or more tokens, (last - first token time) / (tokens - 1)."""
    m = EngineMetrics()

    def finished(rid: str, tokens: int, first: float, last: float) -> RequestOutput:
        return RequestOutput(
            rid,
            "p",
            [1],
            [CompletionOutput(0, "", list(range(tokens)), finish_reason="length")],
            True,
            RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=first, last_token_time=last),
        )

    m.record_outputs([finished("a", 5, 1.0, 1.2), finished("b", 1, 1.0, 1.0), finished("c", 3, 2.0, 3.0)])
    samples = parse_metrics(m.render().decode())
    assert samples["kvflow:request_time_per_output_token_seconds_count"] == 2
    assert samples["kvflow:request_time_per_output_token_seconds_sum"] == pytest.approx(0.2 / 4 + 1.0 / 2)
    assert samples['kvflow:request_time_per_output_token_seconds_bucket{le="0.05"}'] == 1  # 0.05 <= 0.05
    assert samples['kvflow:request_time_per_output_token_seconds_bucket{le="0.5"}'] == 2


# ---- on a real Prometheus ---------------------------------------------------------------------------
PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)


class _Prometheus(ManagedProcess):
    def poll_healthy(self) -> bool:
        self.check_alive()
        try:
            return httpx.get(self.url + "/-/ready", timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> dict:
        """/api/v1/query at the current time: the JSON answer, whatever its status."""
        return httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10, trust_env=False).json()

    def vector(self, expr: str) -> list[dict]:
        answer = self.query(expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]


def _engine(model: str) -> LiveServer:
    return LiveServer(
        EngineConfig(
            model=model,
            num_kv_blocks=96,
            max_model_len=256,
            max_num_seqs=8,
            # ngram drafts on every step (adaptive off), so the acceptance panels have data
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 2,
                "adaptive": False,
            },
            default_ttft_slo_ms=5_000,
            default_tpot_slo_ms=1_000,
        ),
        ServerConfig(log_interval_s=60, served_model_name=MODEL),
    )


SYSTEM = (
    "You are the quick brown fox. You jump over the lazy dog whenever anyone asks, and you tell "
    "everyone about the little engine that served many requests at once. " * 2
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


def _hostport(url: str) -> str:
    return url.removeprefix("http://")


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=httpx.Timeout(30, connect=5), trust_env=False)


def _post(client: httpx.Client, path: str, body: dict) -> None:
    if body.get("stream"):
        with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            assert any(line.startswith("data: [DONE]") for line in r.iter_lines())
    else:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text


def _chat(client: httpx.Client, question: str, *, stream: bool = False, **extra) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _post(client, "/v1/chat/completions", {**body, "stream": stream, **extra})


def _complete(client: httpx.Client, prompt: str, *, stream: bool = False) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    _post(client, "/v1/completions", {**body, "stream": stream})


def _load(url: str) -> None:
    """A short mixed load through the router: completions and chats, streamed and not, a repeated
    long prompt (a prefix-cache hit), a structured output; then some at once."""
    with _client(url) as client:
        _complete(client, "one two three one two three one two three one two")
        _complete(client, "a b c d a b c d a b c d", stream=True)
        _chat(client, "What does the fox do?")
        _chat(client, "What does the fox do?")  # the same prompt again: its prefix is cached where it went
        _chat(client, "And the dog?", stream=True)
        _chat(
            client,
            "Give the weather as JSON.",
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
        )
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with _client(url) as client:
                _chat(client, f"Question number {i}?", stream=i % 2 == 0)
                _complete(client, f"count {i} {i} {i} {i} {i} {i}", stream=i % 2 == 1)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a request of the load hung"


@pytest.mark.server
@pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is not installed (Debian: apt-get install -y prometheus); "
    "the dashboard's PromQL is only evaluated against a real Prometheus",
)
def test_every_dashboard_expression_returns_data_on_prometheus(tiny_llama, tmp_path):
    started = time.monotonic()
    engines: list[LiveServer] = []
    router = prometheus = None
    try:
        engines += [_engine(tiny_llama[0]) for _ in range(2)]
        router = ThreadServer(
            build_router_app(
                RouterConfig(
                    port=0,
                    backends=[e.url for e in engines],
                    policy="cache_aware",
                    health_interval_s=0.2,
                    load_poll_s=0.1,
                    connect_timeout_s=2,
                    health_timeout_s=2,
                    timeout_s=30,
                )
            )
        )
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: kvflow\n    metrics_path: /metrics\n    static_configs:\n"
            f"      - targets: [{', '.join(repr(_hostport(e.url)) for e in engines)}]\n"
            "  - job_name: kvflow-router\n    metrics_path: /metrics\n    static_configs:\n"
            f"      - targets: [{_hostport(router.url)!r}]\n"
        )
        port = free_port()
        prometheus = _Prometheus(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            port,
            startup_timeout=20,
            stop_timeout=10,
            name="prometheus",
            log_path=str(tmp_path / "prometheus.log"),
            echo=False,
            die_with_parent=True,
        )
        prometheus.start()
        # every target scraped (at zero) before the first request, so rates see the whole load
        wait_for(
            lambda: sorted(s["value"][1] for s in prometheus.vector("up")) == ["1"] * 3,
            15,
            "prometheus did not scrape the engines and the router",
            interval=0.2,
        )
        _load(router.url)
        for e in engines:
            e.wait_engine_idle()
        tokens = sum(e.metrics()["kvflow:generation_tokens_total"] for e in engines)
        sent = sum(
            v for k, v in parse_metrics(httpx.get(router.url + "/metrics").text).items() if "requests_total" in k
        )
        assert tokens > 0 and sent >= 14

        def scraped() -> bool:
            got = prometheus.vector("sum(kvflow:generation_tokens_total)")
            routed = prometheus.vector("sum(kvflow_router:requests_total)")
            return bool(got and routed) and float(got[0]["value"][1]) == tokens and float(routed[0]["value"][1]) == sent

        wait_for(scraped, 10, "prometheus did not see the final counters", interval=0.2)
        time.sleep(2.5)  # two more scrapes: a labelled series born at the end has two samples

        failures = []
        expressions = _expressions(_dashboard())
        assert set(POSITIVE) <= {where for where, _ in expressions}
        for where, expr in expressions:
            answer = prometheus.query(_concrete(expr))
            if answer.get("status") != "success":
                failures.append(f"{where}: does not evaluate: {answer.get('error')}\n    {expr}")
                continue
            result = answer["data"]["result"]
            values = [float(s["value"][1]) for s in result]
            if not result:
                failures.append(f"{where}: no data\n    {expr}")
            elif not any(math.isfinite(v) for v in values):
                failures.append(f"{where}: only NaN / Inf ({values})\n    {expr}")
            elif where in POSITIVE and not any(v > 0 for v in values):
                failures.append(f"{where}: zero after the load ({values})\n    {expr}")
        assert not failures, "\n".join(failures)
    finally:
        if prometheus is not None:
            prometheus.stop()
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
    assert prometheus.proc.poll() is not None
    print(f"dashboard on Prometheus: {time.monotonic() - started:.1f} s")
