"""The msrun launcher: refuse bad layouts before starting, name the dead rank, time out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mindloom_model import get_preset
from mindloom_parallel import LaunchError, ParallelConfig, ParallelConfigError, launch
from mindloom_parallel._launch import diagnose, free_port

WORKER = str(Path(__file__).parent / "parallel_worker.py")
RELEASED = "every worker exited with code 0: scheduler released"
RELEASED_FAILED = "a worker failed and every worker has exited: scheduler released"


def test_a_layout_that_does_not_fit_fails_before_any_worker_starts(tmp_path):
    logs = tmp_path / "logs"
    with pytest.raises(ParallelConfigError, match=r"world size 2 != dp\*tp\*pp = 2\*2\*1 = 4"):
        launch(
            [WORKER, str(tmp_path)],
            nproc=2,
            log_dir=logs,
            pcfg=ParallelConfig(dp=2, tp=2),
            model_cfg=get_preset("debug"),
        )
    with pytest.raises(
        ParallelConfigError, match="num_kv_heads = 2 is not divisible by parallelism.tp = 4"
    ):
        launch(
            [WORKER, str(tmp_path)],
            nproc=4,
            log_dir=logs,
            pcfg=ParallelConfig(tp=4),
            model_cfg=get_preset("debug"),
        )
    # msrun never ran: no log directory, no worker log (proven by that, not by a time bound)
    assert not logs.exists()


def test_bad_launch_arguments_are_one_line_errors(tmp_path):
    with pytest.raises(LaunchError, match="script not found"):
        launch([str(tmp_path / "missing.py")], nproc=2, log_dir=tmp_path / "l")
    with pytest.raises(LaunchError, match="explicit master_port"):
        launch([WORKER], nproc=1, nnodes=2, node_rank=1, log_dir=tmp_path / "l")
    with pytest.raises(LaunchError, match="bad launch shape"):
        launch([WORKER], nproc=1, nnodes=2, node_rank=2, log_dir=tmp_path / "l")


def test_diagnose_reads_the_per_rank_logs(tmp_path):
    (tmp_path / "worker_0.log").write_text("[INFO] fine\n")
    (tmp_path / "worker_1.log").write_text(
        "Traceback (most recent call last):\n  File x\nValueError: shapes differ\n"
    )
    assert diagnose(tmp_path, 1).startswith("worker rank 1 failed: ValueError: shapes differ")


def test_diagnose_names_a_rank_killed_by_a_signal(tmp_path):
    """issue 23 item 10: the survivor's failed collective used to make a SIGKILLed rank read
    as "rendezvous timed out". msrun's own line gives the pid and the signal; the worker's
    pid line (guard_worker) gives its rank. The real-msrun check is in
    packages/train/tests/test_train_hang.py (killed rank)."""
    (tmp_path / "msrun.log").write_text(
        "[ERROR] ME(1:1,python):2026-12-01 [_api.py:365] Worker process 4242 exit with "
        "exception. Error code: -9.\n"
    )
    (tmp_path / "worker_0.log").write_text(
        "mindloom worker pid 4241\nTraceback (most recent call last):\n  File x\n"
        "RuntimeError: The pointer[cluster] is null. Cluster is not ready: time out\n"
    )
    (tmp_path / "worker_1.log").write_text("mindloom worker pid 4242\nstep 2\n")
    msg = diagnose(tmp_path, 1)
    assert msg.startswith("worker rank 1 was killed by SIGKILL"), msg
    assert "rendezvous" not in msg


@pytest.mark.msrun
def test_a_dead_worker_is_named_and_the_job_ends(tmp_path):
    with pytest.raises(LaunchError) as e:
        launch(
            [WORKER, str(tmp_path / "out"), "--fail-rank", "1"],
            nproc=2,
            log_dir=tmp_path / "logs",
            timeout_s=300,
            cluster_timeout_s=60,
        )
    assert "worker rank 1 failed: RuntimeError: injected failure on rank 1" in str(e.value)
    assert e.value.returncode != 0
    # a failed worker: msrun has stopped the others, and the scheduler is released instead
    # of waiting out their heartbeats (_MSRUN_ONE_NODE); the job still failed
    log = (tmp_path / "logs" / "msrun.log").read_text()
    assert RELEASED_FAILED in log and RELEASED not in log, log[-2000:]
    assert (tmp_path / "logs" / "worker_0.log").exists() and (
        tmp_path / "logs" / "worker_1.log"
    ).exists()


@pytest.mark.msrun
def test_a_crash_after_every_worker_ended_its_run_is_not_a_failed_job(tmp_path, capsys):
    """MindSpore 2.10's cluster teardown can SIGSEGV a worker whose run has ended (twice in
    ~22 h of launches here: a finished zero1 run read as 14 failed tests). Workers that
    called mark_run_ended(0) before the crash make a finished job; the warning names the
    crash. Plant: the launcher ignoring the marks -> LaunchError "killed by SIGSEGV"."""
    assert (
        launch(
            [WORKER, str(tmp_path / "out"), "--crash-after-end", "1"],
            nproc=2,
            log_dir=tmp_path / "logs",
            timeout_s=300,
            cluster_timeout_s=60,
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "every worker had ended its run" in err and "rank 1 died by SIGSEGV" in err, err
    assert len(list((tmp_path / "logs" / "ended").glob("worker_*"))) == 2


@pytest.mark.msrun
def test_a_rank_half_a_minute_behind_its_peers_does_not_fail_the_collective(tmp_path):
    """MindSpore 2.10's CPU all-reduce gives up on a peer after 30 s (measured: rank 0
    failed "Ring ReduceScatter wait receiving" 30.0 s into its wait); on a loaded CI
    machine one rank's compile or rank 0's save can be that far behind, and a dp=2
    DeepSeek launch failed so. `launch` sets MS_CPU_COMM_OP_TIMEOUT (1800 s unless told).
    Rank 1 joins the second all-reduce 40 s late; both sums must be 1 + 2. The all-reduce
    is a compiled graph's, whose waiting rank sleeps (a PyNative one spins a core for the
    40 s, which the test files beside this one need).
    Plant: drop the setdefault in _msrun_env -> rank 0's all-reduce fails at 30 s (`Launch
    kernel failed: Default/AllReduce-op0`) and the launch raises LaunchError."""
    out = tmp_path / "out"
    assert launch([WORKER, str(out), "--late-rank", "1", "--late-s", "40"], nproc=2,
                  log_dir=tmp_path / "logs", timeout_s=300, cluster_timeout_s=60) == 0  # fmt: skip
    for rank in (0, 1):
        got = json.loads((out / f"late_rank{rank}.json").read_text())
        assert got["sums"] == [3.0, 3.0], (rank, got)
    assert json.loads((out / "late_rank0.json").read_text())["waited_s"] > 35
    # one node: the workers retry their registration every second (RETRY_INTERVAL_ENVS)
    assert got["retry_interval"] == ["1", "1"]
    # and msrun ended once both workers had exited with 0, without waiting for the
    # scheduler's own 5-second shutdown poll (_MSRUN_ONE_NODE)
    assert RELEASED in (tmp_path / "logs" / "msrun.log").read_text()


def test_msrun_releases_the_scheduler_only_when_the_whole_job_is_on_this_node(tmp_path):
    from mindloom_parallel._launch import _MSRUN_NOT_MASTER, _MSRUN_ONE_NODE, _msrun_command

    def cmd(world, nproc, node_rank):
        return _msrun_command(["w.py"], world, nproc, node_rank, "127.0.0.1", 1, tmp_path, 60)

    assert cmd(2, 2, 0)[1:3] == ["-c", _MSRUN_ONE_NODE]
    assert cmd(4, 2, 1)[1:3] == ["-c", _MSRUN_NOT_MASTER]
    assert Path(cmd(4, 2, 0)[0]).name == "msrun"  # node 0 of two: other nodes need it
    assert RELEASED in _MSRUN_ONE_NODE and RELEASED_FAILED in _MSRUN_ONE_NODE


def test_registration_retry_is_one_second_on_one_node_and_mindspores_own_on_several():
    from mindloom_parallel._launch import RETRY_INTERVAL_ENVS, _msrun_env

    base = {"PATH": "/usr/bin"}
    one = _msrun_env(dict(base), 300.0, None, 1800, nnodes=1)
    assert [one[n] for n in RETRY_INTERVAL_ENVS] == ["1", "1"]
    several = _msrun_env(dict(base), 300.0, None, 1800, nnodes=2)
    assert not any(n in several for n in RETRY_INTERVAL_ENVS)
    mine = _msrun_env({**base, "MS_RETRY_INTERVAL_LOWER": "4"}, 300.0, None, 1800, nnodes=1)
    assert mine["MS_RETRY_INTERVAL_LOWER"] == "4"  # the user's setting wins


def test_diagnose_quotes_a_rank_that_reported_its_own_error(tmp_path):
    """A mindloom worker ends with one `error:` line and an exit code, no traceback: the
    launch error names that rank and line (it used to read "rendezvous or collective timed
    out: not every worker joined" whenever any log said "timeout")."""
    (tmp_path / "worker_0.log").write_text("step 1\n[WARNING] Topology build timed out.\n")
    (tmp_path / "worker_1.log").write_text(
        "step 1\nerror: rank 1: step 2 failed in MindSpore (Launch kernel failed, name:"
        "Default/AllReduce-op0); another rank is probably gone: see every rank's log\n"
    )
    msg = diagnose(tmp_path, 1)
    assert msg.startswith("worker rank 1 failed: error: rank 1: step 2 failed in MindSpore"), msg
    (tmp_path / "worker_1.log").write_text("step 1\n")
    msg = diagnose(tmp_path, 1)
    assert msg.startswith("rendezvous or collective timed out (exit 1): worker_0.log: "), msg
    assert "Topology build timed out" in msg


@pytest.mark.msrun
def test_a_missing_node_is_a_rendezvous_timeout(tmp_path):
    # node 1 of 2 never starts: node 0's worker must give up after the cluster timeout
    with pytest.raises(LaunchError, match="rendezvous timed out") as e:
        launch(
            [WORKER, str(tmp_path / "out"), "--layouts", "dp2"],
            nproc=1,
            nnodes=2,
            node_rank=0,
            master_port=free_port(),
            log_dir=tmp_path / "logs",
            timeout_s=300,
            cluster_timeout_s=5,
        )
    assert str(tmp_path / "logs") in str(e.value)


def test_script_options_colliding_with_the_launcher_are_refused(tmp_path):
    # msrun expands abbreviations even after the script: --worker would be --worker_num
    with pytest.raises(LaunchError, match="--worker would be read by msrun"):
        launch([WORKER, "--worker"], nproc=2, log_dir=tmp_path / "l")
    assert not (tmp_path / "l" / "msrun.log").exists()


def _holder(lock_path: Path, code: str = "") -> subprocess.Popen:
    """Another process that takes the run lock, prints `held`, then runs `code` or waits."""
    src = (
        "import sys, time\n"
        "from mindloom_parallel import RunLock\n"
        f"lock = RunLock({str(lock_path)!r}).acquire()\n"
        "print('held', flush=True)\n" + (code or "time.sleep(600)\n")
    )
    proc = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_run_lock_refuses_a_live_holder_and_takes_over_a_killed_one(tmp_path):
    """issue 23 item 2: one live job per run directory; a SIGKILLed holder's lock is stale."""
    import json
    import socket

    from mindloom_parallel import RunLock

    path = tmp_path / "run" / ".launch.lock"
    holder = _holder(path)
    try:
        with pytest.raises(LaunchError, match="is in use by a live job") as e:
            RunLock(path).acquire()
        assert f'"pid": {holder.pid}' in str(e.value)
        assert json.dumps(socket.gethostname()) in str(e.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock(path).acquire()  # the kernel dropped the dead holder's flock
    assert lock.stale is not None and f'"pid": {holder.pid}' in lock.stale
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()


def test_run_lock_is_held_while_a_process_sharing_it_lives(tmp_path):
    """What a worker does (guard_worker): hold the launcher's lock shared, so a relaunch is
    refused while a worker of a killed launcher still runs."""
    from mindloom_parallel import RunLock

    path = tmp_path / ".launch.lock"
    share = (
        "import fcntl, os, time\n"
        f"fd = os.open({str(path)!r}, os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)\n"
        "print('shared', flush=True)\n"
        "time.sleep(600)\n"
    )
    lock = RunLock(path).acquire()
    worker = subprocess.Popen([sys.executable, "-c", share], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "shared"
        lock.release()  # the launcher is gone, its worker is not
        with pytest.raises(LaunchError, match="is in use by a live job"):
            RunLock(path).acquire()
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    RunLock(path).acquire().release()


def test_parent_death_signal_ends_the_child_of_a_sigkilled_parent(tmp_path):
    """set_parent_death_signal, as msrun's workers use it: SIGKILL the parent, the child
    gets SIGTERM and ends (it would otherwise sleep on, reparented)."""
    child_src = (
        "import time\n"
        "from mindloom_parallel import set_parent_death_signal\n"
        "assert set_parent_death_signal()\n"
        "print('armed', flush=True)\n"
        "time.sleep(600)\n"
    )
    parent_src = (
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child_src!r}], stdout=subprocess.PIPE,"
        " text=True)\n"
        "assert c.stdout.readline().strip() == 'armed'\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_src], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the child outlived its SIGKILLed parent"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
