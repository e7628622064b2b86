"""Number, count and duration formats and plot downsampling of the monitor (split from
`_stats`; plain Python)."""

from __future__ import annotations

import math


def fmt_num(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Inf" if x > 0 else "-Inf"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
        return f"{x:.2e}"
    return f"{x:.{digits}g}"


def fmt_count(x: float | None) -> str:
    """4920000 -> '4.92M'."""
    if x is None or not math.isfinite(x):
        return "-"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    return f"{h}:{m:02d}:{s:02d}"


def downsample(xs: list, ys: list, buckets: int) -> tuple[list, list]:
    """Min/max per bucket, in x order: keeps spikes that plain striding would drop."""
    n = len(xs)
    if n <= 2 * buckets or buckets <= 0:
        return list(xs), list(ys)
    out_x: list = []
    out_y: list = []
    size = n / buckets
    for b in range(buckets):
        lo, hi = int(b * size), int((b + 1) * size)
        if hi <= lo:
            continue
        seg = ys[lo:hi]
        i_min = min(range(len(seg)), key=seg.__getitem__)
        i_max = max(range(len(seg)), key=seg.__getitem__)
        for i in sorted({i_min, i_max}):
            out_x.append(xs[lo + i])
            out_y.append(seg[i])
    return out_x, out_y


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
