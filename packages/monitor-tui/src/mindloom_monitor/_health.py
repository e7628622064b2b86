"""The training-health view of a run (plain Python: no Textual import): the trainer's
`health` alerts with their advice, communication share and data wait, memory per rank,
and layer x step heat maps of the per-layer lists (local norms, MaxLogits).

The verdicts are the trainer's (`{"event": "health", "rule", "reason", "advice"}` lines,
rules in mindloom-train's `_health.py`); the monitor shows them and does not re-derive
them, so a rule has one definition."""

from __future__ import annotations

import math

from mindloom_monitor._stats import RunData, fmt_num

# per-layer lists with a heat map, and their titles
HEAT_KEYS = {
    "grad_norm_layers": "grad norm per layer",
    "param_norm_layers": "param norm per layer",
    "update_ratio_layers": "update/weight ratio per layer",
    "max_logits": "MaxLogits per layer",
}
SHADES = " .:-=+*#%@"  # low to high, on a log scale between the map's min and max


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else fmt_num(x)


def _latest(data: RunData, key: str) -> tuple[int, float] | None:
    values = data.series.get(key, [])
    for i in range(len(values) - 1, -1, -1):
        if not math.isnan(values[i]):
            return data.steps[i], values[i]
    return None


def _mean(data: RunData, key: str) -> float | None:
    values = [v for v in data.series.get(key, []) if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def heat_rows(data: RunData, key: str, width: int) -> list[str]:
    """One row per layer over the newest `width` records that carry `key`."""
    hist = list(data.layers.get(key, ()))[-max(width, 1) :]
    if not hist:
        return []
    n_layers = max(len(v) for _, v in hist)
    logs = [math.log10(x) for _, v in hist for x in v if math.isfinite(x) and x > 0]
    lo, hi = (min(logs), max(logs)) if logs else (0.0, 0.0)
    span = (hi - lo) or 1.0
    rows = [f"{HEAT_KEYS[key]} (steps {hist[0][0]}-{hist[-1][0]}; '{SHADES[1]}' "
            f"{fmt_num(10**lo)} .. '{SHADES[-1]}' {fmt_num(10**hi)}, log scale; '!' not finite)"]  # fmt: skip
    for layer in range(n_layers):
        cells = []
        for _, v in hist:
            x = v[layer] if layer < len(v) else math.nan
            if not math.isfinite(x):
                cells.append("!" if not math.isnan(x) or layer < len(v) else " ")
            elif x <= 0:
                cells.append(SHADES[0])
            else:
                idx = 1 + int((math.log10(x) - lo) / span * (len(SHADES) - 2) + 0.5)
                cells.append(SHADES[min(idx, len(SHADES) - 1)])
        rows.append(f"  L{layer:<3}|{''.join(cells)}|")
    return rows


def health_lines(data: RunData, width: int = 60, alerts: int = 10) -> list[str]:
    """The health block of `--once` and of the monitor's Health pane; empty for a run
    whose records carry none of it (an older trainer)."""
    if not data.has_health:
        return []
    out = [f"health alerts ({len(data.alerts)}, last {min(alerts, len(data.alerts))}):"]
    for ev in data.alerts[-alerts:]:
        where = f"step {ev.step}" if ev.step is not None else "-"
        out.append(f"  {where:>10}  {ev.kind}: {ev.text}")
    if not data.alerts:
        out.append("  (none)")
    comm = _latest(data, "comm_share")
    if comm is not None:
        line = f"communication share of the step (step {comm[0]}): {_pct(comm[1])}"
        ranks = data.ranks.get("comm_share_ranks")
        if ranks is not None and len(ranks[1]) > 1:
            line += "  per rank: " + " ".join(f"r{i} {_pct(v)}" for i, v in enumerate(ranks[1]))
        out.append(line)
    wait = _latest(data, "data_wait_frac")
    if wait is not None:
        mean = _mean(data, "data_wait_frac")
        out.append(f"data wait (step {wait[0]}): {_pct(wait[1])}  run mean {_pct(mean or 0.0)}")
    ranks = data.ranks.get("mem_rss_mb_ranks")
    if ranks is not None:
        per = " ".join(f"r{i} {fmt_num(v, 5)}" for i, v in enumerate(ranks[1]))
        out.append(f"memory RSS MiB per rank (step {ranks[0]}): {per}")
    else:
        mem = _latest(data, "mem_rss_mb")
        if mem is not None:
            out.append(f"memory RSS (step {mem[0]}): rank 0 {fmt_num(mem[1], 5)} MiB")
    for key, title in (("mem_peak_mb_ranks", "peak memory RSS MiB per rank"),
                       ("mem_device_peak_mb_ranks", "device memory peak MiB per rank"),
                       ("samples_per_s_ranks", "samples/s per rank")):  # fmt: skip
        ranks = data.ranks.get(key)
        if ranks is not None:
            per = " ".join(f"r{i} {fmt_num(v, 5)}" for i, v in enumerate(ranks[1]))
            out.append(f"{title} (step {ranks[0]}): {per}")
    top = _latest(data, "max_logit")
    if top is not None:
        line = f"max attention logit (step {top[0]}): {fmt_num(top[1])}"
        frac = _latest(data, "logits_over_bound_frac")
        if frac is not None:
            line += f"  tokens over the output-logit bound: {_pct(frac[1])}"
        out.append(line)
    for key in HEAT_KEYS:
        out.extend(heat_rows(data, key, width))
    return out
