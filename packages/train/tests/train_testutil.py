"""Helpers shared by the mindloom-train tests (imported via conftest's sys.path entry)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

SCHED = {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_iters": 2, "decay_iters": 8}


def run_config(cfg_dict: dict, fault: str | None = None) -> int:
    from mindloom_train._config import from_dict
    from mindloom_train._trainer import Trainer

    return Trainer(from_dict(cfg_dict), fault_spec=fault or "").run()


def run_cli(
    *args: str, timeout: int = 300, fault: str | None = None
) -> subprocess.CompletedProcess:
    """`mindloom ARGS` in a fresh process (quiet MindSpore; the fault hook only if given)."""
    env = {**os.environ, "GLOG_v": "3"}
    env.pop("MINDLOOM_FAULT", None)
    if fault:
        env["MINDLOOM_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "mindloom_train._cli", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)  # fmt: skip


def base_config(prepared: dict[str, str], run_dir: Path, **sections) -> dict:
    """A tiny, fast run: debug preset, 65-char vocabulary, seq 32, batch 4."""
    cfg = {
        "model": {"preset": "debug", "vocab_size": None},
        "tokenizer": {"path": prepared["tokenizer"]},
        "train_dataset": {"data_prefix": [prepared["train"]], "seq_length": 32},
        "eval_dataset": {"data_prefix": [prepared["eval"]], "seq_length": 32},
        "training": {"train_iters": 8, "global_batch_size": 4, "micro_batch_size": 4,
                     "eval_iters": 2, "eval_interval": 0},
        "lr_scheduler": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_iters": 2},
        "monitor": {"log_interval": 1, "progress_bar": False, "peak_tflops": 0.1},
        "checkpoint": {"save_interval": 0, "keep_last": 2},
        "seed": 7,
        "run_dir": str(run_dir),
    }  # fmt: skip
    out = copy.deepcopy(cfg)
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(out.get(section), dict):
            out[section].update(values)
        else:
            out[section] = values
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def step_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "event" not in r}


def events(run_dir: Path, name: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == name]


def launch_env(fault: str | None = None) -> dict:
    """The environment of a launched job: quiet MindSpore, the fault hook only if given."""
    env = {**os.environ, "GLOG_v": "3"}
    env.pop("MINDLOOM_FAULT", None)
    if fault:
        env["MINDLOOM_FAULT"] = fault
    return env


def start_launch(
    cfg: dict,
    path: Path,
    fault: str | None = None,
    *,
    nproc: int = 2,
    timeout_s: int = 400,
    extra: tuple[str, ...] = (),
    own_session: bool = False,
) -> subprocess.Popen:
    """Write `cfg` to `path` and start `mindloom launch --nproc N path` (real msrun) in the
    background; `own_session` puts the launcher in a process group of its own, as a shell
    job, so a test can signal the group."""
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.Popen(
        [sys.executable, "-m", "mindloom_train._cli", "launch", "--nproc", str(nproc), str(path),
         "--timeout", str(timeout_s), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(fault),
        start_new_session=own_session,
    )  # fmt: skip


def kill_msrun(log_dir: Path) -> None:
    """Stop the msrun job a test started (found by its own log directory)."""
    needle = f"--log_dir={Path(log_dir).resolve()}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                os.killpg(os.getpgid(int(entry.name)), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def wait_launches(procs: dict[str, subprocess.Popen], timeout_s: float) -> None:
    """Wait for every launch (bounded: `launch --timeout` kills first); each must exit 0."""
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=timeout_s)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"


def stop_launches(procs: dict[str, subprocess.Popen], log_dirs: dict[str, Path]) -> None:
    """Kill whatever still runs (only after a failed assertion or a timeout), with its msrun
    job, so that nothing is left behind for the next test."""
    for name, proc in procs.items():
        if proc.poll() is None:
            kill_msrun(log_dirs[name])
            proc.kill()
            proc.communicate()


def layout_config(prepared: dict[str, str], run_dir: Path, steps: int, save: int,
                  **sections) -> dict:  # fmt: skip
    """The tensor/pipeline-parallel launches' run (test_train_parallel_launch.py,
    test_train_parallel_four.py) and their one-process reference: the debug preset with
    tied embeddings and a vocabulary of 66 (the 65-char tokenizer + 1: divisible by tp = 2),
    `steps` steps saved every `save`; `sections` update the sections they name."""
    cfg = base_config(prepared, run_dir, lr_scheduler=SCHED,
                      model={"preset": "debug", "vocab_size": 66, "tie_embeddings": True},
                      checkpoint={"save_interval": save, "keep_last": 2})  # fmt: skip
    cfg["training"]["train_iters"] = steps
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


# A model whose size no launch or fault claim depends on: one layer, hidden 32, the
# 65-character vocabulary. Its graph compiles in a fraction of the debug preset's time.
TINY_MODEL = {"preset": "debug", "vocab_size": None, "num_layers": 1, "hidden_size": 32,
              "ffn_hidden_size": 64}  # fmt: skip


def one_layer_config(prepared: dict[str, str], run_dir: Path, **sections) -> dict:
    """The one-process runs that need a compiled step but no particular model or data
    (test_train_loop's guards, the exit-code rows of a failed step, a double interrupt and a
    full disk): one layer of the debug preset, no held-out set, and the guard settings the
    guard test needs (inert in the others: nothing spikes 1000-fold, nothing skips). The
    compile cache keys the whole config but its graph-free keys, so one config for all of
    them is one graph for all of them (`./dev test` shares the store)."""
    cfg = base_config(prepared, run_dir, model={"preset": "debug", "vocab_size": None,
                                                "num_layers": 1},
                      lr_scheduler=SCHED, eval_dataset=None,
                      training={"grad_spike_threshold": 1000.0, "max_consecutive_skips": 2})  # fmt: skip
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    """Poll `predicate` until it returns a true value (returned) or `timeout_s` passes
    (AssertionError naming `what`): a test acts on an observed event, never on a sleep."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not observed within {timeout_s:g} s")
        time.sleep(poll_s)


def worker_pid(log_dir: Path, rank: int) -> int | None:
    """The pid a `mindloom launch` worker printed at its start into log_dir/worker_<rank>.log."""
    for line in log_text(Path(log_dir) / f"worker_{rank}.log").splitlines():
        if line.startswith("mindloom worker pid "):  # mindloom_parallel.guard_worker's line
            return int(line.split()[-1])
    return None


def log_text(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def linear_loss_setup(vocab_size: int = 64):
    """The debug model's parameters under a loss that is linear in them, for checking the
    compiled step's update against an independent reference on chosen gradients:
    loss = sum_i <w_i, G_i>, so d loss / d w_i is exactly G_i, fed flattened as the step's
    `tokens` input (`flat(grads)`). Shared by test_train_adamw_reference.py and
    test_train_numerics.py. -> SimpleNamespace(model, params, names, shapes, sizes,
    offsets, loss_net, flat)."""
    from types import SimpleNamespace

    import mindspore as ms
    import numpy as np
    from mindloom_model import Llama, get_preset
    from mindspore import Tensor, nn, ops

    model = Llama(get_preset("debug", vocab_size=vocab_size))
    params = list(model.trainable_params())
    names = [p.name for p in params]
    shapes = [tuple(p.shape) for p in params]
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = tuple(int(x) for x in np.cumsum([0] + sizes[:-1]))

    class LinearLoss(nn.Cell):
        """loss = sum_i <w_i, G_i>: d loss / d w_i is exactly G_i (fed as `tokens`)."""

        def __init__(self):
            super().__init__(auto_prefix=False)
            self.ws = ms.ParameterTuple(params)

        def construct(self, tokens, labels, position_ids, segment_ids, loss_mask):
            total = ops.zeros((), ms.float32)
            for i in range(len(sizes)):
                g = tokens[offsets[i] : offsets[i] + sizes[i]].reshape(shapes[i])
                total = total + (self.ws[i] * g).sum()
            return total

    def flat(grads) -> Tensor:
        return Tensor(np.concatenate([g.reshape(-1) for g in grads]))

    return SimpleNamespace(model=model, params=params, names=names, shapes=shapes, sizes=sizes,
                           offsets=offsets, loss_net=LinearLoss(), flat=flat)  # fmt: skip
