"""The `mindloom-tokenizer` command: train, eval, export.

Each subcommand lives in its own `_cmd_*.py` module exposing `add_parser(subparsers)`
(which sets `func=run` on its parser), as in mindloom-data, so this module stays a thin
dispatcher. A command returns its exit code or raises; `EXIT_CODES` is the one table from
an expected failure to its exit code and its one `error:` line (listed in the README).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mindloom_tokenizer.__about__ import __version__
from mindloom_tokenizer._readers import NoInputError
from mindloom_tokenizer._tokenizer import TokenizerError

COMMAND_MODULES: list[str] = [
    "mindloom_tokenizer._cmd_train",
    "mindloom_tokenizer._cmd_eval",
    "mindloom_tokenizer._cmd_export",
]

USAGE_EXIT = 2  # argparse's usage errors, and a flag value a command refuses


def _os_error(exc: OSError) -> str:
    where = f" {exc.filename}" if exc.filename else ""
    return f"{where} {exc.strerror or exc}"


# exception -> (exit code, the text after `error:`); the first row that matches decides.
EXIT_CODES: tuple[tuple[type[BaseException] | tuple, int, object], ...] = (
    (KeyboardInterrupt, 130, lambda _: " interrupted"),
    ((TokenizerError, NoInputError), 1, lambda exc: f" {exc}"),
    (OSError, 1, _os_error),
)


def exit_code(exc: BaseException) -> tuple[int, str] | None:
    """(code, message) for an expected failure; None lets anything else propagate."""
    for types, code, message in EXIT_CODES:
        if isinstance(exc, types):
            return code, message(exc)
    return None


class _Exit(Exception):
    def __init__(self, code: int):
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and never exits the interpreter."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise _Exit(USAGE_EXIT)

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            print(message.rstrip("\n"), file=sys.stderr)
        raise _Exit(status)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mindloom-tokenizer",
        description="Train, evaluate and export tokenizers for LLM pretraining.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _Exit as exc:
        return exc.code
    if args.command is None:
        parser.print_help()
        return USAGE_EXIT
    try:
        return int(args.func(args) or 0)
    except BaseException as exc:
        known = exit_code(exc)
        if known is None:
            raise
        print(f"error:{known[1]}", file=sys.stderr)
        return known[0]


if __name__ == "__main__":
    raise SystemExit(main())
