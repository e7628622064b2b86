"""`python -m mindloom_monitor` runs the `mindloom-monitor` command."""

from mindloom_monitor._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
