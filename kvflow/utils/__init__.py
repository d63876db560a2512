"""Small helpers shared across kvflow, with no engine, model or torch behind them.

- `processes`: server processes in their own process group with a log file (`ManagedProcess`),
  free ports, CPU pinning (`taskset`), process-group signals;
- `ray`: joining or starting Ray;
- `http`: the host part of a URL for a bind address;
- `prometheus`: the Prometheus text parser (samples as (name, labels, value));
- `validation`: type checks for values from JSON or Python callers (`is_int`, `is_number`).
"""
