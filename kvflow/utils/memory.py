"""The machine's memory as Linux reports it."""

from __future__ import annotations


def meminfo_bytes(field: str = "MemAvailable") -> float | None:
    """A /proc/meminfo field in bytes (MemAvailable, MemTotal, ...); None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None
