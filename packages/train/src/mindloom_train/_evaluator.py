"""The held-out loss: `training.eval_iters` micro-batches of the eval dataset, from its
start each time, averaged over the data-parallel ranks."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mindloom_train._config import Config


class Evaluator:
    def __init__(self, cfg: Config, dataset, runner, model, make_loader: Callable, dp_size: int,
                 log, metrics):  # fmt: skip
        self.cfg, self.dataset, self.runner, self.model = cfg, dataset, runner, model
        self.make_loader, self.dp_size = make_loader, dp_size
        self.log, self.metrics = log, metrics
        self.last: tuple[float, float] | None = None  # (loss, perplexity)
        self.last_at: tuple[int, float] | None = None  # (step, loss)

    def evaluate(self, step: int) -> float | None:
        if self.dataset is None:
            return None
        mbs = self.cfg.training.micro_batch_size
        n = self.cfg.training.eval_iters * mbs * self.dp_size
        loader = self.make_loader(self.dataset, 0, n, gbs=mbs * self.dp_size)
        losses = []
        # dropout off while evaluating: the flag is read when a graph compiles, and each
        # step cell keeps the graph it compiled first, so this only matters then
        self.model.set_train(False)
        for batch in loader:
            losses.append(self.runner.eval_loss(batch))
        loader.close()
        self.model.set_train(True)
        loss = float(np.mean(losses)) if losses else float("nan")
        ppl = math.exp(loss) if loss < 700 else float("inf")
        self.last = (loss, ppl)
        self.last_at = (step, loss)
        self.log(f"eval: step {step} held-out loss {loss:.4f} ppl {ppl:.2f}")
        self.metrics.event("eval", step=step, loss=loss, ppl=ppl)
        return loss
