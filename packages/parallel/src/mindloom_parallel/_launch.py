"""Launch a script on N workers per node with MindSpore's ``msrun``.

``launch`` checks the layout BEFORE any worker starts, runs msrun with its timeouts set
(so a broken worker cannot hang the job), keeps one log per rank in ``log_dir``
(``worker_<rank>.log``, msrun's own output in ``msrun.log``) and turns a failure into one
line: which rank died and its last error, or that the rendezvous timed out.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from mindloom_parallel._config import validate

__all__ = [
    "launch",
    "LaunchError",
    "LaunchStopped",
    "free_port",
    "diagnose",
    "set_parent_death_signal",
    "guard_worker",
    "EXIT_ORPHANED",
    "RunLock",
]


class LaunchError(RuntimeError):
    """A launch that failed; ``str(e)`` is one line, ``e.log_dir`` holds the per-rank logs."""

    def __init__(self, message: str, returncode: int = 1, log_dir: str | None = None):
        super().__init__(message)
        self.returncode = returncode
        self.log_dir = log_dir


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
    args = list(script_args)
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
    _check_script_options(args[1:])
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
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
    run_env = dict(os.environ if env is None else env)
    # msrun starts workers with the `python` on PATH: make it this interpreter
    bindir = os.path.dirname(sys.executable)
    run_env["PATH"] = bindir + os.pathsep + run_env.get("PATH", "")
    run_env.setdefault("GLOG_v", "3")
    run_env[_LAUNCHER_PID_ENV] = str(os.getpid())
    run_env[_STOP_GRACE_ENV] = f"{stop_grace_s:g}"
    if lock is not None:
        run_env[_RUN_LOCK_ENV] = str(lock.path)
    msrun = os.path.join(bindir, "msrun")
    if os.path.exists(msrun):
        cmd[0] = msrun
    if node_rank > 0:
        # msrun starts a scheduler on every node whose addresses include master_addr; only
        # node 0 may host it (two schedulers on one host, as when nodes are simulated on
        # 127.0.0.1, split the rendezvous), so other nodes run msrun with that check off
        cmd = [sys.executable, "-c", _MSRUN_NOT_MASTER, *cmd[1:]]
    with open(log_dir / "msrun.log", "ab") as out:
        # msrun in a session of its own: a terminal's Ctrl-C reaches this launcher only (msrun
        # would SIGKILL the workers on SIGINT, no checkpoint); the launcher forwards it.
        # PDEATHSIG: msrun dies with the launcher, even a SIGKILLed one
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=run_env, start_new_session=True,
            preexec_fn=_die_with_parent(signal.SIGKILL),
        )  # fmt: skip
        job = _Job(proc)
        with _forward_signals(job) as stop:
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
    return 0


class LaunchStopped(LaunchError):
    """The job was stopped by a signal to the launcher and every worker saved and exited
    cleanly (``e.signum``); ``returncode`` is 0, as for a stopped single-process run."""

    def __init__(self, message: str, signum: int, log_dir: str | None = None):
        super().__init__(message, 0, log_dir)
        self.signum = signum


_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (PR_SET_PDEATHSIG);
    False where that is not available. Called in msrun's workers (whose parent is msrun)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class RunLock:
    """One live job per run directory: ``acquire`` takes an exclusive ``flock`` on ``path``
    (written: launcher pid, host, start time) or raises ``LaunchError`` naming the holder.
    The kernel drops a dead holder's lock, so a stale file (a killed launcher) is taken over
    and said so. ``launch(..., lock=...)`` then shares the lock with the workers (each holds
    it shared until it exits), so a relaunch is refused while any worker of a SIGKILLed
    launcher is still stopping."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd: int | None = None
        self.stale: str | None = None  # the previous holder's record, when it was stale

    def acquire(self) -> RunLock:
        import fcntl
        import json
        import time

        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise LaunchError(f"{self.path}: cannot open the run lock: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown holder"
            os.close(fd)
            raise LaunchError(
                f"{self.path.parent} is in use by a live job ({holder[:300]}; lock {self.path}): "
                f"stop that job first"
            ) from None
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        self.stale = previous[:300] or None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        # shared from here on, so that the workers can hold it too (flock converts by
        # dropping and retaking: a competing acquire in that instant is the one race left)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_RUN_LOCK_ENV = "MINDLOOM_RUN_LOCK"
_held_lock_fd: int | None = None
_LAUNCHER_PID_ENV = "MINDLOOM_LAUNCHER_PID"
_STOP_GRACE_ENV = "MINDLOOM_STOP_GRACE_S"
EXIT_ORPHANED = 5


def guard_worker() -> None:
    """Call first thing in a script that ``launch`` runs: this process must not outlive
    the job. Its parent is msrun, which dies with the launcher; PR_SET_PDEATHSIG turns
    msrun's death into a SIGTERM here (a clean stop where the script handles it). A thread
    also watches the launcher itself: gone while msrun lives, this process gets a SIGTERM;
    still alive the stop grace after the launcher went (a stop stuck in a collective whose
    peers are gone), it exits with ``EXIT_ORPHANED``. Prints the pid line ``diagnose``
    uses to name a killed rank. A no-op outside ``launch`` (no launcher pid in the env)."""
    import threading
    import time

    launcher = os.environ.get(_LAUNCHER_PID_ENV, "")
    if not launcher.isdigit():
        return
    print(f"{WORKER_PID_LINE} {os.getpid()}", flush=True)
    lock = os.environ.get(_RUN_LOCK_ENV)
    if lock:
        import fcntl

        global _held_lock_fd
        try:  # held until this process exits
            _held_lock_fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            fcntl.flock(_held_lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            pass
    parent = os.getppid()
    set_parent_death_signal(signal.SIGTERM)
    if parent == 1 or not _alive(parent):  # msrun went before the prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
    launcher_pid, launcher_start = int(launcher), _start_time(int(launcher))
    try:
        grace = float(os.environ.get(_STOP_GRACE_ENV, "300"))
    except ValueError:
        grace = 300.0

    def watch() -> None:
        while _start_time(launcher_pid) == launcher_start and launcher_start is not None:
            time.sleep(1.0)
        if os.getppid() == parent:  # msrun still here: no parent-death signal came
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        print(
            f"error: the launcher (pid {launcher_pid}) is gone and this worker did not stop "
            f"within {grace:g} s; exiting with code {EXIT_ORPHANED}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): a pid's identity."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else fields[19].decode()


def _die_with_parent(sig: int):
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig)
        if os.getppid() != parent:  # the launcher died before the prctl took effect
            os._exit(1)

    return preexec


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class _Job:
    """msrun and the workers it starts (each in a session of its own, as msrun makes them):
    the workers are remembered while msrun lives, so that they can be stopped after it died."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.workers: set[int] = set()  # process groups of the workers (pid == pgid)
        self.signalled: set[int] = set()

    def refresh(self) -> None:
        for child in _children(self.proc.pid):
            try:
                if os.getpgid(child) == child and child != self.proc.pid:
                    self.workers.add(child)
            except ProcessLookupError:
                pass

    def live_workers(self) -> list[int]:
        return [w for w in self.workers if _alive(w)]

    def signal_workers(self, sig: int) -> None:
        """`sig` to every live worker not yet told (workers msrun starts after a stop
        request are told when they appear)."""
        self.refresh()
        for w in self.live_workers():
            if w in self.signalled:
                continue
            self.signalled.add(w)
            try:
                os.killpg(w, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float | None, stop: _StopRequest, grace_s: float) -> int:
        import time

        t0 = time.monotonic()
        rc = None
        while True:
            if rc is None:
                if stop.forwarded:
                    self.signal_workers(stop.signum)
                else:
                    self.refresh()
                try:
                    rc = self.proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.2)
            now = time.monotonic()
            if rc is not None and not self.live_workers():
                return rc
            if rc is not None and stop.signum is None:
                # msrun itself is gone (killed from outside) with workers left: they were
                # told by their parent-death signal; wait for them as for a stop
                stop.request(signal.SIGTERM, self, forward=False)
            if stop.since is not None and now - stop.since > grace_s:
                stop.killed = True
                self.kill()
                return rc if rc is not None else -signal.SIGKILL
            if timeout_s is not None and now - t0 > timeout_s:
                raise subprocess.TimeoutExpired("msrun", timeout_s)

    def kill(self) -> None:
        """SIGKILL to msrun's group (msrun, its scheduler) and every worker's group."""
        self.refresh()
        for pg in [self.proc.pid, *self.workers]:
            try:
                os.killpg(pg, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class _StopRequest:
    def __init__(self):
        self.signum: int | None = None
        self.since: float | None = None
        self.killed = False
        self.forwarded = False

    def request(self, signum: int, job: _Job, forward: bool = True) -> None:
        import time

        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
            self.forwarded = forward
            if forward:
                # to the workers only: they agree on a stop step, save and exit 0, and
                # msrun then exits 0; the scheduler ends with them
                job.signal_workers(signum)
        elif forward and not self.forwarded:  # msrun died first; now the user asks too
            self.forwarded = True
            job.signal_workers(signum)
        elif forward:  # a second signal: stop waiting for the save
            self.since = float("-inf")


class _forward_signals:
    """SIGTERM, SIGINT and SIGHUP to the launcher become a clean stop of the job."""

    _SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, job: _Job):
        self.job = job
        self.stop = _StopRequest()
        self.old: dict = {}

    def __enter__(self) -> _StopRequest:
        for sig in self._SIGNALS:
            try:
                self.old[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: no forwarding
                pass
        return self.stop

    def _on_signal(self, signum, _frame) -> None:
        self.stop.request(signum, self.job)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


_MSRUN_NOT_MASTER = (
    "import sys\n"
    "from mindspore.parallel.cluster.process_entity import _api\n"
    "_api._is_local_ip = lambda ip: False\n"
    "from mindspore.parallel.cluster.run import main\n"
    "sys.argv[0] = 'msrun'\n"
    "sys.exit(main())\n"
)


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


_TIMEOUT_PAT = re.compile(
    r"(cluster_time_out|Cluster is not ready|timed? ?out|Timeout|exceed.*time)", re.IGNORECASE
)
_RDV_PAT = re.compile(
    r"(initialize distributed job cluster|Cluster is not ready|cluster.*time ?out)", re.IGNORECASE
)
_ERR_PAT = re.compile(r"^\w*(Error|Exception|Interrupt|Exit)\b.*|^\w+Error:.*")


def diagnose(log_dir: str | os.PathLike, returncode: int = 1) -> str:
    """One line on why a launch failed, from the per-rank logs."""
    log_dir = Path(log_dir)
    msrun_log = log_dir / "msrun.log"
    if msrun_log.exists():
        for line in msrun_log.read_text(errors="replace").splitlines():
            if line.startswith("msrun: error:"):
                return f"msrun refused the command line: {line[len('msrun: error:') :].strip()}"
    killed = _killed_rank(log_dir)
    if killed is not None:
        rank, sig = killed
        return (
            f"worker rank {rank} was killed by {sig} (no Python error; out of memory or an "
            f"outside kill?); msrun then stopped the other ranks; logs in {log_dir}"
        )
    failed = []
    for log in sorted(log_dir.glob("worker_*.log"), key=_rank_of):
        text = log.read_text(errors="replace")
        if "Traceback (most recent call last)" in text:
            err = ""
            for line in text.splitlines():
                line = line.strip()
                if _ERR_PAT.match(line):
                    err = line
            failed.append((_rank_of(log), err or "traceback (see log)"))
    rendezvous = [r for r, e in failed if _RDV_PAT.search(e)]
    if rendezvous and len(rendezvous) == len(failed):
        return (
            f"rendezvous timed out: not every worker joined the cluster in time (rank "
            f"{rendezvous[0]} gave up; check the other nodes' launch, master address and "
            f"port); logs in {log_dir}"
        )
    if failed:
        rank, err = failed[0]
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        return f"worker rank {rank} failed: {err[:300]}{more}; logs in {log_dir}"
    texts = [p.read_text(errors="replace") for p in log_dir.glob("*.log")]
    if any(_TIMEOUT_PAT.search(t) for t in texts):
        return (
            f"rendezvous or collective timed out (exit {returncode}): not every worker joined; "
            f"logs in {log_dir}"
        )
    return f"msrun exited with {returncode}: a worker died without a Python error (killed?); logs in {log_dir}"


WORKER_PID_LINE = "mindloom worker pid"  # printed by a worker at start, read by diagnose
_EXIT_PAT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


def _killed_rank(log_dir: Path) -> tuple[int | str, str] | None:
    """(rank, signal name) of the first worker msrun saw die by a signal, if one did."""
    msrun_log = log_dir / "msrun.log"
    if not msrun_log.exists():
        return None
    m = _EXIT_PAT.search(msrun_log.read_text(errors="replace"))
    if m is None or int(m.group(2)) >= 0:
        return None
    pid, code = m.group(1), -int(m.group(2))
    try:
        sig = signal.Signals(code).name
    except ValueError:
        sig = f"signal {code}"
    pid_line = re.compile(rf"^{WORKER_PID_LINE} {pid}$", re.MULTILINE)
    for log in log_dir.glob("worker_*.log"):
        if pid_line.search(log.read_text(errors="replace")):
            return _rank_of(log), sig
    return f"(pid {pid})", sig


def _rank_of(p: Path) -> int:
    m = re.search(r"(\d+)", p.stem)
    return int(m.group(1)) if m else -1
