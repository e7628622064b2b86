"""Async checkpoint saving (reliability test 6): what it writes equals a synchronous save at
the same step although training moved on meanwhile; a kill during the background write
behaves as one during a synchronous save; a failed background write fails the run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from mindloom_train._checkpoint import Checkpoint, read_tracker, shard_name
from mindloom_train._faults import PAUSE_MARKER
from test_train_faults import _start, _wait_for
from train_testutil import SCHED, TINY_MODEL, base_config, events, run_config, step_records

FILES = (shard_name("model", 0, 1), shard_name("optim", 0, 1))


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def test_async_save_equals_sync_save(prepared, tmp_path):
    cfgs = {}
    # no held-out set: nothing here evaluates, and its graph would be a second compile
    for name, extra in (("sync", {}), ("async", {"async_save": True})):
        cfgs[name] = base_config(prepared, tmp_path / name, model=TINY_MODEL, lr_scheduler=SCHED,
                                 training={"train_iters": 4}, eval_dataset=None,
                                 checkpoint={"save_interval": 2, "keep_last": 3, **extra})  # fmt: skip
    assert run_config(cfgs["sync"]) == 0
    # the writer of step 2 starts only once update 4 has begun: the loop runs on meanwhile
    assert run_config(cfgs["async"], fault="hold_save@2:4") == 0
    a, b = tmp_path / "sync", tmp_path / "async"
    for step in (2, 4):
        for f in FILES:
            assert (_ckpt(a, step) / f).read_bytes() == (_ckpt(b, step) / f).read_bytes(), (step, f)
        ca, cb = Checkpoint(_ckpt(a, step)).common, Checkpoint(_ckpt(b, step)).common
        for key in ("step", "consumed_samples", "adam_step", "rng", "lr", "loss_smoothed"):
            assert ca[key] == cb[key], key
    saved = {e["step"]: e for e in events(b, "checkpoint")}
    assert saved[2]["background"] is True
    assert saved[2]["completed_at_step"] >= 4  # training had moved on when the write finished
    assert "background" not in saved[4]  # the end-of-run save is synchronous
    assert read_tracker(b / "checkpoints") == 4
    la = {s: r["loss"] for s, r in step_records(a).items()}
    lb = {s: r["loss"] for s, r in step_records(b).items()}
    assert la == lb and sorted(la) == [1, 2, 3, 4]
    assert "writing step 2 in the background" in (b / "train.log").read_text()


def test_kill_9_during_async_write_resumes_from_last_complete(prepared, tmp_path):
    run = tmp_path / "k"
    # the save of step 2 is a background one (the end-of-run save at 3 is synchronous)
    cfg = base_config(prepared, run, model=TINY_MODEL, lr_scheduler=SCHED,
                      context={"mode": "pynative"}, training={"train_iters": 3},
                      checkpoint={"save_interval": 1, "async_save": True})  # fmt: skip
    proc = _start(cfg, tmp_path / "k.yaml", "pause_save@2:1")
    _wait_for(proc, PAUSE_MARKER)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    save = run / "checkpoints"
    assert read_tracker(save) == 1
    assert not _ckpt(run, 2).exists()
    assert "writing step 2 in the background" in (run / "train.log").read_text()
    proc = _start(cfg, tmp_path / "k.yaml", None)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "resumed from" in err and "step_00000001" in err
    assert read_tracker(save) == 3
    assert Checkpoint(_ckpt(run, 3)).common["consumed_samples"] == 12


def test_failed_async_write_fails_the_run_and_keeps_the_previous(prepared, tmp_path):
    run = tmp_path / "f"
    cfg = base_config(prepared, run, model=TINY_MODEL, lr_scheduler=SCHED,
                      context={"mode": "pynative"}, training={"train_iters": 3},
                      checkpoint={"save_interval": 1, "async_save": True})  # fmt: skip
    assert run_config(cfg, fault="fail_save@2:1") != 0
    save = run / "checkpoints"
    assert read_tracker(save) == 1
    assert not _ckpt(run, 2).exists() and not (save / ".tmp-step_00000002").exists()
    end = events(run, "end")[-1]
    assert end["status"] == "failed" and "step 2 failed" in end["reason"]
    assert "latest complete checkpoint is step 1" in end["reason"]
    Checkpoint(_ckpt(run, 1)).load_tensors()  # still whole
