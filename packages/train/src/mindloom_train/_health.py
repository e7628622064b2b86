"""Training-health rules: the trainer reads its own metrics stream and says when a run
looks wrong, with a one-line reason and a one-line advice.

`HealthMonitor.observe(record)` sees every record the trainer writes to metrics.jsonl
(step records, `eval` events, the `start` event) in file order and returns the `health`
events to append after it. Each rule is latched: it fires once, and again only after its
condition has been clear for a record, so a run stuck in a bad state is one event, not
one per log step.

The monitor (mindloom-monitor, which may not import this package) does not re-derive
these verdicts: it shows the `health` events, and for a run whose `start` event carries
the `health` settings it also leaves grad-norm spikes to the trainer (`grad_norm_high`
here) and loss spikes to the trainer's per-step `anomaly loss_spike`. So each spike rule
has one definition, here and in the trainer's step loop.

No MindSpore import: this runs on plain Python numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import Any

__all__ = ["RULES", "HealthConfig", "HealthMonitor", "check_config"]

# rule name -> advice (the reason is built from the numbers when a rule fires)
RULES = {
    "flat_loss": "check the learning rate and warm-up (too low?), that labels are the inputs "
    "shifted by one token, and that the loss mask is not (nearly) empty",
    "loss_cliff": "a sudden drop usually means the model has seen these samples before: look "
    "for duplicated or leaked data (dedup the corpus, check the train/eval split)",
    "eval_diverge": "held-out loss rising while training loss falls: the model memorises (too "
    "little data, too many epochs) or the eval set is formatted unlike the training data "
    "(tokenizer, templates, EOS); keep the best checkpoint",
    "grad_norm_high": "lower the learning rate or raise warm-up, keep training.grad_clip on, "
    "and look for bad samples at these steps",
    "max_logits": "attention logits are growing without bound: lower the learning rate, add "
    "QK-norm or logit soft-capping, or check the attention scaling",
    "comm_high": "communication dominates the step: lower parallelism.tp (raise dp), use a "
    "larger micro-batch, or raise parallelism.bucket_size_mb",
    "data_wait": "the data loader cannot keep up: tokenize and pack offline, put the data on "
    "local disk, or give the loader more CPU threads",
    "padding": "packing pads too much: documents much shorter than seq_length leave bins "
    "half empty (best_fit); use train_dataset.pack_mode: concat, a shorter seq_length, or "
    "join short documents before tokenizing",
}


@dataclass
class HealthConfig:
    """`monitor.health` settings; every threshold is documented in the train README."""

    enabled: bool = True
    flat_steps: int = 50  # loss must have fallen by the first log record at or after this step
    flat_min_drop: float = 0.02  # ... by at least this fraction of the first logged loss
    cliff_drop: float = 0.3  # one log interval's loss falling by more than this fraction
    eval_rises: int = 2  # held-out loss rising this many evals in a row
    grad_factor: float = 5.0  # grad norm above this multiple of its median ...
    grad_window: int = 50  # ... over this many log records ...
    grad_persist: int = 3  # ... for this many log records in a row
    max_logit_bound: float = 100.0  # largest attention logit above this
    max_logit_growth: int = 5  # or rising this many log records in a row and doubled ...
    # ... to above this: a fresh model's logits (~0.1) triple while it learns to attend,
    # which is not the unbounded growth the rule is about (seen on the debug preset)
    max_logit_floor: float = 5.0
    comm_share: float = 1 / 3  # communication share of the step above this ...
    data_wait: float = 0.1  # data-wait share of the step above this ...
    persist: int = 2  # ... for this many log records in a row
    padding: float = 0.05  # packed samples' padding share above this (at pack time)


def check_config(h: HealthConfig) -> tuple[str, Any, str] | None:
    """The first impossible `monitor.health` value as (key, value, why), else None."""
    for name in ("flat_steps", "eval_rises", "grad_window", "grad_persist", "max_logit_growth",
                 "persist"):  # fmt: skip
        if getattr(h, name) < 1:
            return f"monitor.health.{name}", getattr(h, name), "must be >= 1"
    for name in ("flat_min_drop", "cliff_drop", "comm_share", "data_wait", "padding"):
        if not 0 < getattr(h, name) < 1:
            return f"monitor.health.{name}", getattr(h, name), "must be between 0 and 1"
    if h.max_logit_floor < 0:
        return "monitor.health.max_logit_floor", h.max_logit_floor, "must be >= 0"
    for name in ("grad_factor", "max_logit_bound"):
        if getattr(h, name) <= 1:
            return f"monitor.health.{name}", getattr(h, name), "must be > 1"
    return None


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


class HealthMonitor:
    """The rule engine. `log` gets one line per event (the run's train.log and console)."""

    def __init__(self, cfg: HealthConfig | None = None, log: Callable[[str], None] | None = None):
        self.cfg = cfg or HealthConfig()
        self.log = log
        self._latched: set[str] = set()
        self._first: tuple[int, float] | None = None  # first logged (step, loss)
        self._flat_done = False
        self._prev_loss: float | None = None
        self._train_loss: float | None = None  # newest smoothed training loss
        self._evals: list[tuple[int, float, float]] = []  # step, eval loss, train loss
        self._grads: deque[float] = deque(maxlen=self.cfg.grad_window)
        self._runs = {"grad_norm_high": 0, "comm_high": 0, "data_wait": 0}
        self._logits: deque[float] = deque(maxlen=self.cfg.max_logit_growth + 1)

    # ------------------------------------------------------------------ entry point

    def observe(self, record: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the record to write, possibly annotated; the health events to write after it)."""
        kind = record.get("event")
        if kind == "start":
            # a reader learns from this that the trainer judges the run itself
            return {**record, "health": dataclasses.asdict(self.cfg)}, []
        out: list[dict[str, Any]] = []
        if kind == "eval":
            self._eval(record, out)
        elif kind is None and isinstance(record.get("step"), int):
            self._step(record, out)
        for ev in out:
            if self.log is not None:
                self.log(f"health: step {ev['step']} {ev['rule']}: {ev['reason']}; "
                         f"advice: {ev['advice']}")  # fmt: skip
        return record, out

    def check_packing(self, dataset, name: str, step: int) -> list[dict[str, Any]]:
        """At pack time (before step 1): the padding share of `dataset`'s packed samples
        (mindloom_data's PackedDataset.stats; each part of a blend), logged, and a
        `padding` event for each part above `padding`."""
        parts = getattr(dataset, "datasets", None) or [dataset]
        out: list[dict[str, Any]] = []
        for i, part in enumerate(parts):
            st = part.stats()
            ratio = float(st["padding_ratio"])
            label = name if len(parts) == 1 else f"{name} part {i}"
            if self.log is not None:
                self.log(f"data: {label} packed {st['mode']}: padding {100 * ratio:.2f}%, "
                         f"{st['tokens_per_sample']:.1f} tokens per sample of {st['seq_length']}")  # fmt: skip
            self._latched.discard("padding")  # one verdict per part
            self._fire(out, "padding", ratio > self.cfg.padding, step, ratio, self.cfg.padding,
                       f"{100 * ratio:.1f}% of the {label} dataset's packed tokens are padding "
                       f"(above {100 * self.cfg.padding:g}%)")  # fmt: skip
        for ev in out:
            if self.log is not None:
                self.log(f"health: step {step} padding: {ev['reason']}; advice: {ev['advice']}")
        return out

    # ------------------------------------------------------------------ rules

    def _fire(self, out: list, rule: str, cond: bool, step: int, value: Any, threshold: Any,
              reason: str) -> None:  # fmt: skip
        if not cond:
            self._latched.discard(rule)
            return
        if rule in self._latched:
            return
        self._latched.add(rule)
        out.append({"event": "health", "step": step, "rule": rule, "value": value,
                    "threshold": threshold, "reason": reason, "advice": RULES[rule]})  # fmt: skip

    def _step(self, rec: dict[str, Any], out: list) -> None:
        c, step = self.cfg, rec["step"]
        loss = _num(rec.get("loss"))
        smoothed = _num(rec.get("loss_smoothed"))
        if smoothed is not None or loss is not None:
            self._train_loss = smoothed if smoothed is not None else loss
        if loss is not None:
            if self._first is None:
                self._first = (step, loss)
                # no baseline inside the first N steps (a resumed run): no verdict
                self._flat_done = step >= c.flat_steps
            elif not self._flat_done and step >= c.flat_steps:
                self._flat_done = True
                s0, l0 = self._first
                self._fire(
                    out, "flat_loss", loss > l0 * (1 - c.flat_min_drop), step, loss,
                    l0 * (1 - c.flat_min_drop),
                    f"loss {loss:.4f} at step {step} vs {l0:.4f} at step {s0}: less than "
                    f"{c.flat_min_drop:.0%} lower over the first {step} steps",
                )  # fmt: skip
            prev = self._prev_loss
            if prev is not None and prev > 0 and step > c.flat_steps:
                self._fire(
                    out, "loss_cliff", loss < prev * (1 - c.cliff_drop), step, loss,
                    prev * (1 - c.cliff_drop),
                    f"loss fell from {prev:.4f} to {loss:.4f} ({1 - loss / prev:.0%}) in one log "
                    f"interval at step {step}",
                )  # fmt: skip
            self._prev_loss = loss
        grad = _num(rec.get("grad_norm"))
        if grad is not None:
            med = median(self._grads) if len(self._grads) >= min(10, c.grad_window) else None
            above = med is not None and med > 0 and grad > c.grad_factor * med
            n = self._persist("grad_norm_high", above)
            if med is not None:
                self._fire(
                    out, "grad_norm_high", n >= c.grad_persist, step, grad, c.grad_factor * med,
                    f"grad norm {grad:.4g} above {c.grad_factor:g}x its median {med:.4g} for "
                    f"{n} log records in a row",
                )  # fmt: skip
            self._grads.append(grad)
        self._max_logits(rec, step, out)
        shares = rec.get("comm_share_ranks")
        vals = [v for v in (shares if isinstance(shares, list) else []) if _num(v) is not None]
        comm = max(vals) if vals else _num(rec.get("comm_share"))
        if comm is not None:
            n = self._persist("comm_high", comm > c.comm_share)
            rank = f" (rank {vals.index(comm)})" if vals else ""
            self._fire(
                out, "comm_high", n >= c.persist, step, comm, c.comm_share,
                f"communication takes {comm:.0%} of the step{rank}, above {c.comm_share:.0%} "
                f"for {n} log records in a row",
            )  # fmt: skip
        wait = _num(rec.get("data_wait_frac"))
        if wait is not None:
            n = self._persist("data_wait", wait > c.data_wait)
            self._fire(
                out, "data_wait", n >= c.persist, step, wait, c.data_wait,
                f"the step waits for data {wait:.0%} of the time, above {c.data_wait:.0%} for "
                f"{n} log records in a row",
            )  # fmt: skip

    def _persist(self, rule: str, above: bool) -> int:
        self._runs[rule] = self._runs[rule] + 1 if above else 0
        return self._runs[rule]

    def _max_logits(self, rec: dict[str, Any], step: int, out: list) -> None:
        raw = rec.get("max_logits")
        vals = [_num(v) for v in raw] if isinstance(raw, list) else [_num(raw)]
        vals = [v for v in vals if v is not None]
        if not vals:
            return
        c, top = self.cfg, max(vals)
        self._logits.append(top)
        hist = list(self._logits)
        rising = (
            len(hist) > c.max_logit_growth
            and all(b > a for a, b in zip(hist, hist[1:]))
            and hist[-1] >= 2 * hist[0] > 0
            and hist[-1] > c.max_logit_floor
        )
        if top > c.max_logit_bound:
            why = f"largest attention logit {top:.4g} above the bound {c.max_logit_bound:g}"
        else:
            why = (f"largest attention logit rose for {c.max_logit_growth} log records in a row, "
                   f"{hist[0]:.4g} -> {top:.4g}")  # fmt: skip
        self._fire(out, "max_logits", top > c.max_logit_bound or rising, step, top,
                   c.max_logit_bound, why)  # fmt: skip

    def _eval(self, rec: dict[str, Any], out: list) -> None:
        loss, step = _num(rec.get("loss")), rec.get("step")
        if loss is None or not isinstance(step, int) or self._train_loss is None:
            return
        if self._evals and self._evals[-1][0] == step:
            return  # the same eval again (an end-of-run eval at an eval step)
        self._evals.append((step, loss, self._train_loss))
        k = self.cfg.eval_rises
        span = self._evals[-(k + 1) :]
        diverging = (
            len(span) == k + 1
            and all(b[1] > a[1] for a, b in zip(span, span[1:]))
            and span[-1][2] < span[0][2]
        )
        first = span[0]
        self._fire(
            out, "eval_diverge", diverging, step, loss, first[1],
            f"held-out loss rose {first[1]:.4f} -> {loss:.4f} over steps {first[0]}-{step} while "
            f"training loss fell {first[2]:.4f} -> {self._train_loss:.4f}",
        )  # fmt: skip
