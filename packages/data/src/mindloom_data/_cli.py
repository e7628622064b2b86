"""The `mindloom-data` command.

Each subcommand lives in its own `_cmd_*.py` module exposing `add_parser(subparsers)`
(which sets `func=run` on its parser) so that the CLI stays a thin dispatcher.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mindloom_data.__about__ import __version__

# One module per group of subcommands; add a line when a new group lands.
COMMAND_MODULES: list[str] = [
    "mindloom_data._cmd_tokenize",
    "mindloom_data._cmd_clean",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage wall
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mindloom-data", description="Clean, dedup and tokenize corpora.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
