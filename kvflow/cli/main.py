"""The `kvflow` command. Sub-commands live in their own modules and import heavy things lazily,
so `kvflow --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# module -> registers these sub-commands
_COMMANDS = ("generate", "serve", "router", "bench", "roofline")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow: an LLM inference serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"kvflow.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"kvflow.cli.{name}":
                continue  # not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
