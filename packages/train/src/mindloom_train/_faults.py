"""Test-only fault injection, driven by the MINDLOOM_FAULT environment variable.

So that reliability tests never depend on timing luck, a fault fires at an exact step:

    MINDLOOM_FAULT="nan_loss@5"            the loss of update 5 becomes NaN
    MINDLOOM_FAULT="inf_grad@5"            one gradient of update 5 becomes +Inf
    MINDLOOM_FAULT="grad_spike@5"          the gradients of update 5 are scaled by 1e6
    MINDLOOM_FAULT="pause_save@4:2"        the save at step 4 stops after writing 2 files
                                           (prints a marker line, then sleeps: kill -9 it)
    MINDLOOM_FAULT="pause_save@4:tracker"  ... after the rename, before `latest` is updated
    MINDLOOM_FAULT="kill_save@4:1"         rank 1 SIGKILLs itself during the save at step 4,
                                           after its first file (a distributed save: the
                                           other ranks' files may be complete)
    MINDLOOM_FAULT="fail_save@4:2"         the save at step 4 raises ENOSPC after 2 files
    MINDLOOM_FAULT="slow_save@4:2.5"       the save at step 4 sleeps 2.5 s before its first
                                           file (an async save lets training move on meanwhile)
    MINDLOOM_FAULT="hold_save@4:6"         the save at step 4 waits before its first file
                                           until update 6 has begun (up to 300 s): an async
                                           save is in flight while training moves on, by event
    MINDLOOM_FAULT="sigterm@6"             SIGTERM to this process during update 6
    MINDLOOM_FAULT="hang@3:1"              rank 1 blocks at the start of update 3 in a C call
                                           that holds the GIL (its own Python threads stop,
                                           MindSpore's heartbeat goes on), so the other ranks
                                           wait in its collective
    MINDLOOM_FAULT="sigkill@3:1"           rank 1 SIGKILLs itself at the start of update 3
    MINDLOOM_FAULT="sigint@6"              SIGINT to this process during update 6
    MINDLOOM_FAULT="await_stop@3"          update 3 waits (up to 300 s) for a stop signal,
                                           after printing a marker line: a test signals the
                                           launcher then, at a known step
    MINDLOOM_FAULT="step_error@5"          update 5 raises the plain RuntimeError a failing
                                           MindSpore op raises (the "failed step" exit row)
    MINDLOOM_FAULT="ballast@1:1"           rank 1 holds 64 MiB more (resident) from update 1
                                           on: a per-rank memory field shows whose it is
    MINDLOOM_FAULT="slow_data@9-12:0.6"    the training batches of updates 9-12 reach the
                                           loader 0.6 s after their update has begun (its
                                           producer thread waits for that, then sleeps):
                                           a slow data source the prefetch cannot hide,
                                           seen as data wait whatever the step time
    MINDLOOM_FAULT="slow_comm@4-6:0.6"     the data-parallel gradient all-reduce that the log
                                           records of updates 4-6 time (the compiled step's
                                           comm probe) starts 0.6 x the rank's mean step
                                           time late on every rank, inside its timer: a
                                           communication share of at least 60%, whatever
                                           the machine's load
    MINDLOOM_FAULT="nan_loss@3:1"          step faults take an optional rank (here rank 1)

Several faults are separated by commas; a step range `a-b` fires on every step in it.
An unset variable costs nothing. Never set it in production.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass

ENV = "MINDLOOM_FAULT"
PAUSE_MARKER = "MINDLOOM_FAULT: paused"
_STEP_KINDS = {"nan_loss", "inf_grad", "grad_spike", "sigterm", "hang", "sigkill", "sigint",
               "await_stop", "step_error", "ballast"}  # fmt: skip
BALLAST_MB = 64
AWAIT_MARKER = "MINDLOOM_FAULT: awaiting a stop signal"
_SAVE_KINDS = {"pause_save", "fail_save", "slow_save", "hold_save", "kill_save"}
_DATA_KINDS = {"slow_data"}
_COMM_KINDS = {"slow_comm"}


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    first: int
    last: int
    arg: str | None


def parse(spec: str | None) -> list[Fault]:
    faults = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind, _, rest = item.partition("@")
        if kind not in _STEP_KINDS | _SAVE_KINDS | _DATA_KINDS | _COMM_KINDS or not rest:
            raise FaultSpecError(f"{ENV}: cannot parse {item!r}")
        steps, _, arg = rest.partition(":")
        try:
            a, _, b = steps.partition("-")
            first, last = int(a), int(b or a)
        except ValueError:
            raise FaultSpecError(f"{ENV}: bad step in {item!r}") from None
        faults.append(Fault(kind, first, last, arg or None))
    return faults


class FaultInjector:
    def __init__(self, spec: str | None = None, rank: int = 0):
        self.faults = parse(os.environ.get(ENV) if spec is None else spec)
        self.rank = rank
        self.step_begun = 0  # the last update at_step_start saw (hold_save waits on it)
        self.ballast: bytes | None = None

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _hits(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.first <= step <= f.last]

    def step_fault(self, kind: str, step: int) -> bool:
        for f in self._hits(kind, step):
            if f.arg is None or int(f.arg) == self.rank:
                return True
        return False

    def slow_data(self, dataset, global_batch_size: int):
        """`dataset` itself, or under a slow_data fault a view of it whose batches for the
        faulted updates arrive late (the loader's producer thread waits, so the trainer's
        data wait is the loader's own measurement)."""
        slow = [f for f in self.faults if f.kind == "slow_data"]
        return _SlowData(dataset, slow, global_batch_size, self) if slow else dataset

    def slow_comm(self, step: int) -> float:
        """The delay of the collective timed at update `step`'s record, as a fraction of
        the rank's mean step time (0.0: none)."""
        return sum(float(f.arg or 0.5) for f in self._hits("slow_comm", step))

    def at_step_start(self, step: int, stopped=lambda: False) -> None:
        """The faults that fire as update `step` begins: sigterm, sigint, sigkill, hang,
        await_stop (until `stopped()`)."""
        self.step_begun = step
        if self.step_fault("ballast", step) and self.ballast is None:
            self.ballast = b"\x01" * (BALLAST_MB << 20)  # written, so every page is resident
        if self.step_fault("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.step_fault("step_error", step):
            raise RuntimeError(f"MINDLOOM_FAULT: step_error injected at step {step}")
        if self.step_fault("sigint", step):
            os.kill(os.getpid(), signal.SIGINT)
        if self.step_fault("await_stop", step):
            print(f"{AWAIT_MARKER} step={step} rank={self.rank}", file=sys.stderr, flush=True)
            deadline = time.monotonic() + 300
            while not stopped() and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.step_fault("sigkill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.step_fault("hang", step):
            import ctypes

            ctypes.PyDLL(None).sleep(3600)  # PyDLL: the GIL stays held

    def on_save_progress(self, step: int, files_written: int | str) -> None:
        """Called by the checkpoint writer after each file and before the tracker update."""
        for f in self._hits("pause_save", step):
            if f.arg == str(files_written):
                print(
                    f"{PAUSE_MARKER} step={step} after={files_written}", file=sys.stderr, flush=True
                )
                while True:  # the test kills us here
                    time.sleep(3600)
        for f in self._hits("kill_save", step):
            if files_written == 1 and int(f.arg or 0) == self.rank:
                os.kill(os.getpid(), signal.SIGKILL)
        for f in self._hits("hold_save", step):
            deadline = time.monotonic() + 300
            while files_written == 0 and self.step_begun < int(f.arg or step + 1):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        for f in self._hits("slow_save", step):
            if files_written == 0:
                time.sleep(float(f.arg or 1.0))
        for f in self._hits("fail_save", step):
            if f.arg == str(files_written):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")


class _SlowData:
    """A dataset whose `get_batch` holds the samples of a faulted update until that update
    has begun, then sleeps (update k reads the global batch of samples [(k - 1) G, k G)
    on every data-parallel rank): the loader's prefetch cannot absorb the delay, so the
    trainer waits about the fault's seconds per faulted update on any machine."""

    def __init__(self, dataset, faults: list[Fault], global_batch_size: int, injector):
        self.dataset, self.faults, self.batch = dataset, faults, global_batch_size
        self.injector = injector

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):
        return getattr(self.dataset, name)

    def get_batch(self, idx):
        step = int(idx[0]) // self.batch + 1
        for f in self.faults:
            if f.first <= step <= f.last:
                deadline = time.monotonic() + 300
                while self.injector.step_begun < step and time.monotonic() < deadline:
                    time.sleep(0.005)
                time.sleep(float(f.arg or 0.5))
        return self.dataset.get_batch(idx)
