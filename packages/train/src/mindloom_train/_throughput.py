"""The steps since the last `metrics.jsonl` record, and that record built from them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mindloom_train._metrics import mem_rss_mb


@dataclass
class ThroughputWindow:
    """What the steps of one log interval add up to. Evaluation and save time is paused out
    of the wall clock (`pause`): it is not training time (tokens/s, MFU)."""

    t0: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0
    loss_sum: float = 0.0  # over the applied updates only
    loss_n: int = 0
    step_time: float = 0.0  # seconds inside steps, summed
    comm_s: float = 0.0  # collective time the host could measure (the engine path)
    rank_step_s: float = 0.0  # the engine's own step time, for the communication share
    data_wait0: float = 0.0  # the loader's wait counter when the window opened

    def add(self, tokens: int, step_time: float, comm_s: float, rank_step_s: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.step_time += step_time
        self.comm_s += comm_s
        self.rank_step_s += rank_step_s

    def add_loss(self, loss: float) -> None:
        self.loss_sum += loss
        self.loss_n += 1

    def pause(self, since: float) -> None:
        self.t0 += time.perf_counter() - since

    def mean_step_time(self) -> float:
        return self.step_time / max(self.steps, 1)


@dataclass(frozen=True)
class FlopsBudget:
    """The model FLOPs of one token and the device's peak (MFU = achieved / peak)."""

    per_token: float
    peak: float  # FLOP/s; 0 when unknown


def metrics_record(
    window: ThroughputWindow, *, step: int, loss: float, lr: float, gnorm: float, state,
    seq_length: int, data_wait_s: float, flops: FlopsBudget,
) -> dict[str, Any]:  # fmt: skip
    """The step record of `metrics.jsonl` (fields in the documented order); the caller adds
    the loss scale, MoE and communication fields."""
    wall = max(time.perf_counter() - window.t0, 1e-9)
    tps = window.tokens / wall
    return {
        "step": step,
        "loss": window.loss_sum / window.loss_n if window.loss_n else loss,
        "loss_smoothed": state.loss_smoothed,
        "lr": lr,
        "grad_norm": gnorm,
        "tokens_per_s": tps,
        "mfu": tps * flops.per_token / flops.peak if flops.peak else None,
        "step_time_s": window.mean_step_time(),
        "tokens": state.consumed * seq_length,
        "consumed_samples": state.consumed,
        "data_wait_frac": min(1.0, (data_wait_s - window.data_wait0) / wall),
        "mem_rss_mb": mem_rss_mb(),
        "skipped_steps": state.skipped_total,
        "step_loss": loss,
    }
