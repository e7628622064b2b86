"""The `mindloom-monitor` command.

One command, no subcommands, so the mindloom-data convention reduces to its two halves:
`add_arguments(parser)` and `run(args) -> int`. A refusal raises; `EXIT_CODES` is the one
table from an expected failure to its exit code and its `error:` line (in the README).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from mindloom_monitor.__about__ import __version__

USAGE_EXIT = 2  # argparse's usage errors


class RunDirError(Exception):
    """A run directory, or a file in it, that the monitor refuses to read (one line)."""


# exception -> (exit code, the text after `error: `); the first row that matches decides.
EXIT_CODES: tuple[tuple[type[BaseException] | tuple, int, object], ...] = (
    (RunDirError, 2, str),
    (KeyboardInterrupt, 130, lambda _: "interrupted"),
    (OSError, 1, lambda exc: f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc)),
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


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mindloom-monitor",
        description="Watch mindloom run directories live in the terminal.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to watch")
    parser.add_argument(
        "--once", action="store_true", help="print a plain-text summary of each run and exit"
    )
    parser.add_argument(
        "--stall-after",
        type=_positive,
        default=300.0,
        metavar="SECONDS",
        help="report a run that wrote nothing for this long (default 300)",
    )
    parser.add_argument(
        "--last",
        type=int,
        default=None,
        metavar="N",
        help="start with the plots showing the last N steps (default: all)",
    )


def _check_run_dirs(run_dirs: list[str]) -> None:
    for run_dir in run_dirs:
        if not os.path.isdir(run_dir):
            what = "not a directory" if os.path.exists(run_dir) else "no such directory"
            raise RunDirError(f"run directory {run_dir!r}: {what}")
        for name in ("metrics.jsonl", "train.log"):
            path = os.path.join(run_dir, name)
            # a FIFO there would block every read of it (stat follows a symlink: a link to
            # a regular file is fine to read)
            if os.path.exists(path) and not os.path.isfile(path):
                raise RunDirError(f"{path}: not a regular file; refusing to read it")


def run(args: argparse.Namespace) -> int:
    _check_run_dirs(args.run_dirs)
    from mindloom_monitor._stats import RunData, Settings

    settings = Settings(stall_after_s=args.stall_after)
    if args.once:
        from mindloom_monitor._source import load_run
        from mindloom_monitor._summary import summary

        now = time.time()
        out = []
        for run_dir in args.run_dirs:
            data = RunData(run_dir, settings)
            load_run(run_dir, data)
            data.check_stall(now)
            out.append(summary(data, now))
        sys.stdout.write("\n".join(out))
        return 0

    from mindloom_monitor._app import MonitorApp

    app = MonitorApp(args.run_dirs, settings=settings, last_n=args.last)
    app.run()
    return app.return_code or 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
