"""mindloom-monitor: opening a huge metrics.jsonl, and the monitor's idle CPU.

    ./dev hatch run monitor:python benchmarks/monitor_open.py [--lines 1000000] [--repeats 3]
        [--idle 30] [--settle 10] [--workdir DIR]

1. Writes a `metrics.jsonl` of `--lines` trainer-shaped lines (docs/contracts.md), about
   330 bytes each, plus start/eval/checkpoint events.
2. Open, interleaved A/B, medians of `--repeats` after a warm-up:
   A = what the app does before its first draw: `RunSource.initial()` (head, 2000
       sampled lines, 2 MiB tail) + `apply_batch` into a `RunData`;
   B = the peer, a naive reader: `json.loads` every line and keep the series
       (what a "parse the log and plot it" script does).
   Prints both times, the ratio B/A and how many lines each parsed.
   `--repeats 0` skips this part.
3. Idle CPU (`--idle S`, 0 to skip): runs the real `mindloom-monitor` on that file in a
   pseudo-terminal (`script`), waits `--settle` seconds for it to open and draw, then
   reads the process's utime+stime from /proc over S seconds while nothing is appended:
   CPU % of one core. Then the same on a small run whose lines are recent, so the
   header's elapsed time and ETA change every second.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mindloom_monitor import RunData, RunSource, apply_batch


def write_metrics(path: Path, n: int) -> None:
    t0 = 1_764_400_000.0
    with open(path, "w") as fh:
        fh.write(
            json.dumps({"event": "start", "time": t0, "run_name": "bench", "total_steps": 2 * n})
            + "\n"
        )
        buf = []
        for s in range(1, n + 1):
            rec = {
                "step": s,
                "time": t0 + 0.42 * s,
                "loss": 2.0 + 3.0 / (1 + s / 1000),
                "loss_smoothed": 2.0 + 3.0 / (1 + s / 1000),
                "lr": 3e-4,
                "grad_norm": 0.84,
                "tokens_per_s": 5120.0,
                "mfu": 0.012,
                "step_time_s": 0.42,
                "tokens": 4096 * s,
                "consumed_samples": 16 * s,
                "data_wait_frac": 0.01,
                "mem_rss_mb": 812.0,
                "skipped_steps": 0,
            }
            buf.append(json.dumps(rec))
            if s % 1000 == 0:
                buf.append(
                    json.dumps(
                        {
                            "event": "checkpoint",
                            "time": t0 + 0.42 * s,
                            "step": s,
                            "path": f"ck/step_{s:08d}",
                        }
                    )
                )
            if len(buf) >= 10_000:
                fh.write("\n".join(buf) + "\n")
                buf = []
        if buf:
            fh.write("\n".join(buf) + "\n")


def open_monitor(run_dir: Path) -> tuple[float, int]:
    t = time.perf_counter()
    src = RunSource(str(run_dir))
    data = RunData(str(run_dir))
    batch = src.initial()
    apply_batch(data, batch)
    src.close()
    assert data.last is not None
    return time.perf_counter() - t, data.parsed_lines


def open_naive(run_dir: Path) -> tuple[float, int]:
    t = time.perf_counter()
    steps, loss = [], []
    n = 0
    with open(run_dir / "metrics.jsonl", "rb") as fh:
        for line in fh:
            n += 1
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "step" in rec and "event" not in rec:
                steps.append(rec["step"])
                loss.append(rec.get("loss"))
    assert steps
    return time.perf_counter() - t, n


def idle_cpu(run_dir: Path, seconds: float, settle: float) -> float | None:
    exe = shutil.which("mindloom-monitor", path=os.path.dirname(sys.executable))
    if exe is None or shutil.which("script") is None:
        print("idle: needs the mindloom-monitor script and util-linux `script`; skipped")
        return None
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="160", LINES="48")
    proc = subprocess.Popen(
        ["script", "-qfc", f"exec {exe} {run_dir}", "/dev/null"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        time.sleep(settle)  # start-up and the first draw are not idle
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        pid = int(children[0])
        tick = os.sysconf("SC_CLK_TCK")

        def cpu() -> float:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick

        c0, t0 = cpu(), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu(), time.monotonic()
        return 100 * (c1 - c0) / (t1 - t0)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--idle", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="monitor-bench-"))
    run_dir = work / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        t = time.perf_counter()
        write_metrics(path, args.lines)
        print(
            f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t:.1f}s"
        )
    if args.repeats > 0:
        open_monitor(run_dir), open_naive(run_dir)  # warm the page cache and imports
        a_times, b_times = [], []
        for _ in range(args.repeats):
            a, a_lines = open_monitor(run_dir)
            b, b_lines = open_naive(run_dir)
            a_times.append(a)
            b_times.append(b)
        a_med, b_med = statistics.median(a_times), statistics.median(b_times)
        print(
            f"open, mindloom-monitor (head+samples+tail): median {a_med:.3f}s, {a_lines} lines parsed"
        )
        print(
            f"open, naive full parse (peer):               median {b_med:.3f}s, {b_lines} lines parsed"
        )
        print(f"ratio naive/monitor: {b_med / a_med:.1f}x")
    if args.idle > 0:
        pct = idle_cpu(run_dir, args.idle, args.settle)
        if pct is not None:
            print(f"idle CPU, 1M-line finished run, over {args.idle:.0f}s: {pct:.2f}% of one core")
        # A run that looks alive: its header (elapsed, ETA) changes every second.
        live = work / "live"
        live.mkdir(exist_ok=True)
        now = time.time()
        lines = [{"event": "start", "time": now - 300, "run_name": "live", "total_steps": 10_000}]
        lines += [
            {"step": s, "time": now - 300 + s, "loss": 3 - s / 300, "lr": 1e-3, "grad_norm": 1.0,
             "tokens_per_s": 5000.0, "mfu": 0.01, "tokens": 4096 * s}
            for s in range(1, 301)
        ]  # fmt: skip
        (live / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        pct = idle_cpu(live, args.idle, args.settle)
        if pct is not None:
            print(
                f"idle CPU, live-looking run (header ticking), over {args.idle:.0f}s: {pct:.2f}% of one core"
            )
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
