"""The state of one run and everything derived from it (plain Python: no Textual import).

`RunData` takes records in file order and keeps the plotted series, an EMA of the loss,
eval points, the header facts (step of total, elapsed, ETA, tokens, last checkpoint) and
an events list that merges the trainer's event lines with what the detectors here find:
non-finite values, loss and gradient-norm spikes, skipped steps, throughput drops and a
run that stopped reporting. All of it is incremental, O(1) amortised per record.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass

from mindloom_monitor._fmt import _finite, downsample, fmt_count, fmt_duration, fmt_num  # noqa: F401 (imported from here)
from mindloom_monitor._moe import imbalance, overall_imbalance
from mindloom_monitor._records import Event, Metric, Record
from mindloom_monitor._runevents import (
    MAX_ALERTS,  # noqa: F401 (imported from here)
    EventEntry,
    RunEvents,
)

MAX_EVENTS = 20_000  # per run; the oldest half is dropped beyond this
# Series kept per run, in plotting order.
SERIES = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mtp_loss", "moe_imbalance_overall",
          "comm_share", "data_wait_frac", "mem_rss_mb", "max_logit",
          "logits_over_bound_frac")  # fmt: skip
HEAT_STEPS = 400  # per-layer lists kept per run (the layer x step heat maps)


@dataclass(slots=True)
class Settings:
    smoothing: float = 0.9  # EMA weight of the past (TensorBoard-like, bias-corrected)
    stall_after_s: float = 300.0  # no new record for this long while running -> event
    spike_window: int = 50  # records the spike detectors look back over
    spike_sigmas: float = 4.0  # loss above mean + k*std of the window is a spike
    grad_spike_factor: float = 5.0  # grad norm above k * window median is a spike
    drop_frac: float = 0.3  # tokens/s below (1 - f) * recent median is a drop
    max_points: int = 40_000  # per series; older points are thinned beyond this


class RunData(RunEvents):
    """Everything the monitor knows about one run directory."""

    def __init__(self, run_dir: str, settings: Settings | None = None) -> None:
        self.run_dir = run_dir
        self.settings = settings or Settings()
        self.name = os.path.basename(os.path.normpath(run_dir)) or run_dir
        self.steps: list[int] = []
        self.times: list[float] = []
        self.series: dict[str, list[float]] = {k: [] for k in SERIES}
        self.smoothed: list[float] = []
        self.evals: list[tuple[int, float, float]] = []  # step, loss, ppl
        self.events: list[EventEntry] = []
        self.skipped_lines = 0
        self.parsed_lines = 0
        self.sampled_records = 0  # records that came from sampling a huge file
        self.total_steps: int | None = None
        self.start_time: float | None = None
        self.end: Event | None = None
        self.last: Metric | None = None
        self.last_checkpoint: tuple[int | None, str] | None = None
        self.last_report: float | None = None  # `time` of the newest line
        self.metrics_exists = False
        self.version = 0  # bumped on every change, so views redraw only when needed
        self._ema = 0.0
        self._ema_n = 0
        self._seen: set[tuple[str, int | None]] = set()
        self._loss_win: deque[float] = deque(maxlen=self.settings.spike_window)
        self._grad_win: deque[float] = deque(maxlen=self.settings.spike_window)
        self._tps_win: deque[float] = deque(maxlen=20)
        self._tps_dropped = False
        self._skipped_steps = 0
        self._stalled = False
        self._tokens: float | None = None
        # MoE runs (DeepSeek-V3): the newest expert-load table and per-layer imbalances
        self.has_moe = False
        self.moe_load: list[list[float]] | None = None
        self.moe_imbalance: list[float] | None = None
        self.moe_step: int | None = None
        # training health (issue 18): the trainer's `health` events, and the per-rank and
        # per-layer lists of the newest records (_records.LIST_FIELDS)
        self.has_health = False
        self.trainer_health = False  # its start event says the trainer judges spikes itself
        self.alerts: list[EventEntry] = []
        self.ranks: dict[str, tuple[int, list[float]]] = {}
        self.layers: dict[str, deque[tuple[int, list[float]]]] = {}

    # --- feeding -------------------------------------------------------------------
    def add_skipped(self, n: int) -> None:
        if n:
            self.skipped_lines += n
            self.version += 1

    def note(self, kind: str, text: str, level: str = "warn") -> None:
        self._append(EventEntry(kind, self.last.step if self.last else None, None, text, level))
        self.version += 1

    def _append(self, entry: EventEntry) -> None:
        self.events.append(entry)
        if len(self.events) > MAX_EVENTS:  # a diverging run can flag every step
            del self.events[: MAX_EVENTS // 2]
            self._seen = {(e.kind, e.step) for e in self.events}

    def add_all(self, records: list[Record], detect: bool = True) -> None:
        for rec in records:
            self.add(rec, detect=detect)

    def seen(self, now: float) -> None:
        """New lines arrived at `now` (the monitor's clock). Counts as a report even when
        lines carry no `time`, or the writer's clock differs from ours."""
        self._report(now)

    def _report(self, t: float, step: int | None = None) -> None:
        if self.last_report is None or t > self.last_report:
            self.last_report = t
        if self._stalled:
            self._stalled = False
            self._event("resumed", step, t, "reporting again", "info", dedupe=False)

    def add(self, rec: Record, detect: bool = True) -> None:
        self.version += 1
        if rec.time is not None:
            self._report(rec.time, rec.step)
        if isinstance(rec, Event):
            self._add_event(rec)
        else:
            self._add_metric(rec, detect)

    def _event(self, kind, step, time, text, level="info", dedupe=True) -> None:
        if dedupe:
            key = (kind, step)
            if key in self._seen:
                return
            self._seen.add(key)
        self._append(EventEntry(kind, step, time, text, level))

    def _add_metric(self, m: Metric, detect: bool) -> None:
        if self.steps and m.step <= self.steps[-1]:
            # A resumed run repeats steps after its last checkpoint: the new line wins.
            cut = bisect_left(self.steps, m.step)
            self._event(
                "restart",
                m.step,
                m.time,
                f"steps restart at {m.step} (was {self.steps[-1]})",
                "warn",
                dedupe=False,
            )
            del self.steps[cut:], self.times[cut:], self.smoothed[cut:]
            for values in self.series.values():
                del values[cut:]
            self._loss_win.clear()
            self._grad_win.clear()
            self._tps_win.clear()
            for hist in self.layers.values():
                while hist and hist[-1][0] >= m.step:
                    hist.pop()
            # The re-run's evals and checkpoints at these steps are news, not duplicates.
            self.evals = [e for e in self.evals if e[0] < m.step]
            self._seen = {k for k in self._seen if k[1] is None or k[1] < m.step}
        if self.start_time is None and m.time is not None:
            self.start_time = m.time
        f = m.fields
        self.last = m
        if _finite(f.get("tokens")):
            self._tokens = f["tokens"]
        self.steps.append(m.step)
        self.times.append(m.time if m.time is not None else math.nan)
        if m.moe_load is not None or m.moe_imbalance is not None or "mtp_loss" in f:
            self._add_moe(m)
        if m.lists or "comm_share" in f:
            self._add_health(m)
        for key in SERIES:
            self.series[key].append(f.get(key, math.nan))
        loss = f.get("loss")
        trainer_smoothed = f.get("loss_smoothed")
        if _finite(trainer_smoothed):
            # The trainer smooths over every step; an EMA over logged points only lags it.
            self.smoothed.append(trainer_smoothed)
        elif _finite(loss):
            w = self.settings.smoothing
            self._ema = w * self._ema + (1 - w) * loss
            self._ema_n += 1
            self.smoothed.append(self._ema / (1 - w**self._ema_n))
        else:
            self.smoothed.append(self.smoothed[-1] if self.smoothed else math.nan)
        if detect:
            try:
                self._detect(m)
            except ArithmeticError:  # absurd magnitudes (1e308): no verdict, no crash
                pass
        if len(self.steps) > self.settings.max_points:
            self._thin()

    def _add_moe(self, m: Metric) -> None:
        self.has_moe = True
        f = m.fields
        if m.moe_load is not None:
            self.moe_load = m.moe_load
            self.moe_step = m.step
            self.moe_imbalance = m.moe_imbalance or [imbalance(row) for row in m.moe_load]
            if "moe_imbalance_overall" not in f:  # derivable: plot it all the same
                f["moe_imbalance_overall"] = overall_imbalance(m.moe_load)
        elif m.moe_imbalance is not None:
            self.moe_imbalance = m.moe_imbalance
            self.moe_step = m.step

    def _add_health(self, m: Metric) -> None:
        self.has_health = True
        for key, values in m.lists.items():
            if key.endswith("_ranks"):
                self.ranks[key] = (m.step, values)
            else:
                self.layers.setdefault(key, deque(maxlen=HEAT_STEPS)).append((m.step, values))
        logits = [v for v in m.lists.get("max_logits", []) if math.isfinite(v)]
        if logits:
            m.fields["max_logit"] = max(logits)

    def _thin(self) -> None:
        """Halve the resolution of the older half so memory stays bounded on long runs."""
        half = len(self.steps) // 2
        for arr in (self.steps, self.times, self.smoothed, *self.series.values()):
            arr[:half] = arr[:half:2]

    # --- derived facts -------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.end is None

    def check_stall(self, now: float) -> bool:
        """Emit a stall event once a running run has been silent too long."""
        if self._stalled or not self.running or self.last_report is None:
            return False
        silent = now - self.last_report
        if silent > self.settings.stall_after_s:
            self._stalled = True
            step = self.last.step if self.last else None
            self._event(
                "stall",
                step,
                now,
                f"no new metrics for {fmt_duration(silent)}",
                "error",
                dedupe=False,
            )
            self.version += 1
            return True
        return False

    @property
    def stalled(self) -> bool:
        return self._stalled

    def elapsed(self, now: float) -> float | None:
        if self.start_time is None:
            return None
        end = self.end.time if self.end is not None and self.end.time is not None else None
        if end is None:
            # a silent or finished run's clock stops at its last line
            end = now if self.running and not self._stalled else self.last_report
        return None if end is None else max(0.0, end - self.start_time)

    def seconds_per_step(self, window: int = 50) -> float | None:
        n = len(self.steps)
        for back in (min(window, n - 1), n - 1):
            if back < 1:
                return None
            i = n - 1 - back
            dt = self.times[-1] - self.times[i]
            ds = self.steps[-1] - self.steps[i]
            if ds > 0 and math.isfinite(dt) and dt > 0:
                return dt / ds
        return None

    def eta(self) -> float | None:
        if not self.running or self._stalled or self.total_steps is None or self.last is None:
            return None
        sps = self.seconds_per_step()
        if sps is None:
            return None
        return max(0, self.total_steps - self.last.step) * sps

    @property
    def tokens(self) -> float | None:
        return self._tokens

    def status(self) -> str:
        if self.last is None and self.end is None:
            return "waiting"
        if self.end is not None:
            s = self.end.data.get("status")
            return s if isinstance(s, str) else "ended"
        if self._stalled:
            return "stalled"
        return "running"

    def view(self, key: str, last_n: int | None = None, buckets: int = 400) -> tuple[list, list]:
        """Finite (step, value) points of one series over the plotted range, downsampled.

        `key` is a series name, "smoothed", or "ppl" (eval perplexity)."""
        lo_step = self.steps[-1] - last_n if last_n is not None and self.steps else None
        if key == "ppl":
            pts = [
                (s, p)
                for s, _, p in self.evals
                if math.isfinite(p) and (lo_step is None or s >= lo_step)
            ]
            return [p[0] for p in pts], [p[1] for p in pts]
        ys_all = self.smoothed if key == "smoothed" else self.series[key]
        start = bisect_left(self.steps, lo_step) if lo_step is not None else 0
        xs: list[int] = []
        ys: list[float] = []
        steps = self.steps
        for i in range(start, len(steps)):
            y = ys_all[i]
            if math.isfinite(y):
                xs.append(steps[i])
                ys.append(y)
        return downsample(xs, ys, buckets)
