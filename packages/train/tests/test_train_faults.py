"""Real signals in real processes: kill -9 during a save, SIGTERM mid-run."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from mindloom_train._checkpoint import Checkpoint, find_resumable, load_safetensors, read_tracker
from mindloom_train._faults import PAUSE_MARKER
from train_testutil import SCHED, TINY_MODEL, base_config, events, step_records


def _start(cfg: dict, path: Path, fault: str | None) -> subprocess.Popen:
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "GLOG_v": "3"}
    env.pop("MINDLOOM_FAULT", None)
    if fault:
        env["MINDLOOM_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "mindloom_train._cli", "train", str(path)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True)  # fmt: skip


def _wait_for(proc: subprocess.Popen, needle: str, timeout: float = 240) -> str:
    """The first stderr line holding `needle`. Reads the pipe's file descriptor itself:
    `select` on the text stream and then `readline()` lost lines (CI68: the readline took
    the eval line and the pause marker in one chunk, the marker stayed in Python's buffer,
    `select` saw an empty pipe and the paused process wrote nothing more for 240 s)."""
    seen, pending = [], ""
    fd = proc.stderr.fileno()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # end of the pipe: the process is exiting
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
                continue
            *lines, pending = (pending + chunk.decode(errors="replace")).split("\n")
            for line in lines:
                seen.append(line + "\n")
                if needle in line:
                    return line
        elif proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"{needle!r} never appeared; last lines: {''.join(seen[-10:])}{pending}")


def test_kill_9_during_saves_resumes_from_last_complete(prepared, tmp_path):
    run = tmp_path / "k"
    # PyNative: what is checked here (the files on disk, the resume policy) is host-side,
    # and an eager step costs no graph compile in each of the three processes
    cfg = base_config(prepared, run, model=TINY_MODEL, lr_scheduler=SCHED,
                      context={"mode": "pynative"}, training={"train_iters": 3},
                      checkpoint={"save_interval": 1})  # fmt: skip
    # every file written but the directory not renamed: the most complete-looking moment;
    # each other point of a save is killed in test_kill_9_at_every_point_of_a_save
    proc = _start(cfg, tmp_path / "k.yaml", "pause_save@2:4")
    _wait_for(proc, PAUSE_MARKER)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    save = run / "checkpoints"
    assert read_tracker(save) == 1
    assert (save / ".tmp-step_00000002").is_dir() and not (save / "step_00000002").exists()
    # second kill: step 3 fully renamed, but `latest` not yet updated
    proc = _start(cfg, tmp_path / "k.yaml", "pause_save@3:tracker")
    line = _wait_for(proc, PAUSE_MARKER)
    assert "step=3" in line
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert read_tracker(save) == 2
    assert (save / "step_00000003" / "common.json").is_file()  # whole, never committed
    log = (run / "train.log").read_text()
    assert "incomplete save" in log and "resumed from" in log and "step_00000001" in log
    # third run: resumes from 2 (the tracker, not the newer step-3 directory), never from
    # scratch, and finishes
    proc = _start(cfg, tmp_path / "k.yaml", None)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "resumed from" in err and "step_00000002" in err
    assert read_tracker(save) == 3
    assert Checkpoint(save / "step_00000003").common["consumed_samples"] == 12
    recs = step_records(run)
    assert sorted(recs) == [1, 2, 3]


def test_sigterm_saves_and_exits_cleanly(prepared, tmp_path):
    run = tmp_path / "s"
    # PyNative (no graph compile): one process stops on its own signal handler's flag; the
    # compiled step's agreed stop is test_train_launch_signals' SIGTERM to a dp=2 launch
    cfg = base_config(prepared, run, model=TINY_MODEL, lr_scheduler=SCHED,
                      context={"mode": "pynative"}, training={"train_iters": 5000})  # fmt: skip
    cfg["lr_scheduler"] = {**SCHED, "decay_iters": 5000}
    cfg["monitor"]["progress_bar"] = True
    proc = _start(cfg, tmp_path / "s.yaml", None)
    _wait_for(proc, "] 3/5000")
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    end = events(run, "end")[-1]
    assert end["status"] == "stopped" and "SIGTERM" in end["reason"]
    step = read_tracker(run / "checkpoints")
    assert step == end["step"] >= 3
    assert (
        Checkpoint(run / "checkpoints" / f"step_{step:08d}").common["consumed_samples"] == 4 * step
    )


# A process that saves step 2 completely, then step 4 with the save paused at one point
# (`on_progress` is the hook the trainer's fault injection uses): no MindSpore, so every
# point is killed for real in well under a second each.
_SAVER = """
import sys, time, numpy as np
from mindloom_train._checkpoint import save_checkpoint
path, point = sys.argv[1], sys.argv[2]
def shards(step):
    return {f"model-{r}.safetensors": {"w": np.full((3, 4), step + r, np.float32)}
            for r in range(2)}
save_checkpoint(path, 2, shards(2), {"consumed_samples": 8}, verify_integrity=True)
def pause(step, written):
    if str(written) == point:
        print("paused", flush=True)
        time.sleep(3600)
save_checkpoint(path, 4, shards(4), {"consumed_samples": 16}, verify_integrity=True,
                on_progress=pause)
print("finished", flush=True)
"""
# before any file, after each of 2 shards, metadata.json, manifest.json, common.json, and
# after the rename with `latest` not yet updated
SAVE_POINTS = ["0", "1", "2", "3", "4", "5", "tracker"]


def test_kill_9_at_every_point_of_a_save(tmp_path):
    for point in SAVE_POINTS:
        save = tmp_path / point
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(save), point],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout.readline() == "paused\n", point  # blocks until the pause point
        proc.kill()
        proc.wait(timeout=30)
        assert read_tracker(save) == 2, point
        notes: list[str] = []
        ckpt = find_resumable(save, notes.append)
        assert ckpt.step == 2 and ckpt.common["consumed_samples"] == 8, point
        for r in range(2):
            got = load_safetensors(ckpt.path / f"model-{r}.safetensors")["w"]
            assert got.tolist() == [[2.0 + r] * 4] * 3, point
        if point == "tracker":  # step 4 is whole but was never committed
            assert (save / "step_00000004" / "common.json").is_file()
        else:
            assert not (save / "step_00000004").exists(), point
            assert any(".tmp-step_00000004 is an incomplete save" in n for n in notes), notes
