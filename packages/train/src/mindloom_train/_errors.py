"""The one table from an expected failure to its exit code (`mindloom train`, `launch`'s
workers): every row prints `error: ...` in one line and puts the same line in the `end`
event. Anything not in the table is a bug and keeps its traceback.

    0    completed, or stopped by SIGTERM / SIGINT after saving
    1    the run failed: unusable checkpoint, failed save, a write that failed (ENOSPC,
         EACCES, ...), out of memory, a training step that failed in MindSpore
    2    bad config or bad input named by it, before or during the run: a key, the
         parallel layout, drift on resume, the tokenizer, a corrupt, empty or
         out-of-vocabulary dataset
    3    the anomaly guard stopped training (set by the loop, not by an exception)
    4    a rank hung or died (the watchdog; a collective MindSpore failed with several
         workers)
    130  interrupted twice
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_ANOMALY, EXIT_HANG, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


class DataInputError(ValueError):
    """A dataset the config names that cannot be trained on; one line naming the file."""


def _one_line(text: str, limit: int = 2000) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line reason) of an expected failure; None for anything else."""
    from mindloom_train._checkpoint import CheckpointError
    from mindloom_train._config import ConfigError

    if isinstance(exc, ConfigError | DataInputError):
        return EXIT_CONFIG, _one_line(str(exc))
    if isinstance(exc, CheckpointError):
        return EXIT_FAILED, _one_line(str(exc))
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        why = exc.strerror or str(exc)
        return EXIT_FAILED, _one_line(f"{where}{why}")
    if isinstance(exc, MemoryError):
        return EXIT_FAILED, "out of host memory (reduce the model, seq_length or batch size)"
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted twice"
    from mindloom_train._trainer import TrainError

    if isinstance(exc, TrainError):
        return EXIT_FAILED, _one_line(str(exc))
    return None
