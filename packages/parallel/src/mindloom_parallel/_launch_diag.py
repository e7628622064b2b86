"""Why a launch failed, in one line: the launch errors and ``diagnose``, which reads
msrun's log and the per-rank logs (a refused command line, a rank killed by a signal, a
Python error on some rank, a rendezvous that timed out)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path


class LaunchError(RuntimeError):
    """A launch that failed; ``str(e)`` is one line, ``e.log_dir`` holds the per-rank logs."""

    def __init__(self, message: str, returncode: int = 1, log_dir: str | None = None):
        super().__init__(message)
        self.returncode = returncode
        self.log_dir = log_dir


class LaunchStopped(LaunchError):
    """The job was stopped by a signal to the launcher and every worker saved and exited
    cleanly (``e.signum``); ``returncode`` is 0, as for a stopped single-process run."""

    def __init__(self, message: str, signum: int, log_dir: str | None = None):
        super().__init__(message, 0, log_dir)
        self.signum = signum


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
        else:  # a script that reports its own failure in one line (mindloom's CLIs)
            said = [ln.strip() for ln in text.splitlines() if ln.startswith("error: ")]
            if said:
                failed.append((_rank_of(log), said[-1]))
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
    for log in sorted(log_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if _TIMEOUT_PAT.search(line):
                return (
                    f"rendezvous or collective timed out (exit {returncode}): {log.name}: "
                    f"{line.strip()[:300]}; logs in {log_dir}"
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
