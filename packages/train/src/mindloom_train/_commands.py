"""The subcommands of `mindloom` other than `train`: launch, generate, export-hf, check-env, demo."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any


class CommandError(RuntimeError):
    """One line for `error: ...`."""


def dispatch(args) -> int:
    return {
        "launch": cmd_launch,
        "generate": cmd_generate,
        "export-hf": cmd_export_hf,
        "check-env": cmd_check_env,
        "demo": cmd_demo,
        "estimate-memory": cmd_estimate_memory,
    }[args.command](args)


# ---------------------------------------------------------------------------------------
# checkpoints -> models


BEST = "best"


def best_checkpoint(save_path: str | os.PathLike) -> tuple[Path, float, int]:
    """(step directory, held-out loss, checkpoints with a loss) of the checkpoint with the
    lowest held-out loss that the run recorded for it (common.json `eval`, written when
    the evaluation ran at the checkpoint's own step). A run directory stands for its
    `checkpoints/`. Ties go to the later step; steps newer than `latest` are skipped."""
    from mindloom_train._checkpoint import complete_steps, read_tracker, step_dirname

    root = Path(save_path)
    if not complete_steps(root) and complete_steps(root / "checkpoints"):
        root = root / "checkpoints"
    try:
        tracked = read_tracker(root)
    except Exception:  # an unreadable tracker: every complete step is a candidate
        tracked = None
    found: list[tuple[float, int]] = []
    for step in complete_steps(root):
        if tracked is not None and step > tracked:
            continue
        try:
            ev = json.loads((root / step_dirname(step) / "common.json").read_text()).get("eval")
        except (OSError, ValueError):
            continue
        if (
            isinstance(ev, dict)
            and ev.get("step") == step
            and isinstance(ev.get("loss"), (int, float))
        ):
            if math.isfinite(ev["loss"]):
                found.append((float(ev["loss"]), step))
    if not found:
        raise CommandError(
            f"{root}: no checkpoint records a held-out loss (evaluate at checkpoint steps: "
            "training.eval_interval and checkpoint.save_interval); cannot pick 'best'"
        )
    loss, step = min(found, key=lambda x: (x[0], -x[1]))
    return root / step_dirname(step), loss, len(found)


def resolve_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """`best` / `DIR/best` -> the best step directory (see best_checkpoint); else as given."""
    path = Path(checkpoint)
    if path.name == BEST and not (path / "common.json").exists():
        step_dir, loss, n = best_checkpoint(path.parent)
        print(
            f"checkpoint: {checkpoint} -> {step_dir} (lowest held-out loss {loss:.4f} "
            f"of {n} checkpoint(s) with one)",
            file=sys.stderr,
        )
        return step_dir
    return path


def load_model(checkpoint: str | os.PathLike):
    """(Llama with the checkpoint's weights, Checkpoint) from a step dir, a save path (its
    `latest`) or `SAVE_PATH/best`."""
    from mindloom_model import DeepseekV3, Llama, ModelConfig

    from mindloom_train._checkpoint import CheckpointError, open_checkpoint

    checkpoint = resolve_checkpoint(checkpoint)
    try:
        ckpt = open_checkpoint(Path(checkpoint))
        mdict = ckpt.common.get("model_config")
        if not isinstance(mdict, dict):
            raise CheckpointError(f"{ckpt.path / 'common.json'}: no model_config")
        mcfg = ModelConfig.from_dict(mdict)
        model = DeepseekV3(mcfg) if mcfg.family == "deepseek_v3" else Llama(mcfg)
        params = list(model.get_parameters())
        tensors = ckpt.load_tensors([p.name for p in params])
    except (CheckpointError, ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    import mindspore as ms

    for p in params:
        arr = tensors[p.name]
        if tuple(arr.shape) != tuple(p.shape):
            raise CommandError(
                f"{ckpt.path}: tensor {p.name!r} has shape {list(arr.shape)}, expected {list(p.shape)}"
            )
        p.set_data(ms.Tensor(arr, p.dtype))
    return model, ckpt


def _load_tokenizer(path: str | None, ckpt) -> Any:
    from mindloom_tokenizer import Tokenizer

    where = path or ckpt.common.get("tokenizer")
    if not where:
        raise CommandError(f"{ckpt.path}: records no tokenizer; pass --tokenizer DIR")
    try:
        return Tokenizer.load(where)
    except Exception as exc:  # the tokenizer's own one-line error
        raise CommandError(f"tokenizer {where}: {exc}") from None


def prompt_ids(tok, prompt: str, contract: dict | None) -> tuple[list[int], str]:
    """The prompt's ids as the training data began its documents, and a line saying so.

    `contract` is the checkpoint's `data_contract` (from PREFIX.dataset.json): BOS goes
    first exactly when the training documents started with it. A checkpoint without one
    (older runs, datasets without metadata) gets no BOS, as mindloom-data wrote none
    before `append_bos` existed. A BOS the tokenizer does not have is an error.
    """
    ids = tok.encode(prompt)
    bos = bool(contract and contract.get("append_bos"))
    if contract is None or contract.get("append_bos") is None:
        note = "the checkpoint records no BOS/EOS contract: prompt without BOS"
    elif bos:
        if tok.bos_id < 0 or (contract.get("bos_id") not in (None, tok.bos_id)):
            raise CommandError(
                f"the training data started documents with BOS id {contract.get('bos_id')}, "
                f"the tokenizer's BOS id is {tok.bos_id}: pass the run's tokenizer"
            )
        note = f"prompt starts with BOS (id {tok.bos_id}), as the training documents did"
    else:
        note = "prompt without BOS, as the training documents were"
    if bos:
        ids = [tok.bos_id, *ids]
    return ids, note


def sample_text(model, tok, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                contract: dict | None = None, on_ids=None) -> str:  # fmt: skip
    from mindloom_model import generate

    ids, note = prompt_ids(tok, prompt, contract)
    bos = len(ids) > 0 and contract is not None and bool(contract.get("append_bos"))
    if not ids:
        raise CommandError("the prompt encodes to no tokens")
    out = generate(
        model,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tok.eos_id if tok.eos_id >= 0 else None,
        seed=seed,
    )
    row = [int(i) for i in out[0]]
    if on_ids is not None:  # what the model was fed, as generate returns it
        on_ids(row[: len(ids)], note)
    if bos:
        row = row[1:]
    if tok.eos_id >= 0 and tok.eos_id in row[len(ids) - bos :]:
        row = row[: row.index(tok.eos_id, len(ids) - bos)]
    return tok.decode(row)


def cmd_generate(args) -> int:
    import mindspore as ms

    ms.set_context(device_target="CPU")
    model, ckpt = load_model(args.checkpoint)
    tok = _load_tokenizer(args.tokenizer, ckpt)

    def say(ids: list[int], note: str) -> None:
        shown = ", ".join(map(str, ids[:16])) + (", ..." if len(ids) > 16 else "")
        print(f"generate: step {ckpt.step}; {note}; prompt ids [{shown}]", file=sys.stderr)

    try:
        text = sample_text(model, tok, args.prompt, args.max_new_tokens, args.temperature,
                           args.top_k, args.top_p, args.seed,
                           contract=ckpt.common.get("data_contract"), on_ids=say)  # fmt: skip
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    print(text)
    return 0


def cmd_export_hf(args) -> int:
    from mindloom_model import save_hf

    out_dir = Path(args.out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        # another export (or anything else) there would be overwritten file by file
        raise CommandError(f"export-hf: {out_dir} exists and is not an empty directory; "
                           "give a new --out")  # fmt: skip
    model, ckpt = load_model(args.checkpoint)
    extra = {}
    tok_dir = ckpt.common.get("tokenizer")
    if tok_dir:
        try:
            tok = _load_tokenizer(None, ckpt)
            for key, val in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id)):
                if val >= 0:
                    extra[key] = val
        except CommandError:
            pass
    try:
        out = save_hf(model, args.out, dtype=args.dtype, **extra)
    except (OSError, ValueError) as exc:
        raise CommandError(f"export-hf: {exc}") from None
    kind = "DeepseekV3ForCausalLM" if model.config.family == "deepseek_v3" else "Llama"
    print(f"wrote {out} (Hugging Face {kind}, step {ckpt.step}, {args.dtype})")
    return 0


# ---------------------------------------------------------------------------------------
# check-env


def cmd_check_env(args) -> int:
    from mindloom_train._trainer import versions

    for key, val in versions().items():
        print(f"{key:20s} {val}")
    import mindspore as ms
    import numpy as np

    try:
        ms.set_context(device_target=args.device_target)
        a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
        t0 = time.perf_counter()
        got = ms.ops.matmul(ms.Tensor(a), ms.Tensor(a)).asnumpy()
        dt = time.perf_counter() - t0
    except Exception as exc:  # any backend failure is the answer to "does it work"
        raise CommandError(
            f"check-env: a 256x256 matmul on {args.device_target} failed: {exc}"
        ) from None
    err = float(np.abs(got - a @ a).max())
    if not err < 1e-3:
        raise CommandError(f"check-env: matmul result differs from numpy by {err}")
    print(f"{'backend':20s} {ms.get_context('device_target')}")
    print(f"{'device':20s} {_device_name(args.device_target)}")
    print(f"{'matmul 256x256':20s} ok (max |diff| vs numpy {err:.1e}, {dt * 1000:.1f} ms)")
    if args.nproc and args.nproc > 1:
        import tempfile

        from mindloom_parallel import LaunchError, launch

        log_dir = tempfile.mkdtemp(prefix="mindloom-check-env-")
        try:
            launch(["-m", "mindloom_train._envcheck", str(args.nproc)], nproc=args.nproc,
                   log_dir=log_dir, timeout_s=args.timeout, cluster_timeout_s=min(args.timeout, 120))  # fmt: skip
        except LaunchError as exc:
            raise CommandError(
                f"check-env: all-reduce across {args.nproc} workers failed: {exc}"
            ) from None
        lines = []
        for p in sorted(Path(log_dir).glob("worker_*.log")):
            lines += [
                ln
                for ln in p.read_text(errors="replace").splitlines()
                if ln.startswith("allreduce")
            ]
        if len(lines) != args.nproc or not all(ln.endswith("ok") for ln in lines):
            raise CommandError(f"check-env: all-reduce results missing or wrong, see {log_dir}")
        print(f"{'all-reduce':20s} ok across {args.nproc} msrun workers (logs in {log_dir})")
    print("check-env: ok")
    return 0


def _device_name(target: str) -> str:
    if target == "CPU":
        import platform

        name = platform.processor() or platform.machine()
        try:
            for line in open("/proc/cpuinfo", encoding="ascii", errors="replace"):
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return f"{name}, {os.cpu_count()} logical CPUs"
    return target


# ---------------------------------------------------------------------------------------
# launch


def cmd_launch(args) -> int:
    from mindloom_parallel import LaunchError

    from mindloom_train._config import load_config

    cfg = load_config(args.config, args.overrides)
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


# ---------------------------------------------------------------------------------------
# demo


def cmd_demo(args) -> int:
    from mindloom_train._demo import run_demo

    return run_demo(run_dir=Path(args.run_dir), quick=args.quick, minutes=args.minutes)


# ---------------------------------------------------------------------------------------
# estimate-memory


def cmd_estimate_memory(args) -> int:
    """The per-rank breakdown (table or JSON); exit 0 when it fits, 1 when it does not."""
    from mindloom_train._config import load_config
    from mindloom_train._memory import check_precision, estimate, format_table

    cfg = load_config(args.config, args.overrides)
    check_precision(cfg)
    est = estimate(cfg, nproc=args.nproc, device=args.device)
    if args.json:
        print(json.dumps(est.to_json(), indent=1))
    else:
        print(format_table(est))
    return 0 if est.fits else 1
