"""Mixture-of-experts fields of a metric line and the expert-load heat map (plain Python:
no Textual import).

A DeepSeek-V3 run adds to each metric line (docs/contracts.md, "Run directory"):
`mtp_loss`, `balance_loss` (when on), `moe_load` (per MoE layer, per routed expert: the
fraction of routed token-slots in the log window; each row sums to 1), `moe_imbalance`
(per layer, max/mean of its row), `moe_imbalance_overall` (max/mean of the load summed
over layers), `moe_dead_experts` (int) and `moe_bias_norm`.
"""

from __future__ import annotations

import math

# scalar MoE fields: a number or null (non-finite); any other type makes the line bad
MOE_SCALARS = (
    "mtp_loss",
    "balance_loss",
    "moe_imbalance_overall",
    "moe_dead_experts",
    "moe_bias_norm",
)
MAX_LAYERS = 4096  # a bigger "load" table is not a real run's: the line is bad
MAX_EXPERTS = 65536

# Heat-map shades by relative load r = load * E (1.0 = an even share): one character per
# cell, distinct without colour, coloured where the terminal can.
SHADES = (
    ("x", "bold red", "no token"),
    ("░", "blue", "< 0.5x"),
    ("▒", "cyan", "0.5-1x"),
    ("▓", "yellow", "1-2x"),
    ("█", "bold red", ">= 2x"),
)
BOUNDS = (0.5, 1.0, 2.0)  # the upper ends of the shades after "no token"


class BadMoE(ValueError):
    """A MoE field of the wrong shape or type; the line is counted as skipped."""


def _num(value: object, key: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadMoE(f"{key}: not a number")
    try:
        return float(value)
    except OverflowError:
        raise BadMoE(f"{key}: out of range") from None


def parse_moe(obj: dict) -> tuple[list[list[float]] | None, list[float] | None]:
    """(moe_load, moe_imbalance) of a metric line, None where absent. Raises BadMoE on a
    malformed MoE field: a load table that is not a non-empty list of equal-length,
    non-empty rows of finite non-negative numbers; per-layer imbalances that are not a
    list of numbers, or not one per load row; a scalar MoE field that is not a number."""
    for key in MOE_SCALARS:
        if key in obj:
            _num(obj[key], key)
    load = None
    raw = obj.get("moe_load")
    if raw is not None or "moe_load" in obj:
        if not isinstance(raw, list) or not raw or len(raw) > MAX_LAYERS:
            raise BadMoE("moe_load: not a non-empty list of rows")
        load = []
        for row in raw:
            if not isinstance(row, list) or not row or len(row) > MAX_EXPERTS:
                raise BadMoE("moe_load: a row is not a non-empty list")
            vals = [_num(v, "moe_load") for v in row]
            if not all(math.isfinite(v) and v >= 0 for v in vals):
                raise BadMoE("moe_load: a load is negative or non-finite")
            load.append(vals)
        if len({len(r) for r in load}) != 1:
            raise BadMoE("moe_load: rows of different lengths")
    imb = None
    raw = obj.get("moe_imbalance")
    if raw is not None or "moe_imbalance" in obj:
        if not isinstance(raw, list) or not raw or len(raw) > MAX_LAYERS:
            raise BadMoE("moe_imbalance: not a non-empty list")
        imb = [_num(v, "moe_imbalance") for v in raw]
        if load is not None and len(imb) != len(load):
            raise BadMoE("moe_imbalance: not one per moe_load row")
    return load, imb


def imbalance(row: list[float]) -> float:
    """max/mean of one row of loads (nan for a row with no load at all)."""
    total = sum(row)
    return max(row) * len(row) / total if total > 0 else math.nan


def overall_imbalance(load: list[list[float]]) -> float:
    """max/mean of the load summed over layers."""
    return imbalance([sum(col) for col in zip(*load, strict=True)])


def shade(relative: float) -> int:
    """Index into SHADES of a relative load (load * E)."""
    if relative <= 0:
        return 0
    for i, bound in enumerate(BOUNDS):
        if relative < bound:
            return i + 1
    return len(SHADES) - 1


def heat_cells(load: list[list[float]], max_cols: int) -> tuple[list[list[int]], int]:
    """Shade indices per layer and cell, and how many adjacent experts one cell shows.

    With more experts than `max_cols` each cell shows `group` neighbours: its shade is
    their mean relative load, and "no token" only when none of them got one."""
    n_exp = len(load[0])
    group = max(1, math.ceil(n_exp / max(1, max_cols)))
    rows = []
    for row in load:
        total = sum(row)
        cells = []
        for lo in range(0, n_exp, group):
            part = row[lo : lo + group]
            # relative to the row's own total, so a row that does not sum to exactly 1
            # (rounding in the writer) is still shaded by its shares
            rel = (sum(part) / len(part)) * n_exp / total if total > 0 else 0.0
            cells.append(shade(rel) if rel > 0 else 0)
        rows.append(cells)
    return rows, group
