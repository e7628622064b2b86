"""After each step: the dynamic loss scale, and the skip / spike / stop guard.

The compiled step (or the engine) already refused to apply an update whose loss or grad
norm was not finite or whose grad norm passed `training.grad_spike_threshold`; here the host
decides what that means: a halved fp16 loss scale, an `anomaly` event, or after
`training.max_consecutive_skips` skipped updates in a row, the end of the run (exit 3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from mindloom_train._config import Config
from mindloom_train._state import TrainState


class LossScaler:
    """Dynamic loss scaling (fp16): double after `loss_scale_window` applied updates,
    halve on an overflow down to `min_loss_scale`. The scale lives in the TrainState, so it
    is checkpointed with it; a static scale of 1.0 when not dynamic."""

    def __init__(self, cfg: Config, state: TrainState):
        p = cfg.precision
        self.dynamic = p.loss_scale == "dynamic" or (
            p.loss_scale == "auto" and p.compute_dtype == "fp16"
        )
        self.window = p.loss_scale_window
        self.min_scale = p.min_loss_scale
        self.state = state
        state.loss_scale = p.initial_loss_scale if self.dynamic else 1.0
        state.scale_good_steps = 0

    def on_applied(self) -> None:
        if not self.dynamic:
            return
        s = self.state
        s.scale_good_steps += 1
        if s.scale_good_steps >= self.window:
            s.loss_scale *= 2.0
            s.scale_good_steps = 0

    def absorbs_overflow(self, gnorm: float) -> bool:
        """A skipped step with a non-finite grad norm under a scale that can still shrink:
        expected now and then in fp16, so the scale halves and no anomaly streak grows."""
        s = self.state
        if not (self.dynamic and not math.isfinite(gnorm) and s.loss_scale > self.min_scale):
            return False
        s.loss_scale = max(s.loss_scale / 2, self.min_scale)
        s.scale_good_steps = 0
        return True


@dataclass(frozen=True)
class GuardStop:
    """The anomaly guard ended the run at this step."""

    step: int
    reason: str


class AnomalyGuard:
    """Counts skipped updates and reports anomalies; decides when to stop.

    `report(step, kind, value, action)` writes the `anomaly` event and log line.
    """

    def __init__(self, cfg: Config, state: TrainState, scaler: LossScaler, rank: int,
                 report: Callable[[int, str, float, str], None]):  # fmt: skip
        t = cfg.training
        self.spike_factor = t.loss_spike_factor
        self.smoothing = t.loss_smoothing
        self.max_skips = t.max_consecutive_skips
        self.state = state
        self.scaler = scaler
        self.rank = rank
        self.report = report
        self.consecutive = 0  # skipped updates in a row (not checkpointed: a resume restarts it)

    def after_step(self, step: int, loss: float, gnorm: float, ok: bool) -> GuardStop | None:
        if ok:
            self._applied(step, loss)
            return None
        self.state.skipped_total += 1
        if self.scaler.absorbs_overflow(gnorm):
            self.report(step, "nonfinite_grad", gnorm, "skipped")
            return None
        self.consecutive += 1
        if not math.isfinite(loss):
            kind, value = "nonfinite_loss", loss
        elif not math.isfinite(gnorm):
            kind, value = "nonfinite_grad", gnorm
        else:
            kind, value = "grad_spike", gnorm
        stop = self.consecutive >= self.max_skips
        self.report(step, kind, value, "stopped" if stop else "skipped")
        if not stop:
            return None
        return GuardStop(step, (
            f"step {step} rank {self.rank}: {self.consecutive} consecutive skipped "
            f"updates (last: {kind} = {value}); weights are those of the last good step"
        ))  # fmt: skip

    def _applied(self, step: int, loss: float) -> None:
        s = self.state
        s.adam_step += 1
        self.consecutive = 0
        self.scaler.on_applied()
        if (
            self.spike_factor is not None
            and s.loss_smoothed is not None
            and step > 10
            and loss > self.spike_factor * s.loss_smoothed
        ):
            self.report(step, "loss_spike", loss, "reported")
        a = self.smoothing
        s.loss_smoothed = loss if s.loss_smoothed is None else a * s.loss_smoothed + (1 - a) * loss
