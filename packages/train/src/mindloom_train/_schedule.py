"""Learning-rate schedules: a pure function of the step, so resume needs only the step."""

from __future__ import annotations

import math

from mindloom_train._config import LRSchedulerConfig


def lr_at(step: int, s: LRSchedulerConfig, train_iters: int) -> float:
    """LR for optimizer step `step` (0-based: the first update uses lr_at(0))."""
    decay_iters = s.decay_iters if s.decay_iters is not None else train_iters
    if s.warmup_iters > 0 and step < s.warmup_iters:
        # nanoGPT's linear warmup: lr * (it + 1) / (warmup_iters + 1)
        return s.lr * (step + 1) / (s.warmup_iters + 1)
    if s.type == "constant":
        return s.lr
    if step >= decay_iters:
        return s.min_lr
    if s.type == "wsd":
        decay_start = decay_iters - max(1, round(s.wsd_decay_fraction * decay_iters))
        decay_start = max(decay_start, s.warmup_iters)
        if step < decay_start:
            return s.lr
        frac = (step - decay_start) / max(1, decay_iters - decay_start)
        if s.wsd_decay_style == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
        elif s.wsd_decay_style == "sqrt":
            coeff = 1.0 - math.sqrt(frac)
        else:
            coeff = 1.0 - frac
        return s.min_lr + coeff * (s.lr - s.min_lr)
    frac = (step - s.warmup_iters) / max(1, decay_iters - s.warmup_iters)
    if s.type == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
    else:  # linear
        coeff = 1.0 - frac
    return s.min_lr + coeff * (s.lr - s.min_lr)


def schedule_signature(s: LRSchedulerConfig, train_iters: int) -> dict:
    """What a resumed run must agree on (drift check)."""
    return {
        "type": s.type,
        "lr": s.lr,
        "min_lr": s.min_lr,
        "warmup_iters": s.warmup_iters,
        "decay_iters": s.decay_iters if s.decay_iters is not None else train_iters,
        "wsd_decay_fraction": s.wsd_decay_fraction,
        "wsd_decay_style": s.wsd_decay_style,
    }
