"""Test-only fault injection between a rank's outputs and its completion marker.

`MINDLOOM_DATA_FAULT=STAGE:RANK:once` fails that rank the first time (leaving a marker file
under WORK/faults/), `STAGE:RANK:always` every time, `STAGE:RANK:hang` blocks there forever
(after touching WORK/faults/hang-STAGE-RANK). The driver's value travels with each rank
(`fault_spec`), so Ray workers on other nodes see it too.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

FAULT_ENV = "MINDLOOM_DATA_FAULT"

_fault: str | None = None  # the spec of the rank being executed in this process


@contextlib.contextmanager
def fault_spec(spec: str):
    """The driver's fault spec for the rank run inside this block."""
    global _fault
    _fault = spec
    try:
        yield
    finally:
        _fault = None


def check_fault(work: str | os.PathLike, stage: str, rank: int) -> None:
    """Raise (or hang) here if the fault spec names this rank."""
    spec = _fault if _fault is not None else os.environ.get(FAULT_ENV, "")
    for item in filter(None, spec.split(",")):
        s, r, mode = (item.split(":") + ["once"])[:3]
        if s != stage or int(r) != rank:
            continue
        if mode == "once":
            marker = Path(work) / "faults" / f"{stage}-{rank}"
            if marker.exists():
                return
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_bytes(b"")
        if mode == "hang":  # stays in the rank until killed (process-lifetime tests)
            marker = Path(work) / "faults" / f"hang-{stage}-{rank}"
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_bytes(b"")
            while True:
                time.sleep(3600)
        raise RuntimeError(f"injected fault ({FAULT_ENV}={item})")
