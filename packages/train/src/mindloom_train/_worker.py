"""One msrun worker of `mindloom launch`: the same run as `mindloom train`, one rank of it."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from mindloom_parallel import guard_worker, mark_run_ended

    guard_worker()  # never outlive msrun or the launcher
    from mindloom_train._cli import main as cli_main

    code = cli_main(["train", *(sys.argv[1:] if argv is None else argv)])
    mark_run_ended(code)  # the run's files are durable: what MindSpore's teardown does next
    return code


if __name__ == "__main__":
    raise SystemExit(main())
