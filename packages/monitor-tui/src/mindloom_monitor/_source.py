"""Read one run directory into batches of parsed records (plain Python: no Textual).

A `RunSource` is driven by the watcher thread: `initial()` once, then `poll()` at the
watcher's pace. Each call returns one `Batch` (or None when nothing changed), so many
new lines become one message to the UI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mindloom_monitor._records import Record, parse_lines
from mindloom_monitor._tail import Follower, read_initial, read_last_lines

METRICS = "metrics.jsonl"
LOG = "train.log"
CONFIG = "config.yaml"
LOG_LINES = 500  # lines of train.log shown on open


@dataclass
class Batch:
    records: list[Record] = field(default_factory=list)
    sampled: list[Record] = field(default_factory=list)  # from sampling a huge file (initial only)
    skipped: int = 0
    parsed: int = 0
    notes: list[str] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    log_reset: bool = False  # train.log was truncated or replaced: clear the view
    metrics_exists: bool = False
    initial: bool = False

    def __bool__(self) -> bool:
        return bool(
            self.records
            or self.skipped
            or self.notes
            or self.log_lines
            or self.log_reset
            or self.initial
        )


def _text(lines: list[bytes]) -> list[str]:
    return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]


class RunSource:
    def __init__(self, run_dir: str, *, tail_bytes: int = 2 << 20, samples: int = 2000) -> None:
        self.run_dir = run_dir
        self.metrics_path = os.path.join(run_dir, METRICS)
        self.log_path = os.path.join(run_dir, LOG)
        self.tail_bytes = tail_bytes
        self.samples = samples
        self._metrics = Follower(self.metrics_path)
        self._log = Follower(self.log_path)
        self.metrics_exists = False
        self.pending = b""  # incomplete last line seen on open

    def initial(self) -> Batch:
        init = read_initial(self.metrics_path, tail_bytes=self.tail_bytes, samples=self.samples)
        batch = Batch(initial=True, metrics_exists=init.exists)
        if init.exists:
            self.metrics_exists = True
            # Continue at the start of an incomplete last line: it is re-read when complete.
            self._metrics.attach(init.end_pos, ident=init.ident)
            self.pending = init.partial
            head = parse_lines(init.head)
            sampled = parse_lines(init.sampled)
            tail = parse_lines(init.tail)
            # Head lines (the start event) come first, then the sampled middle, then the tail.
            batch.sampled = head.records + sampled.records
            batch.records = tail.records
            batch.skipped = head.skipped + sampled.skipped + tail.skipped
            batch.parsed = head.parsed + sampled.parsed + tail.parsed
        log = read_last_lines(self.log_path, LOG_LINES)
        if log.exists:
            self._log.attach(log.end_pos, ident=log.ident)
            batch.log_lines = _text(log.tail)
        return batch

    def poll(self) -> Batch | None:
        batch = Batch()
        chunk = self._metrics.poll()
        if chunk.lines:
            res = parse_lines(chunk.lines)
            batch.records, batch.skipped, batch.parsed = res.records, res.skipped, res.parsed
        batch.skipped += chunk.dropped
        for note in chunk.notes:
            if note == "appeared":
                self.metrics_exists = True
                batch.metrics_exists = True
            else:
                batch.notes.append(f"{METRICS} {note}; reading it from the start")
        batch.metrics_exists = self.metrics_exists
        log = self._log.poll()
        if any(n in ("truncated", "replaced") for n in log.notes):
            batch.log_reset = True
        batch.log_lines = _text(log.lines)
        return batch if batch else None

    def close(self) -> None:
        self._metrics.close()
        self._log.close()


def load_run(run_dir: str, data) -> Batch:
    """Read a run once into `data` (a RunData): what --once and tests use."""
    src = RunSource(run_dir)
    batch = src.initial()
    src.close()
    apply_batch(data, batch)
    # A partial last line will never complete in a one-shot read: count it as skipped.
    if src.pending.strip():
        data.add_skipped(1)
    return batch


def apply_batch(data, batch: Batch) -> None:
    """Feed a batch into a RunData (done on the UI thread in the app)."""
    if batch.metrics_exists:
        data.metrics_exists = True
    for note in batch.notes:
        data.note("file", note)
    if batch.sampled:
        data.add_all(batch.sampled, detect=False)
        data.sampled_records += len(batch.sampled)
    data.add_all(batch.records)
    data.add_skipped(batch.skipped)
    data.parsed_lines += batch.parsed
    if batch.initial:
        data.version += 1
