"""The `mindloom` command: train, launch, estimate-memory, generate, export-hf, check-env, demo.

Each group of subcommands lives in its own `_cmd_*.py` module exposing
`add_parser(subparsers)` (which sets `func` on its parsers), as in mindloom-data. Every
expected error is one line on stderr (`error: ...`) and the exit code of its row in
`_errors.EXIT_TABLE` (the README's exit-code table); no tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mindloom_train.__about__ import __version__

# One module per group of subcommands; add a line when a new group lands.
COMMAND_MODULES: list[str] = [
    "mindloom_train._cmd_train",
    "mindloom_train._cmd_generate",
    "mindloom_train._cmd_env",
    "mindloom_train._cmd_demo",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage wall
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mindloom", description="Pretrain Llama-family models on MindSpore.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    os.environ.setdefault("GLOG_v", "3")
    from mindloom_train._errors import classify

    try:
        return int(args.func(args) or 0)
    except (Exception, KeyboardInterrupt) as exc:  # _errors.EXIT_TABLE; anything else is a bug
        known = classify(exc)
        if known is None:
            raise
        print(f"error: {known[1]}", file=sys.stderr)
        return known[0]


if __name__ == "__main__":
    raise SystemExit(main())
