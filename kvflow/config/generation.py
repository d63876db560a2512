"""Requests' default sampling parameters, from the model's generation_config.json, as vLLM's
`--generation-config auto` takes them: a request that leaves out `temperature`, `top_p`, `top_k`,
`min_p` or `repetition_penalty` gets the model creator's recommended value instead of the API's
default (Qwen's instruct models ship temperature 0.7, top_p 0.8, top_k 20, repetition_penalty
1.05). `--override-generation-config` sets or replaces any of them. `max_new_tokens` is not
taken: a request's output length stays its own max_tokens (or the context)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvflow.config.options import json_object

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
# HF's GenerationConfig defaults: a file's value equal to one of these recommends nothing (vLLM
# reads the file's difference from them), e.g. the top_k 50 HF writes into files it saves.
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}
SOURCES = ("auto", "vllm")  # or a folder holding a generation_config.json


def read_override(value: Any) -> dict[str, Any] | None:
    """--override-generation-config as a dict of SamplingParams fields (None: none), or a
    ValueError naming the option and the keys it takes (their ranges are SamplingParams', checked
    when the engine starts: `default_sampling`)."""
    if value is None:
        return None
    value = json_object(value, "override_generation_config", set(SAMPLING_KEYS))
    bad = sorted(k for k, v in value.items() if isinstance(v, bool) or not isinstance(v, (int, float)))
    if bad:
        raise ValueError(f"override_generation_config: {bad[0]} must be a number, got {value[bad[0]]!r}")
    return {SAMPLING_KEYS[k]: v for k, v in value.items()}


def check_source(source: str) -> None:
    if source in SOURCES:
        return
    if not (Path(source).expanduser() / "generation_config.json").is_file():
        raise ValueError(
            f"generation_config must be auto, vllm or a folder holding a generation_config.json; {source!r} holds none"
        )


def default_sampling(
    source: str,
    model_generation_config: dict[str, Any],
    override: dict[str, Any] | None,
    check: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """The default sampling parameters (SamplingParams fields) for requests that leave them out:
    from the model's generation config (`source` auto), none (vllm), or a folder's file; then the
    override's. `check(values)` (SamplingParams' own validation) raises on a value out of range:
    re-raised naming where the value came from."""
    if source == "auto":
        found, origin = model_generation_config, "the model's generation_config.json"
    elif source == "vllm":
        found, origin = {}, ""
    else:
        path = Path(source).expanduser() / "generation_config.json"
        found, origin = json.loads(path.read_text()), str(path)
    defaults = {
        field: found[key]
        for key, field in SAMPLING_KEYS.items()
        if key in found and found[key] is not None and found[key] != _HF_DEFAULTS[key]
    }
    for values, where in ((defaults, origin), (override or {}, "override_generation_config")):
        try:
            check(values)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return {**defaults, **(override or {})}
