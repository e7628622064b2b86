"""Hangs and dead ranks end a multi-worker run in bounded time (reliability test 15).

Real msrun, 2 CPU workers, plain data parallel (the compiled step with its all-reduce in
the graph). (a) Rank 1 blocks at the start of step 4 in a C call that holds the GIL (so
its own watchdog cannot help, while the cluster still sees it alive), and rank 0 blocks in the step's all-reduce: rank 0's watchdog ends it with exit
code 4 after parallelism.comm_timeout_s, naming its rank and the step; msrun then tears
down the job and the launch fails.
(b) Rank 1 is SIGKILLed at step 3: msrun tears rank 0 down, the launch fails with a line
naming rank 1 and SIGKILL, and a relaunch resumes from the last complete checkpoint (step 2) and finishes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mindloom_train._checkpoint import read_tracker
from test_train_parallel_launch import _kill_msrun, _launch
from train_testutil import SCHED, base_config, events, step_records

TIMEOUT_S = 8
# MindSpore notices a silent worker by its missed heartbeats (MS_NODE_TIMEOUT, 30 s by
# default): the survivors' collectives fail and msrun ends the job. Shorter here to keep
# the suite short; in the hang test still longer than TIMEOUT_S, so that the watchdog is
# what fires there.
NODE_TIMEOUT = "5"
HANG_NODE_TIMEOUT = "16"


def _config(prepared, run: Path) -> dict:
    cfg = base_config(prepared, run, lr_scheduler=SCHED,
                      training={"train_iters": 6, "micro_batch_size": 2},
                      parallelism={"dp": 2, "comm_timeout_s": TIMEOUT_S},
                      checkpoint={"save_interval": 2})  # fmt: skip
    return cfg


def _finish(proc, log_dir: Path, timeout: float = 300) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_msrun(log_dir)
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, err, time.monotonic() - t0


def _worker_logs(log_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("worker_*.log")))


@pytest.mark.msrun
def test_rank_hung_in_collective_ends_the_job(prepared, tmp_path, monkeypatch):
    monkeypatch.setenv("MS_NODE_TIMEOUT", HANG_NODE_TIMEOUT)
    run = tmp_path / "hang"
    proc = _launch(_config(prepared, run), tmp_path / "hang.yaml", fault="hang@4:1")
    code, err, took = _finish(proc, run / "msrun_logs")
    print(f"hung-rank launch ended after {took:.0f} s")
    assert code == 1, err[-2000:]  # the launcher: a worker failed (exit-code table)
    assert "launch:" in err  # the launcher's one-line failure
    logs = _worker_logs(run / "msrun_logs")
    assert "rank 0: step 4 made no progress" in logs, logs[-3000:]
    assert f"budget {TIMEOUT_S:g} s" in logs
    end = events(run, "end")[-1]
    assert end["exit_code"] == 4 and end["status"] == "failed" and "step 4" in end["reason"]
    assert max(step_records(run)) == 3  # nothing after the hang was recorded as done
    assert read_tracker(run / "checkpoints") == 2


@pytest.mark.msrun
def test_killed_rank_ends_the_job_and_relaunch_resumes(prepared, tmp_path, monkeypatch):
    monkeypatch.setenv("MS_NODE_TIMEOUT", NODE_TIMEOUT)
    run = tmp_path / "kill"
    cfg = _config(prepared, run)
    proc = _launch(cfg, tmp_path / "kill.yaml", fault="sigkill@3:1")
    code, err, took = _finish(proc, run / "msrun_logs")
    print(f"killed-rank launch ended after {took:.0f} s")
    assert code == 1, err[-2000:]  # the launcher: a worker failed (exit-code table)
    # the launcher names the killed rank and the signal (it used to say "rendezvous timed out")
    line = [ln for ln in err.splitlines() if ln.startswith("error: launch:")]
    assert len(line) == 1 and "worker rank 1 was killed by SIGKILL" in line[0], err[-2000:]
    assert "rendezvous" not in line[0]
    assert read_tracker(run / "checkpoints") == 2
    assert not events(run, "end")  # msrun tore rank 0 down inside the collective
    proc = _launch(cfg, tmp_path / "kill.yaml")
    code, err, _ = _finish(proc, run / "msrun_logs")
    assert code == 0, err[-3000:]
    assert "resumed from" in _worker_logs(run / "msrun_logs") + (run / "train.log").read_text()
    assert read_tracker(run / "checkpoints") == 6
    assert sorted(step_records(run))[-4:] == [3, 4, 5, 6]
