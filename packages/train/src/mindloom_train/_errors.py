"""The one table from an outcome to its exit code, for `mindloom` and `launch`'s workers.

Every expected failure is an exception of a row below: the CLI (and the trainer's error
path) print it as one `error: ...` line, and a run puts the same line in its `end` event.
An exception that is in no row is a bug and keeps its traceback. The README's exit-code
table is this one; `EXIT_TABLE` is what the code (and its tests) read.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_ANOMALY, EXIT_HANG, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


class ConfigError(ValueError):
    """A config problem, always one line naming the key and the value."""


class DataInputError(ValueError):
    """A dataset the config names that cannot be trained on; one line naming the file."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


class TrainError(RuntimeError):
    """A run that cannot go on (a checkpoint it cannot use, a failed save); one line."""


class StepFailed(RuntimeError):
    """A training step MindSpore failed on one process (an op error, a bad input it caught)."""


class RankLost(RuntimeError):
    """With several workers, a collective failed or hung: another rank is probably gone."""


class CommandError(RuntimeError):
    """A subcommand other than `train` failed (generate, export-hf, launch, ...); one line."""


class AnomalyStop(RuntimeError):
    """The anomaly guard stopped the run (the loop returns this code; never raised)."""


@dataclass(frozen=True)
class ExitRow:
    code: int
    errors: tuple[type[BaseException], ...]
    meaning: str


EXIT_TABLE: tuple[ExitRow, ...] = (
    ExitRow(EXIT_CONFIG, (ConfigError, DataInputError),
            "bad config or input named by it, before or during the run: a key, the parallel "
            "layout, drift on resume, the tokenizer, a corrupt, empty or out-of-vocabulary "
            "dataset"),
    ExitRow(EXIT_FAILED, (CheckpointError, TrainError),
            "the run cannot go on: an unusable checkpoint, a failed save"),
    ExitRow(EXIT_FAILED, (StepFailed,), "a training step failed in MindSpore (one process)"),
    ExitRow(EXIT_FAILED, (OSError,), "a read or write failed (ENOSPC, EACCES, ...)"),
    ExitRow(EXIT_FAILED, (MemoryError,), "out of host memory"),
    ExitRow(EXIT_FAILED, (CommandError,),
            "generate / export-hf / check-env / launch failed (the launcher when a worker failed)"),
    ExitRow(EXIT_ANOMALY, (AnomalyStop,),
            "the anomaly guard stopped training after training.max_consecutive_skips skipped "
            "updates; the checkpoint holds the last good weights"),
    ExitRow(EXIT_HANG, (RankLost,),
            "a rank hung or died: the step watchdog ended this worker, or a collective failed "
            "with several workers"),
    ExitRow(EXIT_INTERRUPTED, (KeyboardInterrupt,), "interrupted (a second SIGINT / SIGTERM)"),
)  # fmt: skip


def _one_line(text: str, limit: int = 2000) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        return _one_line(f"{where}{exc.strerror or exc}")
    if isinstance(exc, MemoryError):
        return "out of host memory (reduce the model, seq_length or batch size)"
    if isinstance(exc, KeyboardInterrupt):
        return str(exc) or "interrupted"
    return _one_line(str(exc))


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line reason) of an expected failure; None for anything else."""
    for row in EXIT_TABLE:
        if isinstance(exc, row.errors):
            return row.code, _reason(exc)
    return None
