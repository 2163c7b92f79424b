"""How the commands that print tables print them: wide enough in a pipe, or as JSON.

rich lays a table out for 80 columns when stdout is not a terminal, and cuts what does not fit
(`key-…`, `$0.0…`): a script reading `spine keys list | grep` got ids and money it could not use.
In a pipe the table is laid out as wide as its content; `--output json` (or `--json`) gives the
same rows as JSON, for programs.
"""

from __future__ import annotations

import argparse

from rich.console import Console

# Columns a table may take when stdout is not a terminal: wider than any row these commands print.
PIPE_WIDTH = 1000


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """`--output table|json`, and `--json` for `--output json`."""
    parser.add_argument("--output", choices=("table", "json"), default="table",
                        help="tables for people, or JSON for programs")
    parser.add_argument("--json", dest="output", action="store_const", const="json",
                        help="the same as --output json")


def as_json(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "output", "table") == "json")


def table_console() -> Console:
    """A console for tables: the terminal's width in a terminal; in a pipe, wide enough that no
    id, amount or name is cut."""
    console = Console()
    if console.is_terminal:
        return console
    return Console(width=PIPE_WIDTH)


def dollars(usd: float) -> str:
    """An amount as set, never rounded: 12.345678 stays 12.345678 (`:g` kept six digits: 12.3457),
    5 is 5.00."""
    text = f"{usd:.6f}".rstrip("0")
    whole, _, cents = text.partition(".")
    return f"{whole}.{cents.ljust(2, '0')}"
