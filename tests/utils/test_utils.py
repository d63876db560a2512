"""kvflow.utils: the URL host of a bind address, the Prometheus text parser (and the tests' dict view
of it), the int / number checks, ports on a given host. No servers."""

from __future__ import annotations

import socket

import pytest

from kvflow.utils import processes
from kvflow.utils.http import url_host
from kvflow.utils.processes import free_ports
from kvflow.utils.prometheus import by_label, parse_prometheus, sample_sum
from kvflow.utils.validation import is_int, is_number

from server_utils import parse_metrics


@pytest.mark.parametrize(
    "host, want",
    [
        ("127.0.0.1", "127.0.0.1"),
        ("localhost", "localhost"),
        ("example.com", "example.com"),
        ("10.1.2.3", "10.1.2.3"),
        ("::1", "[::1]"),  # an IPv6 literal is bracketed in a URL
        ("fe80::1", "[fe80::1]"),
        ("[::1]", "[::1]"),  # already bracketed: not twice
        ("0.0.0.0", "127.0.0.1"),  # every IPv4 address: reached on the IPv4 loopback
        ("", "127.0.0.1"),
        ("::", "[::1]"),  # every IPv6 address: reached on the IPv6 loopback (even when IPv6-only)
        ("0:0:0:0:0:0:0:0", "[::1]"),
    ],
)
def test_url_host(host, want):
    assert url_host(host) == want
    assert f"http://{url_host(host)}:8000".startswith("http://")


TEXT = """# HELP kvflow:request_success_total Finished requests
# TYPE kvflow:request_success_total counter
kvflow:request_success_total{finished_reason="stop"} 7.0
kvflow:request_success_total{finished_reason="length"} 2.0
kvflow:num_requests_running 3.0
kvflow:kv_cache_usage_perc NaN
odd{a="x\\"y",b="back\\\\slash",c="two\\nlines"} 3 1700000000000
not a sample
<html>hello</html>

kvflow_router:requests_total{backend="http://127.0.0.1:8101",role="backend"} 4.0
"""


def test_parse_prometheus_reads_samples_and_skips_the_rest():
    s = parse_prometheus(TEXT)
    assert [n for n, _, _ in s] == [
        "kvflow:request_success_total",
        "kvflow:request_success_total",
        "kvflow:num_requests_running",
        "kvflow:kv_cache_usage_perc",
        "odd",
        "kvflow_router:requests_total",
    ]
    assert ("odd", {"a": 'x"y', "b": "back\\slash", "c": "two\nlines"}, 3.0) in s  # timestamp ignored
    assert sample_sum(s, "kvflow:request_success_total") == 9.0
    assert sample_sum(s, "kvflow:request_success_total", finished_reason="stop") == 7.0
    assert sample_sum(s, "missing") == 0.0
    assert by_label(s, "kvflow:request_success_total", "finished_reason") == {"stop": 7.0, "length": 2.0}
    only = parse_prometheus(TEXT, names=("kvflow:num_requests_running", "kvflow:kv_cache_usage_perc"))
    assert [n for n, _, _ in only] == ["kvflow:num_requests_running", "kvflow:kv_cache_usage_perc"]
    assert parse_prometheus("kvflow:num_requests_running_other 1\n", names=["kvflow:num_requests_running"]) == []
    assert parse_prometheus("") == []


def test_parse_metrics_keys_are_the_lines_as_written():
    m = parse_metrics(TEXT)
    assert m['kvflow:request_success_total{finished_reason="stop"}'] == 7.0
    assert m["kvflow:num_requests_running"] == 3.0
    assert m['odd{a="x\\"y",b="back\\\\slash",c="two\\nlines"}'] == 3.0
    assert m['kvflow_router:requests_total{backend="http://127.0.0.1:8101",role="backend"}'] == 4.0


def test_parse_metrics_round_trips_prometheus_client_output():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    Counter("kvflow:errors", "errors", ["backend", "reason"], registry=registry).labels('http://h:1/"q"', "a\\b").inc(2)
    Gauge("kvflow:num_requests_waiting", "waiting", registry=registry).set(5)
    m = parse_metrics(generate_latest(registry).decode())
    assert m["kvflow:num_requests_waiting"] == 5.0
    assert m['kvflow:errors_total{backend="http://h:1/\\"q\\"",reason="a\\\\b"}'] == 2.0


def test_is_int_and_is_number():
    assert is_int(3) and is_int(0) and is_int(-1)
    assert not any(is_int(x) for x in (True, False, 3.0, "3", None))
    assert is_number(1) and is_number(0.5) and is_number(float("inf"))
    assert not any(is_number(x) for x in (True, float("nan"), "1", None))


def test_free_ports_skip_the_excluded(monkeypatch):
    """A port promised to a server that has not bound it yet is free to the OS, which may hand it
    out again: free_ports picks past it (holding it meanwhile), and says so when it cannot."""
    picks = iter([5001, 5002, 5003, 5004])

    class FakeSocket:
        def __init__(self, *args):
            self.port = None

        def bind(self, addr):
            self.port = next(picks)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(processes.socket, "socket", FakeSocket)
    assert free_ports(3, exclude=[5002]) == [5001, 5003, 5004]
    picks = iter([7000] * 100)
    with pytest.raises(OSError, match="no 1 free TCP ports on 127.0.0.1 outside \\[7000\\]"):
        free_ports(1, exclude=[7000])


def test_free_ports_on_a_host():
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[0]))  # free indeed
    if socket.has_ipv6:
        try:
            [p6] = free_ports(1, "::1")
        except OSError:
            pytest.skip("no IPv6 loopback here")
        assert 0 < p6 < 65536
