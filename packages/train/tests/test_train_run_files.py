"""Files a run writes are its own (issue 23 item 10): no writing through a symlink or into a
FIFO, interrupted saves of earlier runs cleaned at start. No msrun; one CLI process."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
from mindloom_train import _checkpoint as ck
from mindloom_train._metrics import MetricsWriter, RunFileError, RunLog
from train_testutil import base_config


def _victim(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text("keep me\n")
    target.chmod(0o600)
    return target


@pytest.mark.parametrize("opener", [MetricsWriter, RunLog], ids=["metrics.jsonl", "train.log"])
def test_symlinked_run_file_is_refused_and_its_target_untouched(tmp_path, opener):
    target = _victim(tmp_path)
    link = tmp_path / "run" / "file"
    link.parent.mkdir()
    link.symlink_to(target)
    with pytest.raises(RunFileError, match="is a symlink; refusing to write through it"):
        opener(link)
    assert target.read_text() == "keep me\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # not chmodded to 0o640


def test_fifo_as_metrics_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "metrics.jsonl")  # nobody reads it: a blocking open would hang here
    with pytest.raises(RunFileError, match="FIFO"):
        MetricsWriter(tmp_path / "metrics.jsonl")


def test_new_run_files_are_regular_0640_and_appended(tmp_path):
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.event("start", step=0)
    w.close()
    w = MetricsWriter(tmp_path / "metrics.jsonl")  # a resumed run appends
    w.event("end", step=1)
    w.close()
    path = tmp_path / "metrics.jsonl"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [ln.split('"event": ')[1][:7] for ln in path.read_text().splitlines()] == [
        '"start"',
        '"end", ',
    ]


def test_train_with_a_symlinked_metrics_log_is_one_line_exit_1(prepared, tmp_path, capfd):
    # the CLI's `main` in this process (what the `mindloom` script calls; no second
    # MindSpore import), with stderr captured at the file descriptor like a subprocess's
    import yaml
    from mindloom_train._cli import main

    target = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(target)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(base_config(prepared, run, training={"train_iters": 2})))
    capfd.readouterr()
    assert main(["train", str(cfg)]) == 1
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"error: {run / 'metrics.jsonl'}: is a symlink; refusing to write through it"]
    assert target.read_text() == "keep me\n" and stat.S_IMODE(target.stat().st_mode) == 0o600


def _complete(save: Path, step: int) -> None:
    shards = {ck.shard_name("model", 0, 1): {"w": np.full(4, step, np.float32)}}
    ck.save_checkpoint(save, step, shards, {"consumed_samples": step}, keep_last=10)


def test_clean_stale_saves_removes_interrupted_saves_but_not_latest(tmp_path):
    save = tmp_path / "checkpoints"
    _complete(save, 2)
    _complete(save, 4)
    (save / "latest").write_text("4\n")
    # what a kill -9 mid-save leaves: a temp dir, a swap leftover, a step without common.json
    for name in (".tmp-step_00000006", ".old-step_00000004-123", "step_00000008"):
        (save / name).mkdir()
        (save / name / ck.shard_name("model", 0, 1)).write_bytes(b"partial")
    outside = tmp_path / "outside"
    outside.mkdir()
    (save / "step_00000010").symlink_to(outside)  # never followed into, never removed
    logs: list[str] = []
    removed = ck.clean_stale_saves(save, logs.append)
    assert sorted(removed) == [".old-step_00000004-123", ".tmp-step_00000006", "step_00000008"]
    assert sorted(p.name for p in save.iterdir()) == [
        "latest", "step_00000002", "step_00000004", "step_00000010",
    ]  # fmt: skip
    assert outside.is_dir()
    assert len(logs) == 3 and all("an incomplete save of an earlier run" in m for m in logs)
    assert ck.find_resumable(save, lambda m: None).step == 4


def test_clean_stale_saves_keeps_the_step_latest_names_even_if_incomplete(tmp_path):
    save = tmp_path / "checkpoints"
    _complete(save, 2)
    (save / "step_00000004").mkdir()  # incomplete, but `latest` names it: left for the
    (save / "latest").write_text("4\n")  # loader's fallback to report, never deleted
    assert ck.clean_stale_saves(save, lambda m: None) == []
    (save / "latest").write_text("abc\n")  # unreadable tracker: step dirs are left alone
    (save / ".tmp-step_00000006").mkdir()
    assert ck.clean_stale_saves(save, lambda m: None) == [".tmp-step_00000006"]
    assert (save / "step_00000004").is_dir()
