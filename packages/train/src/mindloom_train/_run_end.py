"""The run's way out: a RuntimeError out of the loop typed for the exit-code table, and
the closing records every run writes (the peak memory against the estimate, the `error:`
line, the `end` event), each best effort when the failure is the file system itself."""

from __future__ import annotations

import sys

from mindloom_train._errors import RankLost, StepFailed, classify
from mindloom_train._metrics import peak_rss_mb


def first_line(exc: BaseException) -> str:
    """The informative line of a MindSpore error (they open with blank and dashed lines)."""
    for line in str(exc).splitlines():
        line = line.strip()
        if line and not line.startswith(("---", "- ")):
            return line
    return type(exc).__name__


def runtime_failure(exc: RuntimeError, step: int, rank: int, world: int) -> tuple[int, str]:
    """A RuntimeError out of the run at update `step`: a row of the table, or MindSpore
    failing a step, typed here so that the table decides its code."""
    known = classify(exc)
    if known is not None:
        return known
    if world <= 1:
        # an op error, a bad input MindSpore caught: one line, not a page of C++ stack
        typed = StepFailed(f"step {step} failed in MindSpore: {first_line(exc)}")
    else:
        # MindSpore fails a collective whose peer stopped answering (missed heartbeats,
        # MS_NODE_TIMEOUT)
        typed = RankLost(
            f"rank {rank}: step {step} failed in MindSpore ({first_line(exc)}); "
            f"another rank is probably gone: see every rank's log"
        )
    return classify(typed)


def log_peak_memory(log, estimate, rank: int, compiled: bool = True) -> None:
    """Every rank's log: the estimate against what happened. `compiled` False: every graph
    of the run came from the compile cache, so MindSpore's compiler (the estimate's
    "graph compiler" part, ~40% of a small model's) never held its memory here."""
    total, note = estimate.total, ""
    if not compiled and estimate.components.get("graph compiler"):
        total -= estimate.components["graph compiler"]
        note = " (no graph compiled: every graph from the compile cache)"
    try:
        log(f"memory: peak RSS {peak_rss_mb():.1f} MiB on rank {rank}; "
            f"estimate {total / 2**20:.1f} MiB{note}")  # fmt: skip
    except OSError:
        pass


def log_error(log, reason: str) -> None:
    try:
        log(f"error: {reason}")
    except OSError:  # train.log itself failed (ENOSPC): the console still gets it
        print(f"error: {reason}", file=sys.stderr)


def close_records(metrics, log, step: int, code: int, status: str, reason: str) -> None:
    """The `end` event, then metrics.jsonl and train.log closed."""
    try:  # best effort: the failure may be the metrics file itself (ENOSPC)
        metrics.event("end", step=step, status=status, reason=reason, exit_code=code)
    except OSError:
        pass
    try:
        metrics.close()
    except OSError:
        pass
    log.close()
