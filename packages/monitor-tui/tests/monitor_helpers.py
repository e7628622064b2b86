"""Deterministic run directories for the monitor tests (fixed data, fixed clock)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

T0 = 1_764_400_000.0  # fixed epoch for every synthetic run


def metric(step: int, **over) -> dict:
    """One metric line shaped like the trainer's (docs/contracts.md)."""
    loss = 4.0 * math.exp(-step / 150) + 2.0 + 0.03 * math.sin(step)
    rec = {
        "step": step,
        "time": T0 + 0.5 * step,
        "loss": round(loss, 4),
        "loss_smoothed": round(loss, 4),
        "lr": 1e-3 * min(1.0, step / 20),
        "grad_norm": round(0.8 + 0.1 * math.cos(step / 7), 4),
        "tokens_per_s": 5000.0 + 50 * math.sin(step / 5),
        "mfu": 0.012,
        "step_time_s": 0.5,
        "tokens": 4096 * step,
        "consumed_samples": 16 * step,
        "data_wait_frac": 0.01,
        "mem_rss_mb": 812.0,
        "skipped_steps": 0,
    }
    rec.update(over)
    return rec


def write_run(
    run_dir: Path,
    steps: int = 300,
    *,
    total: int = 1000,
    name: str = "tiny",
    extra: list | None = None,
    log: bool = True,
    config: bool = True,
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        {
            "event": "start",
            "time": T0,
            "run_name": name,
            "total_steps": total,
            "seed": 1,
            "config_hash": "abc",
            "versions": {"mindloom-train": "0.1.0"},
            "world_size": 1,
        }
    ]
    for s in range(1, steps + 1):
        lines.append(metric(s))
        if s % 100 == 0:
            lines.append(
                {"event": "eval", "time": T0 + 0.5 * s, "step": s, "loss": 2.4, "ppl": 11.0}
            )
            lines.append(
                {
                    "event": "checkpoint",
                    "time": T0 + 0.5 * s,
                    "step": s,
                    "path": f"checkpoints/step_{s:08d}",
                }
            )
    lines.extend(extra or [])
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for rec in lines:
            fh.write((rec if isinstance(rec, str) else json.dumps(rec)) + "\n")
    if log:
        (run_dir / "train.log").write_text(
            "".join(
                f"step {s:5d} | loss {metric(s)['loss']:.4f}\n"
                for s in range(max(1, steps - 40), steps + 1)
            )
        )
    if config:
        (run_dir / "config.yaml").write_text(
            "model:\n  preset: debug\n  hidden_size: 64\ntraining:\n  train_steps: 1000\n  seed: 1\nrun_dir: runs/tiny\n"
        )
    return run_dir


def fixed_clock(steps: int = 300):
    return lambda: T0 + 0.5 * steps + 3.0


def screen_text(app) -> str:
    """The characters on the app's screen right now, one line per terminal row (what
    `App.export_screenshot` renders, exported as text instead of SVG)."""
    from rich.console import Console

    width, height = app.size
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        record=True,
        legacy_windows=False,
        safe_box=False,
    )
    console.print(
        app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
    )
    return console.export_text()


async def wait_for(pilot, cond, timeout: float = 60.0) -> bool:
    """Let the app run until `cond()` holds; False after `timeout` seconds (a deadline
    for a hung app only: a loaded machine must not turn a slow render into a failure)."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await pilot.pause(0.05)
    return cond()


def append(path: Path, *records) -> None:
    with open(path, "a") as fh:
        for rec in records:
            fh.write((rec if isinstance(rec, str) else json.dumps(rec)) + "\n")


def moe_fields(step: int, layers: int = 5, experts: int = 16, seed: int = 7) -> dict:
    """The MoE fields a DeepSeek-V3 run adds to a metric line, shaped like the trainer's:
    loads that start skewed (expert 3 of layer 0 gets no token before step 50) and even
    out as the balancing bias works; imbalances are max/mean as the trainer defines them."""
    import random

    rng = random.Random(seed * 100_003 + step)
    skew = 2.0 * math.exp(-step / 80)
    load = []
    for layer in range(layers):
        raw = [math.exp(skew * rng.gauss(0, 1)) for _ in range(experts)]
        if layer == 0 and step < 50:
            raw[3] = 0.0
        total = sum(raw)
        load.append([round(x / total, 6) for x in raw])
    sums = [sum(col) for col in zip(*load)]
    return {
        "mtp_loss": round(4.3 * math.exp(-step / 150) + 2.2, 4),
        "moe_load": load,
        "moe_imbalance": [max(r) / (sum(r) / len(r)) for r in load],
        "moe_imbalance_overall": max(sums) / (sum(sums) / len(sums)),
        "moe_dead_experts": sum(1 for r in load for x in r if x == 0),
        "moe_bias_norm": round(0.001 * step**0.5, 6),
    }


def write_moe_run(run_dir: Path, steps: int = 120, **kw) -> Path:
    """A DeepSeek-V3 run: every metric line carries the MoE fields."""
    write_run(run_dir, 0, **kw)
    append(run_dir / "metrics.jsonl", *(metric(s, **moe_fields(s)) for s in range(1, steps + 1)))
    return run_dir
