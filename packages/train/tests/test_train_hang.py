"""Hangs and dead ranks end a multi-worker run in bounded time (reliability test 15).

Real msrun, 2 CPU workers, plain data parallel (the compiled step with its all-reduce in
the graph), a one-layer model, 4 steps, a checkpoint every 2. Both jobs run at once (their
start-up and their timeouts overlap); each test asserts on one of them.
(a) Rank 1 blocks at the start of step 3 in a C call that holds the GIL (so its own
watchdog cannot help, while the cluster still sees it alive), and rank 0 blocks in the
step's all-reduce: rank 0's watchdog ends it with exit code 4 after
parallelism.comm_timeout_s, naming its rank and the step; msrun then tears down the job and
the launch fails.
(b) Both ranks wait at the start of step 3, outside any collective; once rank 0 is there
(its step-2 checkpoint is committed: the tracker says 2) the test SIGKILLs rank 1: msrun
kills rank 0, the launch fails with a line naming rank 1 and SIGKILL, and a relaunch
resumes from the last complete checkpoint (step 2) and finishes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from mindloom_train._checkpoint import read_tracker
from mindloom_train._faults import AWAIT_MARKER
from train_testutil import (
    SCHED,
    TINY_MODEL,
    base_config,
    events,
    kill_msrun,
    log_text,
    start_launch,
    step_records,
    wait_until,
    worker_pid,
)

STEPS = 4
TIMEOUT_S = 8
# MindSpore notices a silent worker by its missed heartbeats (MS_NODE_TIMEOUT, 30 s by
# default): the survivors' collectives fail and msrun ends the job. Shorter here to keep
# the suite short; in the hang test still longer than TIMEOUT_S, so that the watchdog is
# what fires there.
NODE_TIMEOUT = "5"
HANG_NODE_TIMEOUT = "16"


def _config(prepared, run: Path, comm_timeout_s: float, store: Path) -> dict:
    # no held-out set: no check here evaluates, and the relaunch that finishes would
    # compile the evaluation graph in both workers for its final evaluation. All three
    # launches have one graph config (comm_timeout_s is graph-free) and one compile store
    # of this module's: the kill job compiles, the hang job and the relaunch load.
    return base_config(prepared, run, model=TINY_MODEL, lr_scheduler=SCHED, eval_dataset=None,
                       training={"train_iters": STEPS, "micro_batch_size": 2},
                       parallelism={"dp": 2, "comm_timeout_s": comm_timeout_s},
                       checkpoint={"save_interval": 2},
                       context={"compile_cache_dir": str(store)})  # fmt: skip


def _published(store: Path) -> list[str]:
    """The role of every entry in the store (hidden names are entries being written)."""
    entries = (p for p in store.glob("*/*") if not p.name.startswith("."))
    return sorted(json.loads((e / "manifest.json").read_text())["role"] for e in entries)


def _start(cfg: dict, path: Path, node_timeout: str, fault: str | None = None):
    with pytest.MonkeyPatch.context() as mp:  # msrun's workers inherit the environment
        mp.setenv("MS_NODE_TIMEOUT", node_timeout)
        return start_launch(cfg, path, fault)


def _tracker(save: Path) -> int | None:
    return read_tracker(save) if (save / "latest").exists() else None


def _worker_logs(log_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("worker_*.log")))


@pytest.fixture(scope="module")
def jobs(prepared, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hang")
    hang, kill, store = root / "hang", root / "kill", root / "compile_cache"
    # ranks wait for the test at step 3: a watchdog budget far above the poll's latency
    kill_cfg = _config(prepared, kill, 120, store)
    procs = {"kill": _start(kill_cfg, root / "kill.yaml", NODE_TIMEOUT, "await_stop@3")}
    logs = {
        name: run / "msrun_logs"
        for name, run in (("hang", hang), ("kill", kill), ("relaunch", kill))
    }
    out: dict = {"hang": hang, "kill": kill}
    try:
        t0 = time.monotonic()

        def compiled() -> bool:
            assert procs["kill"].poll() is None, procs["kill"].communicate()[1][-3000:]
            roles = _published(store) if store.is_dir() else []
            return roles.count("comm_probe") == 2 and roles.count("train_step") == 2

        # the hang job once the kill job's ranks have published their graphs: its ranks
        # load them instead of compiling the same graphs at the same moment
        wait_until(compiled, 600, "the kill job's comm_probe and train_step published")
        procs["hang"] = _start(_config(prepared, hang, TIMEOUT_S, store), root / "hang.yaml",
                               HANG_NODE_TIMEOUT, "hang@3:1")  # fmt: skip

        def ready() -> int | None:
            assert procs["kill"].poll() is None, procs["kill"].communicate()[1][-3000:]
            if _tracker(kill / "checkpoints") != 2:
                return None
            for rank in (0, 1):
                if AWAIT_MARKER not in log_text(logs["kill"] / f"worker_{rank}.log"):
                    return None
            return worker_pid(logs["kill"], 1)

        pid = wait_until(ready, 600, "step 2 committed and both ranks waiting at step 3")
        out["tracker_at_kill"] = _tracker(kill / "checkpoints")
        os.kill(pid, signal.SIGKILL)
        _, out["kill_err"] = procs["kill"].communicate(timeout=300)
        out["kill_code"] = procs["kill"].returncode
        out["kill_took"] = time.monotonic() - t0
        out["kill_tracker"] = _tracker(kill / "checkpoints")
        out["kill_ends"] = events(kill, "end")
        procs["relaunch"] = _start(kill_cfg, root / "kill.yaml", NODE_TIMEOUT)
        t0 = time.monotonic()
        _, out["hang_err"] = procs["hang"].communicate(timeout=300)
        out["hang_code"] = procs["hang"].returncode
        out["hang_logs"] = _worker_logs(logs["hang"])
        print(f"hung-rank launch ended {time.monotonic() - t0:.0f} s after the kill job")
        _, out["relaunch_err"] = procs["relaunch"].communicate(timeout=300)
        out["relaunch_code"] = procs["relaunch"].returncode
        out["relaunch_logs"] = _worker_logs(logs["relaunch"])
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:  # only after a failed assertion or a timeout
                kill_msrun(logs[name])
                proc.kill()
                proc.communicate()
    return out


@pytest.mark.msrun
def test_rank_hung_in_collective_ends_the_job(jobs):
    run, err = jobs["hang"], jobs["hang_err"]
    assert jobs["hang_code"] == 1, err[-2000:]  # the launcher: a worker failed (exit-code table)
    assert "launch:" in err  # the launcher's one-line failure
    logs = jobs["hang_logs"]
    assert "rank 0: step 3 made no progress" in logs, logs[-3000:]
    assert f"budget {TIMEOUT_S:g} s" in logs
    end = events(run, "end")[-1]
    assert end["exit_code"] == 4 and end["status"] == "failed" and "step 3" in end["reason"]
    assert max(step_records(run)) == 2  # nothing after the hang was recorded as done
    assert read_tracker(run / "checkpoints") == 2


@pytest.mark.msrun
def test_killed_rank_ends_the_job_and_relaunch_resumes(jobs):
    run, err = jobs["kill"], jobs["kill_err"]
    print(f"killed-rank launch ended after {jobs['kill_took']:.0f} s")
    assert jobs["tracker_at_kill"] == 2
    assert jobs["kill_code"] == 1, err[-2000:]  # the launcher: a worker failed (exit-code table)
    # the launcher names the killed rank and the signal (it used to say "rendezvous timed out")
    line = [ln for ln in err.splitlines() if ln.startswith("error: launch:")]
    assert len(line) == 1 and "worker rank 1 was killed by SIGKILL" in line[0], err[-2000:]
    assert "rendezvous" not in line[0]
    assert jobs["kill_tracker"] == 2
    assert not jobs["kill_ends"]  # msrun killed rank 0 as soon as rank 1 was gone
    assert jobs["relaunch_code"] == 0, jobs["relaunch_err"][-3000:]
    assert "resumed from" in jobs["relaunch_logs"] + (run / "train.log").read_text()
    assert read_tracker(run / "checkpoints") == STEPS
    assert sorted(step_records(run))[-2:] == [3, 4]
    assert events(run, "start")[-1]["step"] == 2
