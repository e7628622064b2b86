"""Launch a script on N workers per node with MindSpore's ``msrun``.

``launch`` checks the layout BEFORE any worker starts, runs msrun with its timeouts set
(so a broken worker cannot hang the job), keeps one log per rank in ``log_dir``
(``worker_<rank>.log``, msrun's own output in ``msrun.log``) and turns a failure into one
line: which rank died and its last error, or that the rendezvous timed out.

The parts: this module builds the msrun command and its environment and decides the
outcome; ``_launch_proc`` runs and stops the processes; ``_launch_worker`` is the
workers' side (``guard_worker``) and the run lock; ``_launch_diag`` the errors and
``diagnose``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from mindloom_parallel._config import validate
from mindloom_parallel._launch_diag import (
    WORKER_PID_LINE,
    LaunchError,
    LaunchStopped,
    _killed_rank,
    diagnose,
)
from mindloom_parallel._launch_proc import (
    Job,
    die_with_parent,
    forward_signals,
    set_parent_death_signal,
)
from mindloom_parallel._launch_worker import (
    EXIT_ORPHANED,
    LAUNCHER_PID_ENV,
    RUN_ENDED_ENV,
    RUN_LOCK_ENV,
    STOP_GRACE_ENV,
    RunLock,
    ended_codes,
    guard_worker,
    mark_run_ended,
)

__all__ = [
    "launch",
    "LaunchError",
    "LaunchStopped",
    "free_port",
    "diagnose",
    "set_parent_death_signal",
    "guard_worker",
    "mark_run_ended",
    "EXIT_ORPHANED",
    "RunLock",
    "WORKER_PID_LINE",
]


# MindSpore's CPU collectives give up on a peer after 30 s unless this is set (seconds;
# measured with 2.10: a rank 35 s late fails its peer's AllReduce)
CPU_COMM_TIMEOUT_ENV = "MS_CPU_COMM_OP_TIMEOUT"
# How often a MindSpore node retries its registration with the scheduler (seconds; MindSpore
# picks a random wait between the two, 3-5 s by default, to spread a large cluster's
# retries). On one node a handful of workers join in one-second steps instead: measured on
# a 2-worker launch of a script that only calls init(), 21.0 s -> 13.8 s wall (mean of 3
# alternated pairs, load ~5); several nodes keep MindSpore's default.
RETRY_INTERVAL_ENVS = ("MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER")
COLLECTIVE_TIMEOUT_S = 1800
# the fused CPU kernels' thread count (read by mindloom_model's kernel library)
KERNEL_THREADS_ENV = "MINDLOOM_KERNEL_THREADS"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    script_args: list[str],
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    log_dir: str | os.PathLike = "msrun_logs",
    timeout_s: float | None = None,
    cluster_timeout_s: int = 120,
    env: dict | None = None,
    pcfg=None,
    model_cfg=None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    stop_grace_s: float = 300.0,
    lock: RunLock | None = None,
    collective_timeout_s: int = COLLECTIVE_TIMEOUT_S,
) -> int:
    """Run ``script_args`` (``["train.py", "--flag", ...]`` or ``["-m", "pkg.mod", ...]``)
    on ``nproc`` workers on this node, ``nproc * nnodes`` in all; returns 0 when every
    worker succeeded, else raises ``LaunchError`` (one-line message).

    With ``pcfg`` given, the layout is validated against the world size (and the model
    and batch, if given) first, raising ``ParallelConfigError`` before anything starts.
    ``cluster_timeout_s`` bounds the rendezvous (msrun's ``--cluster_time_out``);
    ``timeout_s`` bounds the whole job (None: no limit). Several nodes: run the same call
    on every node with its ``node_rank``, the same ``master_addr`` (node 0's address)
    and an explicit ``master_port``.

    ``collective_timeout_s`` is how long a rank waits in a collective for its peers
    (``MS_CPU_COMM_OP_TIMEOUT`` on the CPU backend, unless the environment sets it): MindSpore's
    default of 30 s fails a job whenever one rank is half a minute behind the others (a
    graph compiling on a loaded machine, rank 0 evaluating or saving). Keep it above the
    longest such gap; a rank that is truly hung is the trainer's watchdog's to report.

    SIGTERM, SIGINT (Ctrl-C) or SIGHUP to the launcher is forwarded to every worker, which
    finishes its step (all ranks agree on it), saves and exits; the call then raises
    ``LaunchStopped`` (returncode 0). Workers still running ``stop_grace_s`` seconds after
    the signal, or after a second one, are killed (``LaunchError``, 128 + signal). On every
    way out, no worker, no scheduler and no msrun is left running; msrun dies with the
    launcher even when that is SIGKILLed (its workers follow it, see
    ``set_parent_death_signal``).
    """
    world = nproc * nnodes
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise LaunchError(
            f"bad launch shape: nproc={nproc}, nnodes={nnodes}, node_rank={node_rank}"
        )
    if pcfg is not None:
        validate(pcfg, model_cfg, world, global_batch_size, micro_batch_size)
    if master_port is None:
        if nnodes > 1:
            raise LaunchError("several nodes need an explicit master_port (the same on every node)")
        master_port = free_port()
    args = _resolve_script(list(script_args))
    _check_script_options(args[1:])
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = _msrun_command(args, world, nproc, node_rank, master_addr, master_port, log_dir,
                         cluster_timeout_s)  # fmt: skip
    ended = log_dir / "ended"
    shutil.rmtree(ended, ignore_errors=True)  # a previous job's marks
    ended.mkdir()
    run_env = _msrun_env(env, stop_grace_s, lock, collective_timeout_s, nnodes, nproc)
    run_env[RUN_ENDED_ENV] = str(ended)
    rc, stop = _run_msrun(cmd, run_env, log_dir, timeout_s, stop_grace_s)
    if rc != 0 and not stop.killed and _ended_cleanly(ended, nproc):
        # every worker had finished its run (files durable) and said so before msrun saw
        # the failure: a crash in MindSpore's teardown, not a failed job
        killed = _killed_rank(log_dir)
        who = f"rank {killed[0]} died by {killed[1]}" if killed else f"msrun exited with {rc}"
        print(f"launch: warning: {who} after every worker had ended its run with code 0 "
              f"(a crash in MindSpore's teardown); the job's files are complete; logs in "
              f"{log_dir}", file=sys.stderr)  # fmt: skip
        rc = 0
    _raise_for_outcome(rc, stop, stop_grace_s, log_dir)
    return 0


def _run_msrun(cmd, run_env: dict, log_dir: Path, timeout_s, stop_grace_s: float):
    """msrun until it ends, signals forwarded; returns (its exit code, the stop state)."""
    with open(log_dir / "msrun.log", "ab") as out:
        # msrun in a session of its own: a terminal's Ctrl-C reaches this launcher only (msrun
        # would SIGKILL the workers on SIGINT, no checkpoint); the launcher forwards it.
        # PDEATHSIG: msrun dies with the launcher, even a SIGKILLed one
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=run_env, start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGKILL),
        )  # fmt: skip
        job = Job(proc)
        with forward_signals(job) as stop:
            try:
                rc = job.wait(timeout_s, stop, stop_grace_s)
            except subprocess.TimeoutExpired:
                job.kill()
                raise LaunchError(
                    f"job did not finish within {timeout_s:.0f} s and was stopped; logs in {log_dir}",
                    124,
                    str(log_dir),
                ) from None
            except BaseException:
                job.kill()
                raise
    return rc, stop


def _ended_cleanly(ended: Path, nproc: int) -> bool:
    codes = ended_codes(ended)
    return len(codes) == nproc and all(c == 0 for c in codes)


def _resolve_script(args: list[str]) -> list[str]:
    """``["-m", "pkg.mod", ...]`` -> the module's file (its ``__main__`` for a package) and
    the rest; a script path must exist."""
    if not args:
        raise LaunchError("nothing to launch: give a script path or -m MODULE")
    if args[0] == "-m":
        import importlib.util

        spec = importlib.util.find_spec(args[1]) if len(args) > 1 else None
        if spec is None or spec.origin is None:
            raise LaunchError(f"module {args[1] if len(args) > 1 else ''!r} not found")
        origin = spec.origin
        if origin.endswith("__init__.py"):
            main_spec = importlib.util.find_spec(args[1] + ".__main__")
            origin = main_spec.origin if main_spec else origin
        args = [origin, *args[2:]]
    elif not Path(args[0]).is_file():
        raise LaunchError(f"script not found: {args[0]}")
    return args


def _msrun_command(args: list[str], world: int, nproc: int, node_rank: int, master_addr: str,
                   master_port: int, log_dir: Path, cluster_timeout_s: int) -> list[str]:  # fmt: skip
    cmd = [
        "msrun",
        f"--worker_num={world}",
        f"--local_worker_num={nproc}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        f"--node_rank={node_rank}",
        f"--log_dir={log_dir}",
        "--join=True",
        f"--cluster_time_out={int(cluster_timeout_s)}",
        # no rank: msrun would start one `tail -f` per worker log in its own process group,
        # which outlives a SIGKILLed msrun (the per-rank logs are the record anyway)
        f"--tail_worker_log={world}",
        *args,
    ]
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    if os.path.exists(msrun):
        cmd[0] = msrun
    if node_rank > 0:
        # msrun starts a scheduler on every node whose addresses include master_addr; only
        # node 0 may host it (two schedulers on one host, as when nodes are simulated on
        # 127.0.0.1, split the rendezvous), so other nodes run msrun with that check off
        cmd = [sys.executable, "-c", _MSRUN_NOT_MASTER, *cmd[1:]]
    elif world == nproc:
        cmd = [sys.executable, "-c", _MSRUN_ONE_NODE, *cmd[1:]]
    return cmd


def _msrun_env(env: dict | None, stop_grace_s: float, lock: RunLock | None,
               collective_timeout_s: int, nnodes: int = 1, nproc: int = 1) -> dict:  # fmt: skip
    run_env = dict(os.environ if env is None else env)
    # the fused CPU kernels' thread pool (mindloom_model's kernels: auto) sizes itself to
    # every CPU the process may use; nproc workers on one node would each start that many
    # threads, which then wait on each other for cores at every kernel call
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    run_env.setdefault(KERNEL_THREADS_ENV, str(max(1, (cpus or 1) // max(1, nproc))))
    run_env.setdefault(CPU_COMM_TIMEOUT_ENV, str(int(collective_timeout_s)))
    if nnodes == 1:
        for name in RETRY_INTERVAL_ENVS:
            run_env.setdefault(name, "1")
    # msrun starts workers with the `python` on PATH: make it this interpreter
    bindir = os.path.dirname(sys.executable)
    run_env["PATH"] = bindir + os.pathsep + run_env.get("PATH", "")
    run_env.setdefault("GLOG_v", "3")
    run_env[LAUNCHER_PID_ENV] = str(os.getpid())
    run_env[STOP_GRACE_ENV] = f"{stop_grace_s:g}"
    if lock is not None:
        run_env[RUN_LOCK_ENV] = str(lock.path)
    return run_env


def _raise_for_outcome(rc: int, stop, stop_grace_s: float, log_dir: Path) -> None:
    """A stop by signal (clean: ``LaunchStopped``; workers killed or failed: ``LaunchError``)
    or a failed job (``LaunchError`` with ``diagnose``'s line); nothing for success."""
    if stop.signum is not None:
        name = signal.Signals(stop.signum).name
        if stop.killed:
            raise LaunchError(
                f"{name} received: the workers did not stop within {stop_grace_s:g} s and were "
                f"killed (no checkpoint of the last steps); logs in {log_dir}",
                128 + stop.signum,
                str(log_dir),
            )
        if rc == 0:
            raise LaunchStopped(
                f"{name} received: every worker saved a checkpoint and stopped; logs in {log_dir}",
                stop.signum,
                str(log_dir),
            )
        raise LaunchError(
            f"{name} received, and not every worker stopped cleanly (a worker stops without "
            f"a checkpoint before its first step): {diagnose(log_dir, rc)}",
            128 + stop.signum,
            str(log_dir),
        )
    if rc != 0:
        raise LaunchError(diagnose(log_dir, rc), rc, str(log_dir))


# msrun itself, after a patch of its process manager (the snippets below)
_MSRUN_MAIN = (
    "from mindspore.parallel.cluster.run import main\nsys.argv[0] = 'msrun'\nsys.exit(main())\n"
)

_MSRUN_NOT_MASTER = (
    "import sys\n"
    "from mindspore.parallel.cluster.process_entity import _api\n"
    "_api._is_local_ip = lambda ip: False\n"
) + _MSRUN_MAIN


# The whole job on this node: once every worker has exited nobody needs the scheduler any
# more, and msrun ends there instead of waiting for it.
# - Every worker exited with code 0: MindSpore 2.10's scheduler notices its workers'
#   unregistration only every 5 s (its finalize loop; Python code cannot run in it
#   meanwhile: `init` holds the GIL), so every launch ended 0-5 s after its last worker
#   (measured: 3.4 s on a 2-worker debug run).
# - A worker failed: msrun SIGKILLs the others, then waits for the scheduler, which waits
#   out the dead nodes' heartbeat (30 s: "The node: 3 is timed out", measured in
#   test_train_pipeline_moe.py's killed rank). The job has failed either way; msrun still
#   reports it (the scheduler, killed, exits non-zero) and the diagnosis reads msrun's and
#   the workers' logs, not the scheduler's.
# A job spread over several nodes (their workers may still need the scheduler) keeps
# msrun's own wait.
_MSRUN_ONE_NODE = (
    "import sys\n"
    "from mindspore.parallel.cluster.process_entity import _api\n"
    "_join = getattr(_api._ProcessManager, 'join_processes', None)\n"
    "def join_processes(self):\n"
    "    sched = getattr(self, 'msn_process', None)\n"
    "    workers = getattr(self, 'cgn_processes', None)\n"
    "    if sched is not None and workers is not None:  # else: another msrun, its own wait\n"
    "        wait = sched.wait\n"
    "        def released(timeout=None):\n"
    "            if workers and all(p.poll() == 0 for p in workers):\n"
    "                sched.kill()\n"
    "                wait()\n"
    "                sched.returncode = 0\n"
    "                print('msrun: every worker exited with code 0: scheduler released', flush=True)\n"
    "                return 0\n"
    "            if workers and any(p.poll() not in (None, 0) for p in workers):\n"
    "                for p in workers:  # msrun has sent the others SIGKILL\n"
    "                    try:\n"
    "                        p.wait(30)\n"
    "                    except Exception:\n"
    "                        return wait(timeout)\n"
    "                sched.kill()\n"
    "                wait()\n"
    "                print('msrun: a worker failed and every worker has exited: scheduler released', flush=True)\n"
    "                return sched.returncode\n"
    "            return wait(timeout)\n"
    "        sched.wait = released\n"
    "    return _join(self)\n"
    "if _join is not None:\n"
    "    _api._ProcessManager.join_processes = join_processes\n"
) + _MSRUN_MAIN


_MSRUN_OPTIONS = (
    "help", "worker_num", "local_worker_num", "master_addr", "master_port", "node_rank",
    "log_dir", "join", "cluster_time_out", "bind_core", "bind_numa", "sim_level",
    "sim_rank_id", "rank_table_file", "worker_log_name", "tail_worker_log",
)  # fmt: skip


def _check_script_options(args: list[str]) -> None:
    # msrun's argparse also reads options after the script and expands abbreviations,
    # so a script option that prefixes one of msrun's is taken by msrun
    for a in args:
        if not a.startswith("--") or a == "--":
            continue
        name = a[2:].split("=", 1)[0]
        hits = [o for o in _MSRUN_OPTIONS if o.startswith(name)]
        if hits:
            raise LaunchError(
                f"script option {a.split('=', 1)[0]} would be read by msrun as "
                f"--{hits[0]}: rename it"
            )
