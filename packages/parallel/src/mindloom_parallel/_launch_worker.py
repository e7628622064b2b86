"""A worker's side of ``launch`` and the run directory's lock: ``guard_worker`` (this
process must not outlive the job) and ``RunLock`` (one live job per run directory). The
launcher hands both their settings through the environment variables named here."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

from mindloom_parallel._launch_diag import WORKER_PID_LINE, LaunchError
from mindloom_parallel._launch_proc import alive, set_parent_death_signal, start_time


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


RUN_LOCK_ENV = "MINDLOOM_RUN_LOCK"
_held_lock_fd: int | None = None
LAUNCHER_PID_ENV = "MINDLOOM_LAUNCHER_PID"
STOP_GRACE_ENV = "MINDLOOM_STOP_GRACE_S"
RUN_ENDED_ENV = "MINDLOOM_RUN_ENDED_DIR"
EXIT_ORPHANED = 5


def mark_run_ended(code: int) -> None:
    """Call when the script's work is over and its files are durable, just before it
    returns: records ``code`` for the launcher. MindSpore 2.10's cluster teardown, which
    runs after this, can crash a worker whose run has ended (a SIGSEGV in its receive
    thread, seen about once a day here); ``launch`` reads these marks so such a crash does
    not turn a finished job into a failed one. A no-op outside ``launch``."""
    where = os.environ.get(RUN_ENDED_ENV)
    if not where or os.environ.get("MS_ROLE") == "MS_SCHED":  # msrun's scheduler runs it too
        return
    name = f"worker_{os.environ.get('RANK_ID', '')}_{os.getpid()}"
    tmp = Path(where) / f".{name}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{int(code)}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(where) / name)


def ended_codes(where: Path) -> list[int]:
    """The codes the workers recorded with ``mark_run_ended`` in ``where``."""
    out = []
    for p in sorted(where.glob("worker_*")):
        try:
            out.append(int(p.read_text().strip()))
        except ValueError:  # a mark is written whole (rename) or not at all
            continue
    return out


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

    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if not launcher.isdigit():
        return
    print(f"{WORKER_PID_LINE} {os.getpid()}", flush=True)
    lock = os.environ.get(RUN_LOCK_ENV)
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
    if parent == 1 or not alive(parent):  # msrun went before the prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
    launcher_pid, launcher_start = int(launcher), start_time(int(launcher))
    try:
        grace = float(os.environ.get(STOP_GRACE_ENV, "300"))
    except ValueError:
        grace = 300.0

    def watch() -> None:
        while start_time(launcher_pid) == launcher_start and launcher_start is not None:
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
