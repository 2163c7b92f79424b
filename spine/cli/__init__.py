"""`spine`: bring up a layout, call it, run the demo, drive a migration.

    spine up --layout layered|collapsed|mixed [--listen HOST:PORT] [--http-listen HOST:PORT] [--model DIR [--model-id ID]]
             [--deterministic]
    spine model make-tiny --arch llama|gpt2 --out DIR
    spine model get smollm2-135m-instruct --out DIR
    spine call --prompt "hello" [--stream] [--deterministic] [--ca FILE [--cert FILE --key FILE]]
    spine cache build --prompts FILE --out PATH
    spine certs dev --out DIR
    spine demo [--model DIR]
    spine config schema|check
    spine keys import FILE [--from lines|litellm]
    spine migrate ...
    spine keys create|list|update|rotate|revoke|spend ...

A config problem (`--config`) exits 2 with one line per problem, before anything starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from runtime.processes.parent import follow_parent
from runtime.server import AddressError
from services.common import ConfigError
from spine.cli.keys import add_keys_parser
from spine.cli.migrate import add_migrate_parser
from spine.cli.runs import add_run_parsers
from spine.cli.tools import add_tool_parsers
from spine.cli.up import add_up_parser


class DefaultsShown(argparse.HelpFormatter):
    """Help that shows each flag's default, as ArgumentDefaultsHelpFormatter does, but only where
    there is one to show: not `None` (the help then says what stands in for it), not a plain
    switch's `False`, not an empty string, not where the help text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not _shows_default(action) or "default:" in text or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _shows_default(action: argparse.Action) -> bool:
    default = action.default
    hidden = default is None or default is False or default is argparse.SUPPRESS or default in ("", [])
    return bool(action.option_strings) and not hidden


class SpineParser(argparse.ArgumentParser):
    """An argument parser whose help shows defaults (`DefaultsShown`); argparse makes every
    subcommand's parser of the same class as its parent's, so all of `spine`'s are."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """A flag without help gets its default as its help, in `parser` and every subcommand's
    parser below it: argparse shows nothing, not even the default, for a flag without help."""
    for action in parser._actions:
        if action.help is None and _shows_default(action):
            action.help = "(default: %(default)s)"
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


def build_parser() -> argparse.ArgumentParser:
    parser = SpineParser(prog="spine", description="Collapse a layered gRPC middleware stack.")
    parser.add_argument("--config", help="YAML config laid over the default (runtime/default_config.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    add_up_parser(sub)
    add_tool_parsers(sub)
    add_run_parsers(sub)

    from spine.tools.model.cache_build import add_cache_parser

    add_cache_parser(sub)

    add_migrate_parser(sub)
    add_keys_parser(sub)
    _show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    if not follow_parent():
        return 1  # started by `spawn`, whose process died before we could ask to die with it
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.handler(args) or 0)
    except ConfigError as error:
        for line in getattr(error, "problems", None) or str(error).splitlines():
            print(f"config error: {line}", file=sys.stderr)
        return 2
    except AddressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        return _os_error(error)


def _os_error(error: OSError) -> int:
    """A file given on the command line that cannot be read or written, said in one line (exit 2),
    and a reader that went away (`spine config schema | head`) ended quietly. Any other OSError
    is a fault of ours, whose traceback is what a report needs."""
    if isinstance(error, BrokenPipeError):
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    if error.filename is None:
        raise error
    print(f"error: {error.filename}: {error.strerror}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
