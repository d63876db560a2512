"""Reading Prometheus text (a /metrics answer): the one parser kvflow has, used by the router (a
replica's load), the benchmark harnesses and the tests.

A hand-written line parser rather than `prometheus_client.parser`: that one raises on the first line
it cannot read, and the router reads whatever a backend answers (another server's page, an HTML
error); here such lines are skipped and the rest is read.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

Sample = tuple[str, dict[str, str], float]  # (name, labels, value)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def parse_prometheus(text: str, names: Collection[str] | None = None) -> list[Sample]:
    """(name, labels, value) of every sample line, in order; comments, blank and unreadable lines
    are skipped (a timestamp after the value is ignored). Label values are unescaped (\\\\, \\",
    \\n). `names`: only samples with one of these names (the other lines are not parsed)."""
    wanted = frozenset(names) if names is not None else None
    prefixes = tuple(wanted) if wanted is not None else ()
    out: list[Sample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or (wanted is not None and not line.startswith(prefixes)):
            continue
        m = _SAMPLE.match(line)
        if m is None or (wanted is not None and m.group(1) not in wanted):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group(2) or "")}
        out.append((m.group(1), labels, value))
    return out


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def sample_sum(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def by_label(samples: Sequence[Sample], name: str, label: str) -> dict[str, float]:
    """The samples called `name`, summed by the value of their label `label` (those without it left out)."""
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name and label in lab:
            out[lab[label]] = out.get(lab[label], 0.0) + v
    return out
