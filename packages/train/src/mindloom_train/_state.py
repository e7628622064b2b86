"""The run's progress counters and their checkpoint form (the `common` JSON fields).

Everything that a resume must restore besides the tensors lives in `TrainState`: the step,
the samples consumed, the applied-update count (AdamW bias correction), the loss scale,
the skip counters and the smoothed loss, plus the random generators' states.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mindloom_train._errors import TrainError


@dataclass
class TrainState:
    step: int = 0  # the last completed step (the update being computed is step + 1)
    consumed: int = 0  # samples of the train stream consumed so far
    adam_step: int = 0  # applied updates (skipped steps do not count)
    skipped_total: int = 0
    loss_smoothed: float | None = None
    loss_scale: float = 1.0
    scale_good_steps: int = 0  # applied updates since the loss scale last changed
    last_lr: float = 0.0

    def checkpoint_fields(self, seq_length: int) -> dict[str, Any]:
        """This state's keys of a checkpoint's common JSON (the trainer adds the rest)."""
        return {
            "consumed_samples": self.consumed,
            "consumed_tokens": self.consumed * seq_length,
            "adam_step": self.adam_step,
            "skipped_steps": self.skipped_total,
            "loss_smoothed": self.loss_smoothed,
            "loss_scale": {"scale": self.loss_scale, "good_steps": self.scale_good_steps},
            "lr": self.last_lr,
            "data": {"consumed_samples": self.consumed},
        }

    def restore(
        self, common: dict[str, Any], global_batch_size: int, where: str,
        log: Callable[[str], None], saved_step: int,
    ) -> None:  # fmt: skip
        """Take the counters from a checkpoint's common JSON; the step follows from
        consumed_samples, so a resume under another global batch size keeps the data
        position (it must divide it)."""
        gbs = global_batch_size
        self.consumed = int(common["consumed_samples"])
        old_gbs = int(common.get("global_batch_size", gbs))
        if self.consumed % gbs:
            raise TrainError(
                f"{where}: consumed_samples {self.consumed} is not a multiple of the new "
                f"global_batch_size {gbs}"
            )
        self.step = self.consumed // gbs
        if old_gbs != gbs:
            log(
                f"checkpoint: global batch size {old_gbs} -> {gbs}; consumed_samples "
                f"{self.consumed} kept, step {saved_step} -> {self.step}"
            )
        self.adam_step = int(common.get("adam_step", 0))
        self.skipped_total = int(common.get("skipped_steps", 0))
        self.loss_smoothed = common.get("loss_smoothed")
        ls = common.get("loss_scale") or {}
        self.loss_scale = float(ls.get("scale", self.loss_scale))
        self.scale_good_steps = int(ls.get("good_steps", 0))
        if common.get("rng"):
            set_rng_state(common["rng"])


def rng_state() -> dict[str, Any]:
    import mindspore as ms

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    py = random.getstate()
    return {
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "python": [py[0], list(py[1]), py[2]],
        "mindspore": ms.get_rng_state().asnumpy().tolist(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import mindspore as ms

    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, gauss))
    v, internal, g = state["python"]
    random.setstate((v, tuple(internal), g))
    cur = ms.get_rng_state()
    ms.set_rng_state(ms.Tensor(np.asarray(state["mindspore"], dtype=cur.asnumpy().dtype)))


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for dist in [
        "mindspore",
        "numpy",
        "mindloom-train",
        "mindloom-model",
        "mindloom-data",
        "mindloom-tokenizer",
        "mindloom-parallel",
    ]:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out
