"""The DeepSeek-V3 (MoE) parts of the train step and of the metrics.

The loss net returns (loss, stats) where stats is one fp32 vector

    [main CE, MTP loss (mean over depths), balance loss (unweighted), dropped token slots
     (a capacity factor's), loads [R, E] flattened]

R = the MoE routers in `moe_routers` order (trunk MoE layers, then the MTP blocks'), E
routed experts. The step sums stats over micro-batches (a buffer the accumulation steps
add to) and over data-parallel ranks (one all-reduce), so every rank sees the loads of
the whole global batch; after the optimizer update, and only when it was applied, every
router's selection bias moves by `moe_bias_update_speed` towards even load:
b_e += speed * sign(mean(load) - load_e), as `mindloom_model.update_expert_bias` does.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

N_SCALARS = 4  # main, mtp, balance, dropped
S_MAIN, S_MTP, S_BAL, S_DROP = range(N_SCALARS)


def is_moe(mcfg) -> bool:
    return getattr(mcfg, "family", "llama") == "deepseek_v3"


class MoELossNet(nn.Cell):
    """(tokens, labels, position_ids, segment_ids, loss_mask) -> (loss, stats)."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        from mindloom_model import DeepseekV3WithLoss

        self.inner = DeepseekV3WithLoss(model)
        self.aux_weight = float(model.config.moe_aux_loss_weight)
        # a trunk without MoE layers still returns one (zero) load row: not a router
        self.skip_row = 1 if model.n_moe == 0 else 0

    def construct(self, tokens, labels, position_ids, segment_ids, loss_mask):
        loss, main, mtp, aux, loads, dropped = self.inner(
            tokens, labels, position_ids, segment_ids, loss_mask
        )
        bal = aux / self.aux_weight if self.aux_weight > 0 else aux
        head = ops.stack((main, mtp, bal, dropped)).astype(ms.float32)
        stats = ops.concat((head, loads[self.skip_row :].reshape(-1).astype(ms.float32)))
        return loss, ops.stop_gradient(stats)


class MoEEvalNet(nn.Cell):
    """The held-out loss: the main model's next-token CE (no MTP, no balance term)."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        from mindloom_model import causal_lm_loss

        self.model = model
        self.ce = causal_lm_loss

    def construct(self, tokens, labels, position_ids, segment_ids, loss_mask):
        return self.ce(self.model(tokens, position_ids, segment_ids), labels, loss_mask)


class MoEStepParts(nn.Cell):
    """The in-graph MoE state of a step: the micro-batch stats buffer, the data-parallel
    reduction of the stats and the expert-bias update."""

    def __init__(self, model, dp_group: str | None = None, dp_size: int = 1,
                 keep_local: bool = False):  # fmt: skip
        super().__init__(auto_prefix=False)
        from mindloom_model import moe_routers

        cfg = model.config
        self.biases = ms.ParameterTuple([r.expert_bias for r in moe_routers(model)])
        self.n_routers = len(self.biases)
        self.e = cfg.n_routed_experts
        self.speed = float(cfg.moe_bias_update_speed)
        size = N_SCALARS + self.n_routers * self.e
        self.acc = Parameter(np.zeros(size, np.float32), name="moe_stats_acc", requires_grad=False)
        self.reduce = ops.AllReduce(ops.ReduceOp.SUM, group=dp_group) if dp_group else None
        self.dp_size = dp_size
        # expert parallel: this rank's own loads of the step (before the dp sum), read by
        # the host for the tokens each rank sends and receives
        self.local_loads = (
            Parameter(np.zeros(self.n_routers * self.e, np.float32), name="moe_local_loads",
                      requires_grad=False) if keep_local else None
        )  # fmt: skip

    def accumulate(self, stats):
        return ops.assign_add(self.acc, stats)

    def finish(self, stats, n_micro):
        """This micro-batch's stats + the buffered ones, summed over dp; the losses become
        means over micro-batches and ranks, the dropped slots and the loads stay counts
        (the whole global batch's)."""
        stats = stats + self.acc
        if self.local_loads is not None:
            stats = ops.depend(stats, ops.assign(self.local_loads, stats[N_SCALARS:]))
        if self.reduce is not None:
            stats = self.reduce(stats)
        mean = ops.concat((stats[:S_DROP] / (n_micro * self.dp_size), stats[S_DROP:]))
        return mean

    def update(self, stats, ok, loss):
        """After the optimizer update: bias += speed * sign(mean load - load) where `ok`;
        the stats buffer is emptied for the next step. Returns `loss` made to wait on it."""
        loads = stats[N_SCALARS:].reshape(self.n_routers, self.e)
        # sign(sum - E * load) = sign(mean - load), in exact integer arithmetic
        step = ops.sign(loads.sum(-1, keepdims=True) - self.e * loads) * self.speed
        step = step * ok.astype(ms.float32)  # +-0 when the update was skipped
        for i in range(self.n_routers):
            loss = ops.depend(loss, ops.assign(self.biases[i], self.biases[i] + step[i]))
        loss = ops.depend(loss, ops.assign(self.acc, ops.zeros_like(self.acc)))
        return loss


def moe_bias_values(model) -> np.ndarray:
    """[R, E] the routers' current selection biases."""
    from mindloom_model import moe_routers

    return np.stack([r.expert_bias.asnumpy() for r in moe_routers(model)])


class MoEWindow:
    """Host-side sums of the step stats over one metrics log window."""

    def __init__(self, n_routers: int, n_experts: int, balance_on: bool):
        self.shape = (n_routers, n_experts)
        self.balance_on = balance_on
        self.reset()

    def reset(self) -> None:
        self.loads = np.zeros(self.shape, np.float64)
        self.main = self.mtp = self.bal = self.dropped = 0.0
        self.n = 0

    def add(self, stats: np.ndarray) -> None:
        s = np.asarray(stats, np.float64)
        self.main += s[S_MAIN]
        self.mtp += s[S_MTP]
        self.bal += s[S_BAL]
        self.dropped += s[S_DROP]
        self.loads += s[N_SCALARS:].reshape(self.shape)
        self.n += 1

    def fields(self, biases: np.ndarray) -> dict:
        """The metrics.jsonl MoE fields of this window (see the train README)."""
        if self.n == 0:
            return {}
        n = self.n
        rows = self.loads.sum(-1, keepdims=True)
        frac = self.loads / np.where(rows > 0, rows, 1.0)
        total = self.loads.sum(0)
        rec = {
            "lm_loss": self.main / n,
            "mtp_loss": self.mtp / n,
            "moe_load": frac.tolist(),
            "moe_imbalance": (frac.max(-1) / frac.mean(-1)).tolist(),
            "moe_imbalance_overall": float(total.max() / total.mean()),
            "moe_dead_experts": int((self.loads == 0).sum()),
            "moe_bias_norm": float(np.sqrt((biases.astype(np.float64) ** 2).sum())),
            # routed (token, expert) slots over a capacity, per step: every router,
            # micro-batch and rank (0 when dropless)
            "moe_dropped_tokens": self.dropped / n,
        }
        if self.balance_on:
            rec["balance_loss"] = self.bal / n
        return rec
