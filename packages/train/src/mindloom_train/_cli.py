"""The `mindloom` command: train, launch, estimate-memory, generate, export-hf, check-env, demo.

Every error is one line on stderr (`error: ...`) and a non-zero exit; no tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys

from mindloom_train.__about__ import __version__


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage wall
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text[:200]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="run config (YAML)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable), e.g. --set training.train_iters=100",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mindloom", description="Pretrain Llama-family models on MindSpore.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("train", help="train on one process from a config")
    _add_config_args(p)

    p = sub.add_parser("launch", help="train on N processes under msrun")
    _add_config_args(p)
    p.add_argument("--nproc", type=_positive_int, required=True, help="workers on this node")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--log-dir", default=None, help="per-rank logs (default RUN_DIR/msrun_logs)")
    p.add_argument("--timeout", type=int, default=600, help="rendezvous timeout, seconds")
    p.add_argument("--stop-grace", type=float, default=300.0,
                   help="after SIGTERM/SIGINT: seconds the workers get to save before a kill")  # fmt: skip

    p = sub.add_parser("estimate-memory", help="per-rank memory of a config, and whether it fits")
    _add_config_args(p)
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="ranks (default: parallelism dp*tp*pp)")  # fmt: skip
    p.add_argument("--device", default=None,
                   help="cpu, ascend-910b2, ascend-910c, a100-80gb, h100-80gb, h200, ... "
                   "(default: from context.device_target)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the breakdown as JSON, for scripts")

    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="a step directory or a save path")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=_positive_int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the run's)")

    p = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face Llama directory")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])

    p = sub.add_parser("check-env", help="check MindSpore, the device and (with --nproc) msrun")
    p.add_argument("--nproc", type=int, default=0, help="also all-reduce across N msrun workers")
    p.add_argument("--device-target", default="CPU", choices=["CPU", "Ascend", "GPU"])
    p.add_argument("--timeout", type=int, default=120)

    p = sub.add_parser("demo", help="the main job end to end on the bundled corpus")
    p.add_argument("--quick", action="store_true", help="a few seconds of training (tests)")
    p.add_argument("--minutes", type=float, default=3.0, help="training time limit (safety)")
    p.add_argument("--run-dir", default="runs/demo")
    return parser


def _train(args) -> int:
    from mindloom_train._config import load_config
    from mindloom_train._trainer import train

    cfg = load_config(args.config, args.overrides)
    return train(cfg)  # the run's own error path: _errors.classify, one table


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    os.environ.setdefault("GLOG_v", "3")
    from mindloom_train._commands import CommandError, dispatch

    try:
        if args.command == "train":
            return _train(args)
        return dispatch(args)
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the exit-code table of _errors; anything else is a bug
        from mindloom_train._errors import classify

        known = classify(exc)
        if known is None:
            raise
        print(f"error: {known[1]}", file=sys.stderr)
        return known[0]


if __name__ == "__main__":
    raise SystemExit(main())
