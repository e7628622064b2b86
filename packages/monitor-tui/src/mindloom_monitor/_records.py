"""Parse `metrics.jsonl` lines into records (plain Python: no Textual import).

The trainer writes one JSON object per line (docs/contracts.md, "Run directory"). A
reader must tolerate what a live, crash-prone writer and other tools produce: partial
lines, garbage, unknown fields, `null` for non-finite numbers and bare `NaN` /
`Infinity` tokens. Anything that is not a usable record is reported as `None` so the
caller can count it; nothing here raises on bad input.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from mindloom_monitor._moe import MOE_SCALARS, BadMoE, parse_moe

# Numeric fields the monitor plots or summarises; other numeric fields are kept in
# `Metric.fields` too (shown by --once), non-numeric unknown fields are ignored.
KNOWN_FIELDS = (
    "loss",
    "loss_smoothed",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "step_time_s",
    "tokens",
    "consumed_samples",
    "data_wait_frac",
    "mem_rss_mb",
    "skipped_steps",
    *MOE_SCALARS,
)
_MOE_KEYS = frozenset((*MOE_SCALARS, "moe_load", "moe_imbalance"))
# Per-rank and per-layer number lists (health panels); another list is ignored, and so is
# one of these that is not a list of numbers or null
LIST_FIELDS = (
    "comm_share_ranks",
    "comm_s_ranks",
    "mem_rss_mb_ranks",
    "mem_peak_mb_ranks",
    "mem_device_peak_mb_ranks",
    "samples_per_s_ranks",
    "max_logits",
    "grad_norm_layers",
    "param_norm_layers",
    "update_ratio_layers",
)
MAX_LIST = 4096


@dataclass(slots=True)
class Metric:
    """One logging step. `fields` maps a name to a float; non-finite values (JSON null,
    NaN, Infinity) are kept as float nan/inf so detectors can see them. A MoE run's
    lines also carry the expert-load table and per-layer imbalances (see _moe.py)."""

    step: int
    time: float | None
    fields: dict[str, float]
    moe_load: list[list[float]] | None = None
    moe_imbalance: list[float] | None = None
    lists: dict[str, list[float]] = field(default_factory=dict)  # LIST_FIELDS present


@dataclass(slots=True)
class Event:
    """An event line: start, eval, checkpoint, anomaly, end, or one we do not know."""

    kind: str
    time: float | None
    step: int | None
    data: dict = field(default_factory=dict)


Record = Metric | Event


def _number(value: object) -> float | None:
    """A JSON value as a float; None (JSON null) means non-finite, so it becomes nan.
    Returns None for values that are not numbers at all (strings, lists, booleans)."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:  # an int too large for a float
            return math.inf if value > 0 else -math.inf
    return None


def _step(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _time(value: object) -> float | None:
    t = _number(value)
    return t if t is not None and math.isfinite(t) else None


def parse_obj(obj: object) -> Record | None:
    """A decoded JSON value as a record, or None when it is not one."""
    if not isinstance(obj, dict):
        return None
    if "event" in obj:
        kind = obj["event"]
        if not isinstance(kind, str) or not kind:
            return None
        step = _step(obj.get("step")) if "step" in obj else None
        return Event(kind=kind, time=_time(obj.get("time")), step=step, data=obj)
    step = _step(obj.get("step"))
    if step is None:
        return None
    moe_load = moe_imbalance = None
    if not _MOE_KEYS.isdisjoint(obj):
        try:
            moe_load, moe_imbalance = parse_moe(obj)
        except BadMoE:  # a writer that gets these wrong is broken: the line is counted
            return None
    fields: dict[str, float] = {}
    for key, value in obj.items():
        if key in ("step", "time"):
            continue
        number = _number(value)
        if number is not None:
            fields[key] = number
    lists: dict[str, list[float]] = {}
    for key in LIST_FIELDS:
        value = obj.get(key)
        if isinstance(value, list) and 0 < len(value) <= MAX_LIST:
            numbers = [_number(v) for v in value]
            if all(n is not None for n in numbers):
                lists[key] = numbers
    return Metric(step, _time(obj.get("time")), fields, moe_load, moe_imbalance, lists)


def parse_line(line: bytes | str) -> Record | None:
    """One line of metrics.jsonl as a record; None for a malformed line.

    Blank lines are also None; callers that count skipped lines should test
    `line.strip()` first if blank lines should not count.
    """
    try:
        # json accepts NaN / Infinity / -Infinity tokens by default, as the contract needs.
        obj = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return parse_obj(obj)


@dataclass(slots=True)
class ParseResult:
    records: list[Record]
    skipped: int  # malformed lines
    parsed: int  # lines handed to the JSON parser


def parse_lines(lines) -> ParseResult:
    """Parse many lines; blank lines are ignored, malformed ones counted."""
    records: list[Record] = []
    skipped = 0
    parsed = 0
    for line in lines:
        if not line.strip():
            continue
        parsed += 1
        rec = parse_line(line)
        if rec is None:
            skipped += 1
        else:
            records.append(rec)
    return ParseResult(records, skipped, parsed)
