"""The in-graph training numerics of issue 18, computed at log steps only.

- `monitor.numerics` (local norms): per parameter tensor, the gradient, parameter and update
  squared norms and the AdamW moment means, returned by `_step.TrainStep(numerics=True)`;
  `layer_numerics` reduces them per transformer layer.
- `monitor.max_logits` (MaxLogits): the largest attention logit q.k/sqrt(d) of each layer
  over the positions the mask allows, and the fraction of tokens (under the loss mask)
  whose top output logit exceeds `monitor.output_logit_bound`, on the step's last
  micro-batch with the weights before the update. Llama: `LossWithLogitStats`, the loss
  net of the log step's train graph, takes them from the step's own forward (the scores
  from each layer's q/k, the fraction from the logits the loss reads) and leaves them in
  a buffer; DeepSeek-V3 (MLA): `MLALogitStats`, a forward-only graph of its own.

The runner runs these graphs only at the steps whose record is written
(`NumericsFields.wanted`), so a step between two log steps runs exactly the plain step.
"""

from __future__ import annotations

import math

import numpy as np

# columns of TrainStep's numerics output, per parameter tensor
NUMERICS = ("grad_sq", "param_sq", "update_sq", "adam_m_abs_mean", "adam_sqrt_v_mean")


def layer_numerics(names: list[str], sizes: list[int], rows: np.ndarray) -> dict[str, list]:
    """Per transformer layer (tensors named `layers.N.*`), from TrainStep's numerics rows:
    the gradient norm (unscaled, before clipping), the parameter norm before the update,
    the update/weight ratio |w_after - w_before| / |w_before|, and the element-weighted
    mean |m| and mean sqrt(v) of the AdamW moments after it."""
    groups: dict[int, list[int]] = {}
    for i, name in enumerate(names):
        parts = name.split(".")
        if "layers" in parts[:-1]:
            at = parts.index("layers") + 1
            if at < len(parts) and parts[at].isdigit():
                groups.setdefault(int(parts[at]), []).append(i)
    out: dict[str, list] = {"grad_norm_layers": [], "param_norm_layers": [],
                            "update_ratio_layers": [], "adam_m_layers": [],
                            "adam_sqrt_v_layers": []}  # fmt: skip
    for layer in sorted(groups):
        idx = groups[layer]
        r = rows[idx].astype(np.float64)
        n = np.array([sizes[i] for i in idx], np.float64)
        w = math.sqrt(r[:, 1].sum())
        out["grad_norm_layers"].append(math.sqrt(r[:, 0].sum()))
        out["param_norm_layers"].append(w)
        out["update_ratio_layers"].append(math.sqrt(r[:, 2].sum()) / w if w > 0 else math.nan)
        out["adam_m_layers"].append(float((r[:, 3] * n).sum() / n.sum()))
        out["adam_sqrt_v_layers"].append(float((r[:, 4] * n).sum() / n.sum()))
    return out


class NumericsFields:
    """The newest log step's statistics (Tensors, read only when its record is written)
    and their metrics fields. `rows`: TrainStep's numerics rows; `logits`: LogitStats'
    (max attention logit per layer, fraction of tokens over the output bound). The runner
    clears both on steps it computes neither, so a record forced between two log steps
    (a stop signal) carries no stale statistics."""

    def __init__(self, weights, log_interval: int = 1, last_step: int = 0):
        self.names = [p.name for p in weights]
        self.sizes = [int(np.prod(p.shape)) for p in weights]
        self.log_interval = max(1, log_interval)
        self.last_step = last_step
        self.rows = None
        self.logits = None

    def wanted(self, step: int) -> bool:
        """Whether `step`'s record is written on schedule (the trainer's rule)."""
        return step % self.log_interval == 0 or step == self.last_step

    def clear(self) -> None:
        self.rows = self.logits = None

    def fields(self) -> dict[str, list | float]:
        out: dict[str, list | float] = {}
        if self.rows is not None:
            rows = self.rows if isinstance(self.rows, np.ndarray) else self.rows.asnumpy()
            out.update(layer_numerics(self.names, self.sizes, rows))
        if self.logits is not None:
            if isinstance(self.logits, tuple):  # MLALogitStats: (per layer, fraction)
                per_layer, frac = (x.asnumpy() for x in self.logits)
            else:  # LossWithLogitStats' buffer: the per-layer maxima, then the fraction
                got = self.logits.asnumpy()
                per_layer, frac = got[:-1], got[-1]
            out["max_logits"] = [float(x) for x in per_layer]
            out["logits_over_bound_frac"] = float(frac)
        return out


def loss_with_logit_stats(loss_net, bound: float):
    """Llama: a loss net over `loss_net`'s model (a LlamaWithLoss) that computes the same
    loss and leaves the MaxLogits of its forward in `.stats` (see LossWithLogitStats)."""
    from mindloom_train._logit_stats import LossWithLogitStats

    return LossWithLogitStats(loss_net, bound)


def logit_stats(model, bound: float):
    """DeepSeek-V3: an `MLALogitStats` forward over `model` (a DeepseekV3)."""
    from mindloom_train._logit_stats import MLALogitStats

    return MLALogitStats(model, bound)
