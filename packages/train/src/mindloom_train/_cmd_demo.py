"""`mindloom demo`: the README's main job end to end on the bundled corpus (`_demo.py`)."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="the main job end to end on the bundled corpus")
    p.add_argument("--quick", action="store_true", help="a few seconds of training (tests)")
    p.add_argument("--minutes", type=float, default=3.0, help="training time limit (safety)")
    p.add_argument("--run-dir", default="runs/demo")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    from mindloom_train._demo import run_demo

    return run_demo(run_dir=Path(args.run_dir), quick=args.quick, minutes=args.minutes)
