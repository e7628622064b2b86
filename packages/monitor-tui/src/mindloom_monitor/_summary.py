"""The plain-text summary printed by `mindloom-monitor --once` (no Textual import)."""

from __future__ import annotations

import math

from mindloom_monitor._health import health_lines
from mindloom_monitor._stats import RunData, fmt_count, fmt_duration, fmt_num


def text_plot(xs: list, ys: list, width: int = 60, height: int = 8) -> list[str]:
    """A small ASCII line plot with a labelled y axis; plain characters only so it
    survives `watch`, logs and e-mail."""
    if not ys:
        return ["  (no data)"]
    lo, hi = min(ys), max(ys)
    if hi == lo:
        hi = lo + (abs(lo) * 0.01 or 1.0)
    x0, x1 = xs[0], xs[-1]
    span = (x1 - x0) or 1
    # Each column spans the min..max of its points, joined to the previous column so the
    # curve reads as a line rather than scattered dots.
    cols: dict[int, list[float]] = {}
    for x, y in zip(xs, ys):
        cols.setdefault(min(width - 1, int((x - x0) / span * (width - 1) + 0.5)), []).append(y)
    grid = [[" "] * width for _ in range(height)]

    def row(y: float) -> int:
        return min(height - 1, int((hi - y) / (hi - lo) * (height - 1) + 0.5))

    prev = None
    for col in sorted(cols):
        vals = cols[col]
        r_lo, r_hi = row(max(vals)), row(min(vals))
        if prev is not None:
            r_lo, r_hi = min(r_lo, prev), max(r_hi, prev)
        for r in range(r_lo, r_hi + 1):
            grid[r][col] = "*"
        prev = row(vals[-1])
    labels = [fmt_num(hi), fmt_num((hi + lo) / 2), fmt_num(lo)]
    lab_w = max(len(s) for s in labels)
    out = []
    for r, row in enumerate(grid):
        label = (
            labels[0]
            if r == 0
            else labels[2]
            if r == height - 1
            else labels[1]
            if r == height // 2
            else ""
        )
        out.append(f"{label:>{lab_w}} |{''.join(row)}")
    out.append(" " * lab_w + " +" + "-" * width)
    left, right = f"step {x0}", f"step {x1}"
    out.append(" " * (lab_w + 2) + left + right.rjust(width - len(left)))
    return out


def _latest(data: RunData, key: str) -> tuple[int, float] | None:
    """(step, value) of `key` on the newest line that has it: the last line's own value
    (a null there is news), else the newest finite point of its series."""
    if data.last is not None and key in data.last.fields:
        return data.last.step, data.last.fields[key]
    values = data.series.get(key, [])
    for i in range(len(values) - 1, -1, -1):
        if not math.isnan(values[i]):
            return data.steps[i], values[i]
    return None


def moe_summary(data: RunData) -> list[str]:
    """The MoE lines of --once: imbalance overall and per layer, dead experts, bias norm,
    the newest MTP (and balance) loss. Nothing for a run without MoE fields."""
    if not data.has_moe:
        return []
    out = []
    if data.moe_imbalance is not None:
        overall = _latest(data, "moe_imbalance_overall")
        head = f"moe (step {data.moe_step}): imbalance max/mean overall "
        head += fmt_num(overall[1]) if overall else "-"
        last = data.last.fields if data.last is not None else {}
        if data.last is not None and data.last.step == data.moe_step:
            for key, label in (
                ("moe_dead_experts", "dead experts"),
                ("moe_bias_norm", "bias norm"),
            ):
                if key in last:
                    head += f"  {label} {fmt_num(last[key])}"
        out.append(head)
        per = "  ".join(
            f"L{i} {v:.3f}" if math.isfinite(v) else f"L{i} {fmt_num(v)}"
            for i, v in enumerate(data.moe_imbalance)
        )
        out.append(f"  per layer: {per}")
    for key, label in (("mtp_loss", "MTP loss"), ("balance_loss", "balance loss")):
        latest = _latest(data, key)
        if latest is not None:
            out.append(f"{label} (step {latest[0]}): {fmt_num(latest[1])}")
    return out


def summary(data: RunData, now: float, events: int = 10) -> str:
    lines = [f"run: {data.name}  ({data.run_dir})"]
    status = data.status()
    if data.last is None:
        lines.append(
            f"status: {status}; no metrics yet"
            + ("" if data.metrics_exists else " (metrics.jsonl not found)")
        )
        lines.append(f"skipped lines: {data.skipped_lines}")
        return "\n".join(lines) + "\n"
    step = data.last.step
    total = data.total_steps
    of = f"{step}/{total} ({100 * step / total:.1f}%)" if total else f"{step}"
    lines.append(
        f"status: {status}  step {of}  elapsed {fmt_duration(data.elapsed(now))}  ETA {fmt_duration(data.eta())}"
    )
    ckpt = data.last_checkpoint
    ckpt_text = f"step {ckpt[0]} {ckpt[1]}".rstrip() if ckpt else "-"
    lines.append(f"tokens seen: {fmt_count(data.tokens)}  last checkpoint: {ckpt_text}")
    lines.append(f"skipped lines: {data.skipped_lines}")
    f = data.last.fields
    parts = [
        f"{k} {fmt_num(f[k])}"
        for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s")
        if k in f
    ]
    smoothed = data.smoothed[-1] if data.smoothed else math.nan
    parts.insert(1 if "loss" in f else 0, f"smoothed {fmt_num(smoothed)}")
    lines.append(f"last metrics (step {step}): " + "  ".join(parts))
    lines.extend(moe_summary(data))
    lines.extend(health_lines(data))
    if data.evals:
        s, loss, ppl = data.evals[-1]
        lines.append(f"last eval (step {s}): loss {fmt_num(loss)}  ppl {fmt_num(ppl)}")
    shown = data.events[-events:]
    lines.append(f"events ({len(data.events)}, last {len(shown)}):")
    for ev in shown:
        where = f"step {ev.step}" if ev.step is not None else "-"
        lines.append(f"  [{ev.level:5}] {where:>12}  {ev.kind}: {ev.text}")
    if not shown:
        lines.append("  (none)")
    xs, ys = data.view("smoothed")
    lines.append("loss (smoothed):")
    lines.extend("  " + ln for ln in text_plot(xs, ys))
    return "\n".join(lines) + "\n"
