"""docs/cli.md is generated from the `kvflow` argument parsers (tools/gen_cli_docs.py) and must be
current: these tests fail when a flag changed and the page was not regenerated."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "tools" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page(gen) -> str:
    return gen.render()


def test_cli_page_is_current(gen, page):
    on_disk = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert on_disk == page, gen.STALE_MESSAGE


def test_check_fails_on_a_stale_page_and_passes_once_written(gen, tmp_path, capsys):
    out = tmp_path / "cli.md"
    out.write_text("# an old page\n", encoding="utf-8")
    assert gen.main(["--check", "--output", str(out)]) == 1
    assert gen.STALE_MESSAGE in capsys.readouterr().err
    assert gen.main(["--output", str(out)]) == 0
    assert gen.main(["--check", "--output", str(out)]) == 0
    assert gen.main(["--check", "--output", str(tmp_path / "missing.md")]) == 1


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def test_every_command_and_flag_that_help_prints_is_on_the_page(gen, page):
    """Checked against argparse's own `--help` text, not against the generator's walk."""
    commands = list(_commands(gen.build_parser(), ("kvflow",)))
    assert {" ".join(p) for p, _ in commands} >= {
        "kvflow generate",
        "kvflow chat",
        "kvflow serve",
        "kvflow router",
        "kvflow bench",
        "kvflow bench serve",
        "kvflow bench throughput",
        "kvflow roofline",
    }
    sections = re.split(r"^#+ `(kvflow[^`]*)`$", page, flags=re.MULTILINE)
    by_command = dict(zip(sections[1::2], sections[2::2]))
    for path, parser in commands[1:]:
        name = " ".join(path)
        assert name in by_command, f"{name} has no section"
        text = by_command[name]
        # a group shared with an earlier command is referenced, not repeated
        for ref in re.findall(r"the same as for \[`([^`]+)`\]", text):
            text += by_command[ref]
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", parser.format_help())) - {"--help"}
        missing = sorted(f for f in flags if f"`{f}" not in text)
        assert not missing, f"{name}: {missing} not documented"


def test_page_holds_nothing_of_this_machine(page):
    for path in (str(Path.home()), str(ROOT)):
        assert path not in page
