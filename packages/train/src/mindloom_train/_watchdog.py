"""A step watchdog for multi-worker runs: a hang inside a collective ends the job.

A rank that stops (a dead process, a deadlock, a rank stuck in I/O) leaves every other rank
blocked inside its next all-reduce, forever: MindSpore's CPU collectives have no timeout
of their own. The training thread re-arms this watchdog at each phase (a step, an
evaluation, a checkpoint save); if one phase makes no progress for its budget, a daemon
thread reports which phase, on which rank, for how long, and ends the process with
EXIT_HANG (the blocked thread cannot be interrupted any other way). msrun then sees a
failed worker and the launcher exits non-zero; `resume: auto` continues from the last
complete checkpoint on relaunch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from mindloom_train._errors import EXIT_HANG


class StepWatchdog:
    def __init__(self, rank: int, report: Callable[[str], None], *, poll_s: float = 0.5):
        self.rank = rank
        self._report = report
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._budget = 0.0
        self._since = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def arm(self, phase: str, budget_s: float) -> None:
        """`phase` must finish (or the next arm come) within `budget_s` seconds."""
        with self._lock:
            self._phase, self._budget, self._since = phase, budget_s, time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:
                phase, budget, since = self._phase, self._budget, self._since
            if phase is None:
                continue
            waited = time.monotonic() - since
            if waited > budget:
                try:
                    self._report(
                        f"error: rank {self.rank}: {phase} made no progress for {waited:.0f} s "
                        f"(budget {budget:g} s): a rank is hung or gone inside a collective; "
                        f"ending this worker with exit code {EXIT_HANG} (see every "
                        f"rank's log; relaunch to resume from the last complete checkpoint)"
                    )
                finally:
                    os._exit(EXIT_HANG)
