"""RUN_DIR/metrics.jsonl, RUN_DIR/train.log and the console progress line.

Each metrics record is serialised first and then written with ONE write() and flushed, so
a reader tailing the file can only ever see a partial line at the very end. Non-finite
numbers are written as JSON null.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any, TextIO

# Dense peak FLOP/s per device for MFU (bf16/fp16 tensor units unless noted); override
# with monitor.peak_tflops. "CPU" is measured at start-up (fp32 matmul), see measure_cpu_peak.
PEAK_TFLOPS = {
    "Ascend910A": 256.0,
    "Ascend910B": 313.0,
    "Ascend910B1": 414.0,
    "Ascend910B2": 376.0,
    "Ascend910B3": 313.0,
    "Ascend910B4": 280.0,
    "A100": 312.0,
    "H100": 989.0,
    "H200": 989.0,
    "V100": 125.0,
    "L40S": 362.0,
}


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class RunFileError(OSError):
    """A file the run appends to is not a regular file of its own (one line)."""


def open_run_file(path: Path) -> TextIO:
    """Open `path` for appending, mode 0o640, never through a symlink (O_NOFOLLOW: a link
    planted as metrics.jsonl or train.log would have its target appended to and chmodded)
    and never a FIFO or device (O_NONBLOCK, so a FIFO cannot hang the open)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o640)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise RunFileError(f"{path}: is a symlink; refusing to write through it") from None
        if exc.errno == errno.ENXIO:
            raise RunFileError(f"{path}: is a FIFO or socket, not a regular file") from None
        raise RunFileError(f"{path}: cannot open for writing: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunFileError(f"{path}: is not a regular file; refusing to write to it")
    os.set_blocking(fd, True)
    os.fchmod(fd, 0o640)
    return open(fd, "a", encoding="utf-8")  # noqa: SIM115 (held for the run)


class MetricsWriter:
    """Appends records to metrics.jsonl; a no-op writer on ranks other than 0."""

    def __init__(self, path: Path | None):
        self.path = path
        self._f: TextIO | None = None
        self.health: Any = None  # a _health.HealthMonitor: sees each record, adds its events
        self.numerics: Any = None  # a _step.NumericsFields: per-layer fields of step records
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open_run_file(path)

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            return
        after: list[dict[str, Any]] = []
        if self.numerics is not None and "event" not in record:
            record = {**record, **self.numerics.fields()}
        if self.health is not None and record.get("event") != "health":
            record, after = self.health.observe(record)
        record = {"time": time.time(), **record}
        line = json.dumps(_clean(record), allow_nan=False, separators=(", ", ": ")) + "\n"
        data = line.encode("utf-8")
        self._f.flush()  # nothing is buffered (every record goes through os.write)
        fd = self._f.fileno()
        end = os.lseek(fd, 0, os.SEEK_END)
        try:  # ONE write() per record; a short one (a full disk) is undone, not left
            n = os.write(fd, data)
            if n != len(data):
                why = f"{os.strerror(errno.ENOSPC)} (short write, {n} of {len(data)} bytes)"
                raise OSError(errno.ENOSPC, why)
        except OSError as exc:
            try:
                os.ftruncate(fd, end)  # no partial last line
            except OSError:
                pass
            raise OSError(exc.errno, exc.strerror or str(exc), str(self.path)) from None
        for ev in after:
            self.write(ev)

    def event(self, name: str, **fields: Any) -> None:
        self.write({"event": name, **fields})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class RunLog:
    """train.log (plain text) plus the console; rank 0 only writes the file."""

    def __init__(self, path: Path | None, console: TextIO | None = None, rank: int = 0):
        self.rank = rank
        self.console = console if console is not None else sys.stderr
        self._f = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open_run_file(path)
        self._progress_open = False
        self.tty = bool(getattr(self.console, "isatty", lambda: False)())

    def __call__(self, msg: str) -> None:
        self.info(msg)

    def info(self, msg: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        prefix = f"[rank {self.rank}] " if self.rank else ""
        line = f"{stamp} {prefix}{msg}"
        if self._f is not None:
            self._f.write(line + "\n")
            self._f.flush()
        self._end_progress()
        print(f"{prefix}{msg}", file=self.console, flush=True)

    def progress(self, text: str, console: bool = True) -> None:
        """A progress line: redrawn in place on a terminal, logged plainly otherwise."""
        if not console:
            pass
        elif self.tty:
            print("\r\033[K" + text, end="", file=self.console, flush=True)
            self._progress_open = True
        else:
            print(text, file=self.console, flush=True)
        if self._f is not None:
            self._f.write(time.strftime("%Y-%m-%d %H:%M:%S ") + text + "\n")
            self._f.flush()

    def _end_progress(self) -> None:
        if self._progress_open:
            print(file=self.console, flush=True)
            self._progress_open = False

    def close(self) -> None:
        self._end_progress()
        if self._f is not None:
            self._f.close()
            self._f = None


def progress_text(rec: dict[str, Any], total: int, width: int = 20) -> str:
    step = rec["step"]
    filled = int(width * min(step, total) / max(total, 1))
    bar = "#" * filled + "." * (width - filled)

    def f(key: str, fmt: str) -> str:
        v = rec.get(key)
        return "  nan" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt % v

    mfu = rec.get("mfu")
    parts = [
        f"[{bar}] {step}/{total}",
        "loss " + f("loss", "%.4f"),
        "(avg " + f("loss_smoothed", "%.4f") + ")",
        "lr " + f("lr", "%.2e"),
        "gnorm " + f("grad_norm", "%.3f"),
        "tok/s " + f("tokens_per_s", "%.0f"),
        "mfu " + ("n/a" if mfu is None else f"{100 * mfu:.2f}%"),
        "step " + f("step_time_s", "%.3fs"),
        "wait " + f("data_wait_frac", "%.1f%%" if False else "%.3f"),
        "rss " + f("mem_rss_mb", "%.0fMB"),
    ]
    if rec.get("skipped_steps"):
        parts.append(f"skipped {rec['skipped_steps']}")
    return " ".join(parts)


def _status_mib(field: str) -> float:
    """A kB field of /proc/self/status in MiB; ru_maxrss where /proc is not there."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def mem_rss_mb() -> float:
    return _status_mib("VmRSS:")


def peak_rss_mb() -> float:
    """This process's peak resident set (the kernel's high-water mark), MiB.

    VmHWM belongs to this process's own address space. ru_maxrss does not: Linux carries
    it over exec from the process that spawned us, so a run started by a big parent (a
    test session of 2.4 GB) would report the parent's peak. The kernel updates VmHWM
    lazily (a reading after the RSS dropped can be below an earlier reading, seen: 0.2
    MiB), so this is the highest reading of this process so far, never lower."""
    _PEAK_SEEN[0] = max(_PEAK_SEEN[0], _status_mib("VmHWM:"), _status_mib("VmRSS:"))
    return _PEAK_SEEN[0]


_PEAK_SEEN = [0.0]  # MiB: the highest peak_rss_mb reading of this process


def measure_cpu_peak_flops(seconds: float = 0.3) -> float:
    """fp32 GEMM throughput of this process with numpy's BLAS (the CPU 'peak')."""
    import numpy as np

    n = 512
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.copy()
    a @ b  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        dt = time.perf_counter() - t0
        best = max(best, 2 * n**3 / max(dt, 1e-9))
    return best


def peak_flops(device_target: str, override_tflops: float | None) -> tuple[float, str]:
    """(peak FLOP/s, where it came from)."""
    if override_tflops:
        return override_tflops * 1e12, "monitor.peak_tflops"
    if device_target == "CPU":
        return measure_cpu_peak_flops(), "measured fp32 GEMM (numpy)"
    name = os.environ.get(
        "MINDLOOM_DEVICE_NAME", "Ascend910B" if device_target == "Ascend" else "A100"
    )
    for key, tf in PEAK_TFLOPS.items():
        if name.startswith(key):
            return tf * 1e12, f"peak table ({key})"
    return PEAK_TFLOPS["A100"] * 1e12, "peak table (A100, default)"
