"""Worker processes that die with the process that started them.

A pool worker of `LocalExecutor` (and of the char tokenizer) blocks on a pipe that it
holds both ends of, so a parent killed with SIGKILL would leave it waiting forever,
reparented to init. `die_with_parent` is the pool initializer: on Linux the kernel
sends the child SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG)`); everywhere, a
daemon thread watches the parent pid and exits the child when it changes (the fallback
where prctl is missing, and the check for a parent that died before prctl took effect).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def _set_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, poll_s: float) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(poll_s)


def die_with_parent(parent: int, poll_s: float = POLL_S) -> None:
    """Make this (forked) process exit when process `parent` (its parent) dies.

    `parent` is the pid the parent passed down: by the time a child runs, a dead
    parent's pid has already been replaced by init's.
    """
    _set_pdeathsig()
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=_watch, args=(parent, poll_s), daemon=True, name="lifeline").start()
