"""Every `EngineConfig` field as a `--dashed-flag`, so the CLI and `LLM(...)` never drift apart.
`add_dataclass_args` does the same for any config dataclass (e.g. `ServerConfig`), with the help text
and accepted values each field declares (`kvflow.config.options.option`); `dataclass_flags` goes back
from parsed flags to a command line (the replicas of `kvflow serve --data-parallel-size`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from kvflow.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    add_dataclass_args(parser, EngineConfig, "engine options", exclude)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str, exclude: tuple[str, ...] = ()) -> None:
    """One `--dashed-flag` per field of the dataclass `cls`, typed from its annotations, with the help
    and choices its field metadata declares (fields in `exclude` keep their defaults: the command uses
    those flags for something else). Choices are shown, not enforced here: the config's own check
    gives the error, so a flag and an `LLM(...)` keyword fail with the same message."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or f.name in exclude:
            continue
        kind = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        text = f"{f.metadata.get('help', f.name.replace('_', ' '))} (default: {default})"
        choices = f.metadata.get("choices")
        metavar = "{" + ",".join(str(c) for c in choices if c is not None) + "}" if choices else None
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif typing.get_origin(kind) is list:
            group.add_argument(flag, dest=f.name, nargs="+", action=_ListAction, default=default, help=text)
        elif typing.get_origin(kind) is dict:
            group.add_argument(flag, dest=f.name, type=_json_object, default=default, help=text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=default, metavar=metavar, help=text)


def dataclass_kwargs(cls: type, args: argparse.Namespace) -> dict[str, typing.Any]:
    """The dataclass fields that `args` carries (flags excluded at registration are left out)."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if not f.name.startswith("_") and hasattr(args, f.name)
    }


def dataclass_from_args(cls: type, args: argparse.Namespace):
    return cls(**dataclass_kwargs(cls, args))


def dataclass_flags(cls: type, args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> list[str]:
    """The `--flags` that give another `kvflow` command the same fields of `cls` as `args` holds:
    every field whose value differs from the flag's default (those in `exclude`, or absent from
    `args`, left out), in the syntax `add_dataclass_args` parses."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or f.name in exclude or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if value is None or value == default:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        if kind is bool:
            out.append(flag if value else "--no-" + flag[2:])
        elif typing.get_origin(kind) is list:
            out += [flag, ",".join(str(x) for x in value)]
        elif typing.get_origin(kind) is dict:
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _json_object(value: str) -> dict:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return obj


class _ListAction(argparse.Action):
    """A list flag: its values space- or comma-separated (`--x a b`, `--x a,b`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [x for v in values for x in _comma_list(v)])


def _comma_list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def _base_type(hint: typing.Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return dataclass_from_args(EngineConfig, args)
