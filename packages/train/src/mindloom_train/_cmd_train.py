"""`mindloom train`, `mindloom launch` and `mindloom estimate-memory`: a run config on one
process, on N msrun workers, or only its memory estimate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mindloom_train._cliargs import add_config_args, positive_int
from mindloom_train._errors import CommandError


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train on one process from a config")
    add_config_args(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("launch", help="train on N processes under msrun")
    add_config_args(p)
    p.add_argument("--nproc", type=positive_int, required=True, help="workers on this node")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--log-dir", default=None, help="per-rank logs (default RUN_DIR/msrun_logs)")
    p.add_argument("--timeout", type=int, default=600, help="rendezvous timeout, seconds")
    p.add_argument("--stop-grace", type=float, default=300.0,
                   help="after SIGTERM/SIGINT: seconds the workers get to save before a kill")  # fmt: skip
    p.set_defaults(func=_cmd_launch)

    p = sub.add_parser("estimate-memory", help="per-rank memory of a config, and whether it fits")
    add_config_args(p)
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="ranks (default: parallelism dp*tp*pp; an unset dp is derived "
                   "from it)")  # fmt: skip
    p.add_argument("--device", default=None,
                   help="cpu, ascend-910b2, ascend-910c, a100-80gb, h100-80gb, h200, ... "
                   "(default: from context.device_target)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the breakdown as JSON, for scripts")
    p.set_defaults(func=_cmd_estimate_memory)


def _cmd_train(args) -> int:
    from mindloom_train._config import load_config, msrun_world_size
    from mindloom_train._trainer import train

    # an msrun worker derives an unset parallelism.dp from msrun's worker count, as the
    # launcher did before starting it (one process: dp 1)
    cfg = load_config(args.config, args.overrides, world_size=msrun_world_size())
    return train(cfg)  # the run's own error path: _errors.classify, one table


def _cmd_launch(args) -> int:
    from mindloom_parallel import LaunchError

    from mindloom_train._config import load_config

    # parallelism.dp not given: world / (tp*pp), the same rule each worker applies
    cfg = load_config(args.config, args.overrides, world_size=args.nproc * args.nnodes)
    lock = None
    if args.node_rank == 0:  # one live job per run directory (the other nodes share it)
        from mindloom_parallel import RunLock

        try:
            lock = RunLock(Path(cfg.run_dir) / ".launch.lock").acquire()
        except LaunchError as exc:
            raise CommandError(f"launch: {exc}") from None
        if lock.stale:
            print(f"launch: took over a stale run lock ({lock.stale})", file=sys.stderr)
    try:
        return _launch_locked(args, cfg, lock)
    finally:
        if lock is not None:
            lock.release()


def _launch_locked(args, cfg, lock) -> int:
    from mindloom_parallel import (
        LaunchError,
        LaunchStopped,
        ParallelConfigError,
        ParallelDims,
        launch,
    )

    from mindloom_train._config import ConfigError

    pcfg = ParallelDims.from_section(cfg.parallelism)
    world = args.nproc * args.nnodes
    try:
        pcfg.check(_model_before_tokenizer(cfg), world, cfg.training.global_batch_size,
                   cfg.training.micro_batch_size, cfg.train_dataset.seq_length)  # fmt: skip
    except ParallelConfigError as exc:  # a config error (exit 2), before any heavy work
        raise ConfigError(f"config parallelism: {exc}") from None
    # tokenizer and datasets are prepared once here, never raced by the workers
    from mindloom_train import _data

    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    if args.node_rank == 0:
        tok = _data.prepare_tokenizer(cfg, log)
        if not cfg.model.get("init_from_hf"):
            # the model's numbers (heads, vocabulary, layers) against the layout, still
            # before any worker starts
            from mindloom_train._modelcfg import build_model_config

            try:
                pcfg.check(build_model_config(cfg, tok.vocab_size), world,
                           cfg.training.global_batch_size, cfg.training.micro_batch_size,
                           cfg.train_dataset.seq_length)  # fmt: skip
            except ParallelConfigError as exc:
                raise ConfigError(f"config parallelism: {exc}") from None
        if not cfg.model.get("init_from_hf"):  # the table; too big: exit 2, no worker starts
            from mindloom_train._memory import preflight

            preflight(cfg, tok.vocab_size, world, log, ranks_per_host=args.nproc)
        tok_path = _data.tokenizer_dir(cfg)
        _data.prepare_dataset(cfg, cfg.train_dataset, "train", tok_path, log)
        if cfg.eval_dataset is not None:
            _data.prepare_dataset(cfg, cfg.eval_dataset, "eval", tok_path, log)
    log_dir = args.log_dir or str(Path(cfg.run_dir) / "msrun_logs")
    script = ["-m", "mindloom_train._worker", str(Path(args.config).resolve())]
    for item in args.overrides:
        script += ["--set", item]
    try:
        launch(
            script,
            nproc=args.nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            log_dir=log_dir,
            cluster_timeout_s=args.timeout,
            stop_grace_s=args.stop_grace,
            lock=lock,
            collective_timeout_s=_collective_timeout_s(cfg),
        )
    except LaunchStopped as exc:  # the documented clean stop: exit 0, like one process
        print(f"launch: {exc}", file=sys.stderr)
        return 0
    except LaunchError as exc:
        raise CommandError(f"launch: {exc}") from None
    except ParallelConfigError as exc:
        raise CommandError(f"config parallelism: {exc}") from None
    print(f"launch: {world} workers finished; per-rank logs in {log_dir}")
    return 0


def _collective_timeout_s(cfg) -> int:
    """MindSpore's own limit on a collective, above every budget of the step watchdog:
    a rank waiting for a compiling, evaluating or saving peer is within budget, and a hung
    peer is reported by the watchdog (rank, step, phase), not by a failed AllReduce."""
    p = cfg.parallelism
    return int(max(p.first_step_timeout_s, p.comm_timeout_s)) + 120


def _model_before_tokenizer(cfg) -> dict | None:
    """The model's numbers the layout is checked against before a tokenizer is trained
    (heads, layers, FFN); the vocabulary only when the config fixes it."""
    if cfg.model.get("init_from_hf"):
        return None
    import dataclasses

    from mindloom_train._modelcfg import build_model_config

    mdict = dataclasses.asdict(build_model_config(cfg, None))
    if cfg.model.get("vocab_size") is None:
        mdict["vocab_size"] = None  # the tokenizer's: checked once it exists
    return mdict


def _cmd_estimate_memory(args) -> int:
    """The per-rank breakdown (table or JSON); exit 0 when it fits, 1 when it does not."""
    from mindloom_train._config import load_config
    from mindloom_train._memory import check_precision, estimate, format_table

    cfg = load_config(args.config, args.overrides, world_size=args.nproc)
    check_precision(cfg)
    est = estimate(cfg, nproc=args.nproc, device=args.device)
    if args.json:
        print(json.dumps(est.to_json(), indent=1))
    else:
        print(format_table(est))
    return 0 if est.fits else 1
