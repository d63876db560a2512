"""How a config field declares itself: its default, its help text and the values it accepts.

Each option is declared once, here in `kvflow/config/`: `EngineConfig` and `ServerConfig` validate
against the declared choices, the CLI turns every field into a `--dashed-flag` with that help, and
docs/cli.md is generated from the CLI.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field carrying its CLI help and, where the value is one of a fixed set, `choices`
    (checked by `check_choices`; `None` among them means "unset is allowed")."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None}
    return dataclasses.field(default=default, metadata=metadata)


def choices_text(choices: Sequence[Any]) -> str:
    """`a, b, c` (and `(or unset)` when None is accepted), as error messages and help print them."""
    named = ", ".join(str(c) for c in choices if c is not None)
    return named + (" (or unset)" if None in choices else "")


def check_choices(obj: Any) -> None:
    """Raise a ValueError naming the field, the accepted values and the value given, for the first
    field of the dataclass `obj` whose value is not among its declared choices."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {choices_text(choices)}, got {value!r}")


def json_object_fields(cls: type, value: Any, option: str) -> dict[str, Any]:
    """A JSON-object option (a dict, or its JSON text) as the keyword arguments of the dataclass
    `cls`: a ValueError naming `option` for text that is not JSON, a value that is not an object,
    or keys that `cls` has no field for (the valid ones listed)."""
    return json_object(value, option, {f.name for f in dataclasses.fields(cls)})


def json_object(value: Any, option: str, known: set[str]) -> dict[str, Any]:
    """A JSON-object option (a dict, or its JSON text) whose keys are among `known`: a ValueError
    naming `option` for text that is not JSON, a value that is not an object, or other keys (the
    valid ones listed)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{option} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{option}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    return value


def positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_otlp_endpoint(url: str | None) -> None:
    """--otlp-traces-endpoint: an http(s) URL, and the OpenTelemetry packages installed."""
    if url is None:
        return
    if not (isinstance(url, str) and url.startswith(("http://", "https://")) and len(url) > len("https://")):
        raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL of an OTLP collector, got {url!r}")
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "otlp_traces_endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter: "
            "pip install 'kvflow[tracing]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
        ) from e
