"""The launcher's side of a job's processes: msrun and its workers, each in a session of
its own, tied to the launcher by parent-death signals, stopped by forwarded signals, and
killed (every process group) on the way out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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


def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): a pid's identity."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else fields[19].decode()


def die_with_parent(sig: int):
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig)
        if os.getppid() != parent:  # the launcher died before the prctl took effect
            os._exit(1)

    return preexec


def children(pid: int) -> list[int]:
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


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class Job:
    """msrun and the workers it starts (each in a session of its own, as msrun makes them):
    the workers are remembered while msrun lives, so that they can be stopped after it died."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.workers: set[int] = set()  # process groups of the workers (pid == pgid)
        self.signalled: set[int] = set()

    def refresh(self) -> None:
        for child in children(self.proc.pid):
            try:
                if os.getpgid(child) == child and child != self.proc.pid:
                    self.workers.add(child)
            except ProcessLookupError:
                pass

    def live_workers(self) -> list[int]:
        return [w for w in self.workers if alive(w)]

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

    def wait(self, timeout_s: float | None, stop: StopRequest, grace_s: float) -> int:
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


class StopRequest:
    def __init__(self):
        self.signum: int | None = None
        self.since: float | None = None
        self.killed = False
        self.forwarded = False

    def request(self, signum: int, job: Job, forward: bool = True) -> None:
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


class forward_signals:
    """SIGTERM, SIGINT and SIGHUP to the launcher become a clean stop of the job."""

    _SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, job: Job):
        self.job = job
        self.stop = StopRequest()
        self.old: dict = {}

    def __enter__(self) -> StopRequest:
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
