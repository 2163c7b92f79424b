"""docs/cli.md says every flag the parser takes, and no flag it does not: each command's section
(`## \\`spine up\\``, …) names each of its flags, in its synopsis or its text."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from spine.cli import build_parser

DOC = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def commands(parser: argparse.ArgumentParser, prefix: str = "spine") -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its words (`spine keys create`), subcommands included."""
    found = {prefix: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.update(commands(child, f"{prefix} {name}"))
    return found


def section(command: str) -> str:
    """The text of docs/cli.md's section for `command` (or for the command above it)."""
    words = command.split()
    while words:
        heading = re.search(rf"^## `{re.escape(' '.join(words))}`.*?$(.*?)(?=^## |\Z)", DOC, re.M | re.S)
        if heading:
            return heading.group(1)
        words = words[:-1]
    return ""


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings
            if option.startswith("--") and option != "--help"}


ALL = commands(build_parser())
LEAVES = {name: parser for name, parser in ALL.items()
          if not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)}


@pytest.mark.parametrize("command", sorted(LEAVES))
def test_every_flag_of_a_command_is_in_its_section_of_docs_cli(command: str) -> None:
    text = section(command)
    assert text, f"docs/cli.md has no section for {command}"
    missing = sorted(flags(LEAVES[command]) - set(FLAG.findall(text)) - flags(ALL["spine"]))
    assert not missing, f"docs/cli.md's section for {command} does not mention {missing}"


def test_every_flag_in_docs_cli_is_one_a_command_takes() -> None:
    known = set().union(*(flags(parser) for parser in ALL.values()))
    runner = re.search(r"^## The controller.*?(?=^## )", DOC, re.M | re.S)
    theirs = set(FLAG.findall(runner.group(0))) if runner else set()  # python -m migration.runner's own
    other = set(FLAG.findall(DOC.split("## Other entry points")[-1]))
    unknown = sorted(set(FLAG.findall(DOC)) - known - theirs - other - {"--help"})
    assert not unknown, f"docs/cli.md names flags no command takes: {unknown}"
