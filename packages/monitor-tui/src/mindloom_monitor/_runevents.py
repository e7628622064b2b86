"""What `RunData` derives from event lines and from each metric record: the trainer's
events, spikes, non-finite values and throughput drops (a mixin split from `_stats`;
plain Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median

from mindloom_monitor._fmt import _finite, fmt_count, fmt_num
from mindloom_monitor._records import Event, Metric

MAX_ALERTS = 200  # health alerts kept per run


@dataclass(slots=True)
class EventEntry:
    kind: str
    step: int | None
    time: float | None
    text: str
    level: str = "info"  # info | warn | error


class RunEvents:
    """`RunData`'s event handling and detectors; reads and writes its state."""

    def _add_event(self, ev: Event) -> None:
        handler = {
            "start": self._on_start,
            "eval": self._on_eval,
            "checkpoint": self._on_checkpoint,
            "anomaly": self._on_anomaly,
            "health": self._on_health,
            "end": self._on_end,
        }.get(ev.kind)
        if handler is None:
            self._event(ev.kind, ev.step, ev.time, "(an event this monitor does not know)")
        else:
            handler(ev, ev.data)

    def _on_start(self, ev: Event, d: dict) -> None:
        total = d.get("total_steps")
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            self.total_steps = total
        name = d.get("run_name")
        if isinstance(name, str) and name:
            self.name = name
        self.trainer_health = isinstance(d.get("health"), dict)
        if ev.time is not None and (self.start_time is None or self.end is not None):
            self.start_time = ev.time
        self.end = None
        text = self.name + (f" ({self.total_steps} steps)" if self.total_steps else "")
        resumed = d.get("resumed_from")
        if resumed is not None and not isinstance(resumed, dict | list):
            text += f", resumed from {resumed}"
        self._event("start", ev.step, ev.time, text, dedupe=False)

    def _on_eval(self, ev: Event, d: dict) -> None:
        loss = d.get("loss")
        ppl = d.get("ppl")
        loss = (
            float(loss)
            if isinstance(loss, int | float) and not isinstance(loss, bool)
            else math.nan
        )
        if isinstance(ppl, int | float) and not isinstance(ppl, bool):
            ppl = float(ppl)
        else:
            ppl = math.exp(loss) if math.isfinite(loss) and loss < 700 else math.nan
        if ev.step is not None:
            self.evals.append((ev.step, loss, ppl))
        self._event("eval", ev.step, ev.time, f"loss {fmt_num(loss)}  ppl {fmt_num(ppl)}")

    def _on_checkpoint(self, ev: Event, d: dict) -> None:
        path = d.get("path")
        path = path if isinstance(path, str) else ""
        if d.get("status") == "failed":
            reason = d.get("reason") if isinstance(d.get("reason"), str) else ""
            self._event("checkpoint", ev.step, ev.time, f"FAILED {reason}".rstrip(), "error")
        else:
            self.last_checkpoint = (ev.step, path)
            self._event("checkpoint", ev.step, ev.time, f"saved {path}".rstrip())

    def _on_anomaly(self, ev: Event, d: dict) -> None:
        kind = d.get("kind") if isinstance(d.get("kind"), str) else "anomaly"
        action = d.get("action") if isinstance(d.get("action"), str) else "reported"
        value = d.get("value")
        value = (
            fmt_num(float(value))
            if isinstance(value, int | float) and not isinstance(value, bool)
            else "NaN"
        )
        derived = {
            "nonfinite_loss": "nan",
            "nonfinite_grad": "nan_grad",
            "grad_spike": "grad_spike",
            "loss_spike": "loss_spike",
        }.get(kind, kind)
        level = "error" if action == "stopped" or kind.startswith("nonfinite") else "warn"
        self._event(derived, ev.step, ev.time, f"{kind} {value} ({action})", level)

    def _on_health(self, ev: Event, d: dict) -> None:
        rule = d.get("rule") if isinstance(d.get("rule"), str) and d.get("rule") else "health"
        reason = d.get("reason") if isinstance(d.get("reason"), str) else ""
        advice = d.get("advice") if isinstance(d.get("advice"), str) else ""
        text = reason + (f"; advice: {advice}" if advice else "")
        self.has_health = True
        if (rule, ev.step) not in self._seen:
            self.alerts.append(EventEntry(rule, ev.step, ev.time, text, "warn"))
            del self.alerts[:-MAX_ALERTS]
        self._event(rule, ev.step, ev.time, text, "warn")

    def _on_end(self, ev: Event, d: dict) -> None:
        self.end = ev
        status = d.get("status") if isinstance(d.get("status"), str) else "ended"
        reason = d.get("reason") if isinstance(d.get("reason"), str) else ""
        level = "info" if status == "completed" else "error"
        self._event("end", ev.step, ev.time, status + (f" ({reason})" if reason else ""), level,
                    dedupe=False)  # fmt: skip

    def _detect(self, m: Metric) -> None:
        s = self.settings
        f = m.fields
        loss = f.get("loss")
        grad = f.get("grad_norm")
        if loss is not None and not math.isfinite(loss):
            self._event("nan", m.step, m.time, f"non-finite loss ({fmt_num(loss)})", "error")
        elif _finite(loss):
            win = self._loss_win
            # the trainer's own rules (one definition, train's _health.py and its per-step
            # loss_spike anomaly) flag spikes of runs that say so in their start event
            if len(win) >= 20 and not self.trainer_health:
                mean = sum(win) / len(win)
                std = math.sqrt(sum((x - mean) * (x - mean) for x in win) / len(win))
                if loss > mean + max(s.spike_sigmas * std, 0.05 * abs(mean)):
                    self._event(
                        "loss_spike",
                        m.step,
                        m.time,
                        f"loss spike {fmt_num(loss)} (recent mean {fmt_num(mean)})",
                        "warn",
                    )
            win.append(loss)
        if grad is not None and not math.isfinite(grad):
            self._event(
                "nan_grad", m.step, m.time, f"non-finite grad norm ({fmt_num(grad)})", "error"
            )
        elif _finite(grad):
            win = self._grad_win
            if len(win) >= 10 and not self.trainer_health:
                med = median(win)
                if med > 0 and grad > s.grad_spike_factor * med:
                    self._event(
                        "grad_spike",
                        m.step,
                        m.time,
                        f"grad norm spike {fmt_num(grad)} (median {fmt_num(med)})",
                        "warn",
                    )
            win.append(grad)
        skipped = f.get("skipped_steps")
        if _finite(skipped):
            skipped = int(skipped)
            if skipped > self._skipped_steps:
                self._event(
                    "skipped",
                    m.step,
                    m.time,
                    f"{skipped - self._skipped_steps} step(s) skipped ({skipped} in total)",
                    "warn",
                    dedupe=False,
                )
            self._skipped_steps = skipped
        tps = f.get("tokens_per_s")
        if _finite(tps):
            win = self._tps_win
            if len(win) >= 5:
                med = median(win)
                if not self._tps_dropped and tps < (1 - s.drop_frac) * med:
                    self._tps_dropped = True
                    self._event(
                        "throughput_drop",
                        m.step,
                        m.time,
                        f"throughput drop {fmt_count(tps)} tok/s (recent {fmt_count(med)})",
                        "warn",
                        dedupe=False,
                    )
                elif self._tps_dropped and tps >= (1 - s.drop_frac / 3) * med:
                    self._tps_dropped = False
            if not self._tps_dropped:
                win.append(tps)
