"""The `mindloom-data` command.

Each subcommand lives in its own `_cmd_*.py` module exposing `add_parser(subparsers)`
(which sets `func=run` on its parser) so that the CLI stays a thin dispatcher. A command
returns its exit code or raises; `EXIT_CODES` is the one table from an expected failure
to its exit code and its one `error: ...` line (the README's "Exit codes" lists it).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mindloom_tokenizer import TokenizerError

from mindloom_data.__about__ import __version__
from mindloom_data._clean_config import CleanError
from mindloom_data._executors import ExecutorError
from mindloom_data._indexed import IndexedDatasetError
from mindloom_data._normalize import MissingExtraError
from mindloom_data._readers import NoInputError
from mindloom_data._safe_yaml import shown

# One module per group of subcommands; add a line when a new group lands.
COMMAND_MODULES: list[str] = [
    "mindloom_data._cmd_tokenize",
    "mindloom_data._cmd_clean",
]

MAX_MESSAGE = 500  # an error may echo a config value or a path: never a wall of text
USAGE_EXIT = 2  # argparse's usage errors, and a flag value a command refuses


def _os_error(exc: OSError) -> str:  # e.g. ENOSPC: one line naming the file
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or shown(str(exc), MAX_MESSAGE)}"


def _plain(exc: BaseException) -> str:
    return shown(str(exc), MAX_MESSAGE)


# exception -> (exit code, its `error:` line); the first row that matches decides.
EXIT_CODES: tuple[tuple[type[BaseException] | tuple, int, object], ...] = (
    (KeyboardInterrupt, 130, lambda _: "interrupted; rerun the same command to resume"),
    (
        (
            CleanError,
            ExecutorError,
            MissingExtraError,
            NoInputError,
            IndexedDatasetError,
            TokenizerError,
            ValueError,
        ),
        1,
        _plain,
    ),  # fmt: skip
    (OSError, 1, _os_error),
)


def exit_code(exc: BaseException) -> tuple[int, str] | None:
    """(code, message) for an expected failure; None lets anything else propagate."""
    for types, code, message in EXIT_CODES:
        if isinstance(exc, types):
            return code, message(exc)
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage wall
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(USAGE_EXIT)


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
        return USAGE_EXIT
    try:
        return int(args.func(args) or 0)
    except BaseException as exc:
        known = exit_code(exc)
        if known is None:
            raise
        print(f"error: {known[1]}", file=sys.stderr)
        return known[0]


if __name__ == "__main__":
    raise SystemExit(main())
