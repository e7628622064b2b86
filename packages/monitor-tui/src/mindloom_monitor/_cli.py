"""The `mindloom-monitor` command."""

from __future__ import annotations

import argparse
import os
import sys
import time

from mindloom_monitor.__about__ import __version__


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage wall
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for run_dir in args.run_dirs:
        if not os.path.isdir(run_dir):
            what = "not a directory" if os.path.exists(run_dir) else "no such directory"
            print(f"error: run directory {run_dir!r}: {what}", file=sys.stderr)
            return 2
        for name in ("metrics.jsonl", "train.log"):
            path = os.path.join(run_dir, name)
            # a FIFO there would block every read of it (stat follows a symlink: a link to
            # a regular file is fine to read)
            if os.path.exists(path) and not os.path.isfile(path):
                print(f"error: {path}: not a regular file; refusing to read it", file=sys.stderr)
                return 2
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


if __name__ == "__main__":
    raise SystemExit(main())
