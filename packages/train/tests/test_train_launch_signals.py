"""Signals to `mindloom launch` (issue 23 item 2; reliability tests 14 and 15).

Real msrun, 2 CPU workers, plain data parallel, a one-layer model, 4 steps; three launches
(B's and C's start-up overlaps A's steps), each waiting at a known step through the
test-only `await_stop` fault so no check depends on timing luck:

- A: uninterrupted, the reference.
- B: at step 2 the test sends SIGTERM to the launcher's process group (as a shell or a
  scheduler does). Every rank stops at step 2, step 2 is a complete checkpoint, the
  launcher exits 0 within the stop budget, and no msrun, scheduler, worker or log tail is
  left. A second launch into B's run directory while B lives is refused (the run lock). The
  relaunch resumes and its steps 3-4 equal A's bit for bit. Before B starts, an interrupted
  save of an "earlier run" is planted: B removes it at start.
- C: at step 1 (before its graph compiles: nothing of C's check needs a step) the
  launcher is SIGKILLed: msrun, its scheduler and the workers all end (parent-death
  signals), and the run lock is free again.

Before the fix, B's SIGTERM killed only the launcher (msrun and the workers ran on, in
sessions of their own) and C's workers trained on to the end.

The same launches carry the compile cache under msrun (`context.compile_cache`), all into
one fresh store of this module: A starts alone and compiles every graph (cold); B and C
start once A has published the graphs they build first, B's relaunch once A has ended.
B and its relaunch load every graph on every rank (warm) and their steps equal A's bit for
bit; C, with `rms_norm_eps` changed, compiles its graph afresh on each rank.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from mindloom_train._checkpoint import read_tracker, step_dirname
from mindloom_train._faults import AWAIT_MARKER
from train_testutil import (
    SCHED,
    TINY_MODEL,
    base_config,
    events,
    start_launch,
    step_records,
    wait_until,
)

STEPS = 4
STOP_STEP = 2
STOP_BUDGET_S = 180  # SIGTERM -> every process of the job gone (the documented grace is 300 s)


def _config(prepared, run: Path, store: Path, **model) -> dict:
    return base_config(prepared, run, model={**TINY_MODEL, **model}, lr_scheduler=SCHED,
                       training={"train_iters": STEPS, "micro_batch_size": 2},
                       parallelism={"dp": 2}, checkpoint={"save_interval": 0},
                       context={"compile_cache_dir": str(store)})  # fmt: skip


# the graphs a launch of _config builds, each on every rank
ROLES = ("comm_probe", "train_step", "eval_step")
CACHE_LINE = re.compile(r"compile cache: (\d+) hits, (\d+) misses")


def _cache_counts(run: Path) -> dict[int, tuple[int, int]]:
    """rank -> (hits, misses) of the last launch into `run`, from each worker's log."""
    out = {}
    for rank in (0, 1):
        text = (run / "msrun_logs" / f"worker_{rank}.log").read_text(errors="replace")
        hits, misses = CACHE_LINE.findall(text)[-1]
        out[rank] = (int(hits), int(misses))
    return out


def _store_roles(store: Path) -> list[str]:
    """The role of every published entry (hidden names are entries being written)."""
    entries = (p for p in store.glob("*/*") if not p.name.startswith("."))
    return sorted(json.loads((e / "manifest.json").read_text())["role"] for e in entries)


def _start(cfg: dict, path: Path, fault: str | None = None) -> subprocess.Popen:
    return start_launch(cfg, path, fault, timeout_s=900, extra=("--stop-grace", "120"),
                        own_session=True)  # fmt: skip


def _job_pids(config: Path) -> list[int]:
    """Every live process of the job started with `config`: msrun and any log-tailing
    helper (their command lines hold the log dir under the run dir), its scheduler and
    workers (the config path)."""
    needles = [str(config.resolve()).encode()]
    run_dir = yaml.safe_load(config.read_text())["run_dir"]
    needles.append(str(Path(run_dir).resolve() / "msrun_logs").encode())
    me = os.getpid()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and any(n in cmd for n in needles):
            out.append(int(entry.name))
    return out


def _gone_within(config: Path, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _job_pids(config)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _awaiting(run: Path) -> bool:
    logs = sorted((run / "msrun_logs").glob("worker_*.log"))
    return len(logs) == 2 and all(AWAIT_MARKER in p.read_text(errors="replace") for p in logs)


def _kill_job(config: Path) -> None:
    if not config.exists():  # never started
        return
    for pid in _job_pids(config):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launch_in_this_process(config: Path) -> SimpleNamespace:
    """`mindloom launch --nproc 2 CONFIG` through the CLI's `main` in this process (what the
    `mindloom` script calls): a refused launch needs no second MindSpore import; an
    uncaught exception would fail the fixture here -> (exit code, stderr)."""
    from mindloom_train._cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["launch", "--nproc", "2", str(config), "--timeout", "240"])
    return SimpleNamespace(returncode=code, stderr=err.getvalue())


@pytest.fixture(scope="module")
def jobs(prepared, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("launch_signals")
    store = root / "compile_cache"
    runs = {name: root / name for name in "abc"}
    configs = {name: root / f"{name}.yaml" for name in "abc"}
    # an interrupted save of an earlier run in B's checkpoint directory
    ckdir = runs["b"] / "checkpoints"
    for stale in (f".tmp-{step_dirname(9)}", step_dirname(7)):
        (ckdir / stale).mkdir(parents=True)
        (ckdir / stale / "model-partial.safetensors").write_bytes(b"x" * 10)
    procs = {"a": _start(_config(prepared, runs["a"], store), configs["a"])}
    out: dict = {"runs": runs, "configs": configs, "store": store}
    try:

        def a_published_first_graphs() -> bool:
            roles = _store_roles(store) if store.is_dir() else []
            done = roles.count("comm_probe") == 2 and roles.count("train_step") == 2
            return done or procs["a"].poll() is not None  # A's end: the cache test says why

        # B's graphs (and C's, but for its changed constant) are in the store from here
        wait_until(a_published_first_graphs, 900, "A's comm_probe and train_step published")
        out["roles_before_bc"] = _store_roles(store)
        procs["b"] = _start(_config(prepared, runs["b"], store), configs["b"],
                            f"await_stop@{STOP_STEP}")  # fmt: skip
        procs["c"] = _start(_config(prepared, runs["c"], store, rms_norm_eps=1e-2),
                            configs["c"], "await_stop@1")  # fmt: skip
        deadline = time.monotonic() + 900  # the first step compiles: slow on a loaded machine
        pending = {"b", "c"}
        while pending and time.monotonic() < deadline:
            for name in [n for n in ("c", "b") if n in pending]:  # the quick one first
                assert procs[name].poll() is None, procs[name].communicate()[1][-3000:]
                if not _awaiting(runs[name]):
                    continue
                pending.discard(name)
                if name == "c":  # SIGKILL: the launcher cannot do anything about it
                    procs["c"].kill()
                    procs["c"].wait()
                    out["c_left"] = _gone_within(configs["c"], STOP_BUDGET_S)
                else:
                    out["second"] = _launch_in_this_process(configs["b"])
                    t0 = time.monotonic()
                    os.killpg(procs["b"].pid, signal.SIGTERM)
                    _, out["b_err"] = procs["b"].communicate(timeout=STOP_BUDGET_S)
                    out["b_code"] = procs["b"].returncode
                    out["b_left"] = _gone_within(configs["b"], 30)
                    out["b_took"] = time.monotonic() - t0
            time.sleep(0.5)
        assert not pending, f"never reached the await_stop step: {pending}"
        print(f"SIGTERM to B's launcher -> all of B gone in {out['b_took']:.1f} s")
        out["b_logs"] = "\n".join(
            p.read_text(errors="replace") for p in sorted((runs["b"] / "msrun_logs").glob("*.log"))
        )
        out["b_stopped_metrics"] = (runs["b"] / "metrics.jsonl").read_text()
        out["b_marks"] = [p.read_text() for p in (runs["b"] / "msrun_logs" / "ended").glob("*")]
        out["b_tracker"] = read_tracker(runs["b"] / "checkpoints")
        out["b_cache"] = _cache_counts(runs["b"])
        _, err = procs["a"].communicate(timeout=900)
        assert procs["a"].returncode == 0, err[-3000:]
        out["a_cache"] = _cache_counts(runs["a"])
        # B's relaunch: resumes from step 2 and finishes; after A, so that every graph it
        # builds (the evaluation's too) is in the store
        procs["b2"] = _start(_config(prepared, runs["b"], store), configs["b"])
        _, err = procs["b2"].communicate(timeout=900)
        assert procs["b2"].returncode == 0, err[-3000:]
        out["b2_cache"] = _cache_counts(runs["b"])
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # only after a failed assertion or a timeout
                proc.kill()
                proc.communicate()
        for config in configs.values():
            _kill_job(config)
    return out


@pytest.mark.msrun
def test_sigterm_to_launcher_stops_all_ranks_at_one_step_with_a_checkpoint(jobs):
    run = jobs["runs"]["b"]
    assert jobs["b_code"] == 0, jobs["b_err"][-3000:]  # the documented code of a clean stop
    assert "launch: SIGTERM received: every worker saved a checkpoint and stopped" in jobs["b_err"]
    # both ranks name the signal and the same step
    logs = jobs["b_logs"]
    assert f"run: SIGTERM received; saving step {STOP_STEP} and exiting" in logs
    assert f"[rank 1] run: SIGTERM received; saving step {STOP_STEP} and exiting" in logs
    assert jobs["b_tracker"] == STOP_STEP
    step_dir = run / "checkpoints" / step_dirname(STOP_STEP)
    assert (step_dir / "common.json").is_file()
    stopped = [r for r in map(yaml.safe_load, jobs["b_stopped_metrics"].splitlines())
               if r.get("event") == "end"]  # fmt: skip
    assert stopped[0]["status"] == "stopped" and stopped[0]["exit_code"] == 0
    assert stopped[0]["reason"] == "SIGTERM received" and stopped[0]["step"] == STOP_STEP
    # each worker said its run ended with 0 (what lets the launcher forgive a crash in
    # MindSpore's teardown after it: test_parallel_launch.py)
    assert jobs["b_marks"] == ["0\n", "0\n"], jobs["b_marks"]


@pytest.mark.msrun
def test_sigterm_to_launcher_leaves_no_process_behind(jobs):
    assert jobs["b_left"] == []


@pytest.mark.msrun
def test_second_launch_into_a_live_run_dir_is_refused(jobs):
    second = jobs["second"]
    assert second.returncode == 1
    err = second.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: launch: "), second.stderr
    assert "is in use by a live job" in err[0] and '"pid": ' in err[0], err[0]
    # the refused launch touched nothing: B's own run went on and stopped cleanly
    assert jobs["b_code"] == 0


@pytest.mark.msrun
def test_interrupted_saves_of_an_earlier_run_are_removed_at_start(jobs):
    ckdir = jobs["runs"]["b"] / "checkpoints"
    assert not (ckdir / f".tmp-{step_dirname(9)}").exists()
    assert not (ckdir / step_dirname(7)).exists()
    log = (jobs["runs"]["b"] / "train.log").read_text()
    assert f"removed .tmp-{step_dirname(9)}, an incomplete save of an earlier run" in log
    assert f"removed {step_dirname(7)}, an incomplete save of an earlier run" in log


@pytest.mark.msrun
def test_resume_after_the_sigterm_stop_is_bit_exact(jobs):
    a, b = step_records(jobs["runs"]["a"]), step_records(jobs["runs"]["b"])
    assert sorted(b) == list(range(1, STEPS + 1))
    # steps 1-2 are B's, 3-4 its relaunch's: graphs loaded from the store A compiled into
    # (see the compile-cache test below), A's compiled from source
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "lr"):
            assert b[step][key] == a[step][key], (step, key, b[step][key], a[step][key])
    starts = events(jobs["runs"]["b"], "start")
    assert starts[-1]["resumed_from"] is not None and starts[-1]["step"] == STOP_STEP
    # the final checkpoints: every weight and both AdamW moments, bit for bit
    from mindloom_train._checkpoint import open_checkpoint

    assert read_tracker(jobs["runs"]["a"] / "checkpoints") == STEPS
    assert read_tracker(jobs["runs"]["b"] / "checkpoints") == STEPS
    wa = open_checkpoint(jobs["runs"]["a"] / "checkpoints").load_tensors()
    wb = open_checkpoint(jobs["runs"]["b"] / "checkpoints").load_tensors()
    assert set(wa) == set(wb) and {n.split(".")[0] for n in wa} >= {"exp_avg", "exp_avg_sq"}
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


@pytest.mark.msrun
def test_sigkill_to_launcher_leaves_no_worker_running(jobs):
    from mindloom_parallel import RunLock

    assert jobs["c_left"] == []
    lock = RunLock(jobs["runs"]["c"] / ".launch.lock").acquire()  # free: nobody holds it
    lock.release()


@pytest.mark.msrun
def test_compile_cache_under_msrun_cold_warm_and_a_changed_constant(jobs):
    """A (alone in a fresh store) compiles every graph on each rank; B and its relaunch load
    every graph they build, on each rank (their steps equal A's bit for bit: the resume
    test above); C's changed rms_norm_eps misses, so each of its ranks publishes a graph
    of its own. Each rank has its own entry for each graph (the key holds the rank)."""
    assert jobs["roles_before_bc"] == ["comm_probe"] * 2 + ["train_step"] * 2
    assert jobs["a_cache"] == {0: (0, len(ROLES)), 1: (0, len(ROLES))}
    assert jobs["b_cache"] == {0: (2, 0), 1: (2, 0)}  # comm_probe, train_step; no eval
    assert jobs["b2_cache"] == {0: (len(ROLES), 0), 1: (len(ROLES), 0)}
    roles = _store_roles(jobs["store"])
    # C's own entries: its comm_probe on each rank, compiled before its await at step 1.
    # Its train_step too when its workers, SIGTERMed as the killed launcher's msrun dies,
    # finish the step they were released into before msrun's SIGKILL lands (load-dependent)
    assert roles.count("comm_probe") == 4 and roles.count("eval_step") == 2, roles
    assert roles.count("train_step") in (2, 4), roles
