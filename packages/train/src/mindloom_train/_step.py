"""The compiled train step: forward, loss, backward, global grad norm, guards, clip, AdamW.

One MindSpore graph does the whole update, so the host only feeds a batch and a small
vector of per-step scalars (`hyper`) and reads back (loss, grad norm, ok). The update is
applied only when `ok` (finite loss and grad norm, grad norm under the spike threshold);
otherwise weights and optimizer state are untouched.

AdamW is MindSpore's fused `AdamWeightDecay` (or, with the CPU kernels, mindloom_model's
`KernelAdamW`: the same bits in one pass, in place) with torch's bias correction folded
into its scalars: lr' = lr*sqrt(bc2)/bc1, eps' = eps*sqrt(bc2), wd' = wd*bc1/sqrt(bc2), which
gives exactly p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p). Moments are fp32.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindloom_model import adamw_kernel, square_sums_kernel
from mindspore import Parameter, Tensor, nn, ops

# layout of the `hyper` vector fed to every step
H_LR, H_B1, H_B2, H_EPS, H_WD, H_CLIP, H_SPIKE, H_SCALE, H_LPOISON, H_GPOISON, H_GMULT = range(11)
H_PREV_LOSS, H_NMICRO, H_STOP = 11, 12, 13
H_SIZE = 14

from mindloom_train._step_maps import (  # noqa: E402
    _accumulate,
    _adamw_update,
    _after,
    _copy,
    _map,
    _numerics_row,
    _plus_buffer,
    _square_sum,
    _zero,
    adamw_kernel_update,
    kernel_scalars,
)


def decay_flags(params, decay_embeddings: bool) -> list[float]:
    """1.0 for weights that decay: matrices; never norms/biases (1-D); embeddings optional."""

    def is_embed(p) -> bool:
        return p.name.startswith("embed") or "embed" in p.name.split(".")[0]

    return [0.0 if p.ndim < 2 or (is_embed(p) and not decay_embeddings) else 1.0 for p in params]


class _Base(nn.Cell):
    def _grads(self, tokens, labels, position_ids, segment_ids, loss_mask, scale, dkey=None):
        # dkey: mindloom_model.dropout_key(seed, step, micro-batch), None without dropout
        # (then the loss net sees exactly the five inputs it always had)
        args = (tokens, labels, position_ids, segment_ids, loss_mask)
        if dkey is not None:
            args = args + (dkey,)
        loss = self.loss_net(*args)
        sens = ops.fill(loss.dtype, (), 1.0) * scale
        grads = self.grad(self.loss_net, self.weights)(*args, sens)
        return loss, grads

    def _grads_moe(self, tokens, labels, position_ids, segment_ids, loss_mask, scale):
        # the MoE loss net returns (loss, stats); stats carry no gradient (zero sens)
        loss, stats = self.loss_net(tokens, labels, position_ids, segment_ids, loss_mask)
        sens = (ops.fill(loss.dtype, (), 1.0) * scale, ops.zeros_like(stats))
        grads = self.grad(self.loss_net, self.weights)(
            tokens, labels, position_ids, segment_ids, loss_mask, sens
        )
        return loss, grads, stats


class AccumStep(_Base):
    """A non-final micro-batch of an accumulated step: add its (scaled) grads to buffers."""

    def __init__(self, loss_net: nn.Cell, weights, acc, moe: nn.Cell | None = None):
        super().__init__(auto_prefix=False)
        self.loss_net = loss_net
        self.weights = weights
        self.acc = acc
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.moe = moe  # _moe.MoEStepParts of the TrainStep: its stats buffer

    def construct(self, tokens, labels, position_ids, segment_ids, loss_mask, hyper, dkey=None):
        if self.moe is not None:  # DeepSeek-V3 keeps MindSpore's dropout: no dkey
            loss, grads, stats = self._grads_moe(
                tokens, labels, position_ids, segment_ids, loss_mask, hyper[H_SCALE]
            )
            loss = ops.depend(loss, self.moe.accumulate(stats))
        else:
            loss, grads = self._grads(
                tokens, labels, position_ids, segment_ids, loss_mask, hyper[H_SCALE], dkey
            )
        return ops.depend(loss, _map(_accumulate, self.acc, grads))


def _model_config(loss_net):
    """The model's config in any cell of the loss net (DeepSeek-V3's wrap it deeper)."""
    cells = (c for _, c in loss_net.cells_and_names()) if loss_net is not None else ()
    return next((c.config for c in cells if hasattr(getattr(c, "config", None), "kernels")), None)


class TrainStep(_Base):
    """The final (or only) micro-batch of a step, and the optimizer update."""

    def __init__(
        self,
        loss_net: nn.Cell,
        weights,
        flags: list[float],
        accum_steps: int = 1,
        grad_reducer: nn.Cell | None = None,
        loss_reducer: nn.Cell | None = None,
        moe: nn.Cell | None = None,
        numerics: bool = False,
        share: TrainStep | None = None,
        norm_reducer: nn.Cell | None = None,
        zero: nn.Cell | None = None,
    ):
        super().__init__(auto_prefix=False)
        # ZeRO-1 (mindloom_parallel.ZeroShardUpdate): AdamW on the owned parameters only,
        # with their moments, then the owners' values shared with every replica
        self.zero = zero
        self.loss_net = loss_net
        self.weights = weights
        self.flags = tuple(flags)  # a tuple: HyperMap maps it beside the parameter tuples
        # off (the default): the graph is exactly the plain step's. On: the step also
        # returns NUMERICS per parameter tensor (see layer_numerics)
        self.numerics = numerics
        self.views = tuple(sum_view(int(np.prod(p.shape))) for p in weights) if numerics else ()
        self.accum_steps = accum_steps
        if share is not None:
            # a second graph of the same step (numerics on, called at log steps only; or
            # the update of an accumulated step, `UpdateStep`): it updates the very same
            # moments and accumulation buffers as `share`
            self.exp_avg, self.exp_avg_sq, self.acc = share.exp_avg, share.exp_avg_sq, share.acc
        elif zero is not None:
            self.exp_avg, self.exp_avg_sq = zero.exp_avg, zero.exp_avg_sq
            self.acc = None
            if accum_steps > 1:
                self._own_state(weights, accum_steps, moments=False)
        else:
            self._own_state(weights, accum_steps)
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.grad_reducer = grad_reducer
        self.loss_reducer = loss_reducer
        # tensor parallel: the per-tensor squared norms of local shards -> the global sum
        self.norm_reducer = norm_reducer
        # _moe.MoEStepParts (DeepSeek-V3): the step also returns the MoE stats and moves
        # the expert biases after an applied update
        self.moe = moe
        # the kernels' every squared norm in one call, else a [1, n] x [n, 1] matmul per
        # tensor; not under tp, whose reducer weighs the per-tensor values
        cfg = _model_config(loss_net) if share is None else None
        self.square_sums = share.square_sums if share is not None else None
        if cfg is not None and norm_reducer is None:
            self.square_sums = square_sums_kernel(cfg, len(weights))
        # the kernels' in-place AdamW (_adamw), else MindSpore's AdamWeightDecay
        self.adamw = share.adamw if share is not None else adamw_kernel_update(adamw_kernel(cfg))

    def _adamw(self, hyper, factor, grads):
        lr, b1, b2, eps, wd = hyper[H_LR], hyper[H_B1], hyper[H_B2], hyper[H_EPS], hyper[H_WD]
        update = ops.partial(_adamw_update, lr, b1, b2, eps, wd, factor)
        if self.adamw is not None:  # the same bits, in place, in one pass
            decayed, plain = kernel_scalars(lr, b1, b2, eps, wd, factor)
            update = ops.partial(self.adamw, decayed, plain)
        return _map(update, self.weights, self.exp_avg, self.exp_avg_sq, self.flags, grads)

    def sibling(self, cls=None, loss_net=None, numerics: bool = False) -> TrainStep:
        """Another graph of this step over the same state (moments, buffers) and the same
        reducers: the numerics log step (`loss_net` the MaxLogits one where asked), or
        `UpdateStep` (no forward: it gets no loss net)."""
        cls = TrainStep if cls is None else cls
        return cls(loss_net, self.weights, list(self.flags), self.accum_steps,
                   self.grad_reducer, self.loss_reducer, moe=self.moe, numerics=numerics,
                   share=self, norm_reducer=self.norm_reducer, zero=self.zero)  # fmt: skip

    def _own_state(self, weights, accum_steps: int, moments: bool = True) -> None:
        def zeros(prefix: str) -> ms.ParameterTuple:
            return ms.ParameterTuple([Parameter(np.zeros(p.shape, np.float32), name=prefix + p.name,
                                                requires_grad=False) for p in weights])  # fmt: skip

        if moments:
            self.exp_avg, self.exp_avg_sq = zeros("exp_avg."), zeros("exp_avg_sq.")
        # called without moments only to add the buffers (ZeRO-1 accumulating)
        self.acc = zeros("grad_acc.") if accum_steps > 1 or not moments else None

    def construct(self, tokens, labels, position_ids, segment_ids, loss_mask, hyper, dkey=None):
        scale = hyper[H_SCALE]
        stats = None
        if self.moe is not None:
            loss, grads, stats = self._grads_moe(
                tokens, labels, position_ids, segment_ids, loss_mask, scale
            )
        else:
            loss, grads = self._grads(
                tokens, labels, position_ids, segment_ids, loss_mask, scale, dkey
            )
        return self._update(loss, grads, stats, hyper, False)

    def _update(self, loss, grads, stats, hyper, summed: bool):
        """Everything after the backward: `grads` are this micro-batch's (the buffers are
        added here) or, `summed`, the buffers' own sum of every micro-batch."""
        scale = hyper[H_SCALE]
        if self.moe is not None:
            if self.zero is not None:
                # ZeRO-1 ranks' graphs differ (each updates other tensors), so every
                # collective is put in one order: the backward's (ep exchange), the stats'
                # all-reduce, the gradient buckets, the loss, the norm, the share
                stats = ops.depend(stats, grads)
            stats = self.moe.finish(stats, hyper[H_NMICRO])
            if self.zero is not None:
                grads = _map(ops.partial(_after, stats), grads)
        # grads stay raw (loss-scaled, summed over micro-batches) until the update: the
        # unscaling multiplier `inv` is folded into the clip factor, so each gradient is
        # multiplied once, and its squared norm is a [1, n] x [n, 1] matmul (MindSpore's
        # CPU ReduceSum is several times slower than the matmul on these sizes)
        inv = hyper[H_GMULT] / (scale * hyper[H_NMICRO])
        if self.acc is not None and not summed:
            grads = _map(_plus_buffer, grads, self.acc)
        # mean micro-batch loss over the step; then test-only poison (0.0 = exact no-op)
        loss = (loss.astype(ms.float32) + hyper[H_PREV_LOSS]) / hyper[H_NMICRO] + hyper[H_LPOISON]
        if self.zero is not None:
            # test-only poison before the reduction: one rank's Inf reaches every rank's
            # norm, so all skip together (ZeRO-1 replicas must take the same branch)
            grads = (grads[0] + hyper[H_GPOISON],) + grads[1:]
        if self.grad_reducer is not None:
            grads = self.grad_reducer(grads)
        stop = hyper[H_STOP]
        if self.zero is not None:  # one order of collectives on ranks whose graphs differ
            loss = ops.depend(loss, grads)
        if self.loss_reducer is not None:
            # one all-reduce carries the loss and the stop flag: every rank agrees on both
            both = self.loss_reducer(ops.concat((loss.reshape(1), stop.reshape(1))))
            loss, stop = both[0], both[1]
        if self.zero is None:
            grads = (grads[0] + hyper[H_GPOISON],) + grads[1:]
        if self.zero is not None and self.norm_reducer is not None:
            grads = _map(ops.partial(_after, loss), grads)  # the norm's all-reduce after the loss's
        if self.square_sums is not None:
            sums = self.square_sums(*grads)  # [n + 1]: each tensor's, then the total
            total = sums[len(grads)]
            sq = ops.unstack(sums[: len(grads)]) if self.numerics else ()
        else:
            sq = _map(_square_sum, grads)
            total = ops.addn(sq) if self.norm_reducer is None else self.norm_reducer(sq)
        gnorm = ops.sqrt(total) * ops.abs(inv)
        ok = ops.logical_and(ops.isfinite(loss), ops.isfinite(gnorm))
        ok = ops.logical_and(ok, gnorm <= hyper[H_SPIKE])
        clip = hyper[H_CLIP]
        factor = ops.select(
            clip > 0, ops.minimum(clip / (gnorm + 1e-6), 1.0), ops.ones((), ms.float32)
        )
        factor = factor * inv
        before = ()
        if self.numerics:
            # copies of the weights as they were; each update below waits for its copy
            before = _map(_copy, self.weights)
            grads = _map(_after, before, grads)
        if self.zero is not None:
            if ok:
                loss = self.zero.update(grads, factor, hyper[H_LR], hyper[H_B1], hyper[H_B2],
                                        hyper[H_EPS], hyper[H_WD], loss)  # fmt: skip
            # outside the branch: every rank joins the share whether the update ran or not
            loss = self.zero.share(loss)
        elif ok:
            loss = ops.depend(loss, self._adamw(hyper, factor, grads))
        if self.acc is not None:
            loss = ops.depend(loss, _map(_zero, self.acc))
        if self.moe is not None:
            loss = self.moe.update(stats, ok, loss)
            if self.numerics:
                return loss, gnorm, ok, stop, stats, self._numerics(loss, sq, inv, before)
            return loss, gnorm, ok, stop, stats
        if self.numerics:
            return loss, gnorm, ok, stop, self._numerics(loss, sq, inv, before)
        return loss, gnorm, ok, stop

    def _numerics(self, loss, sq, inv, before):
        """[n tensors, 5]: NUMERICS of each parameter tensor after this step's update."""
        rows = _map(ops.partial(_numerics_row, loss, inv), self.weights, before, self.exp_avg,
                    self.exp_avg_sq, sq, self.views)  # fmt: skip
        return ops.stack(rows)


class UpdateStep(TrainStep):
    """The update of an accumulated step (several micro-batches) as a graph of its own:
    every micro-batch, the last one included, runs `AccumStep` (forward, backward, grads
    added to the buffers), then this graph does what `TrainStep` does after its backward,
    on the buffers' sums. Two graphs, forward+backward compiled once: a fused `TrainStep`
    for the last micro-batch repeated the whole forward and backward in a second graph,
    which doubled the compile (session 15 measured it). The sums are the same floats
    (IEEE addition commutes: g_last + (g_1 + ...) == (g_1 + ...) + g_last). Its state
    (moments, buffers) is the `TrainStep`'s it is built from (`share`)."""

    def construct(self, loss, hyper):
        stats = None
        if self.moe is not None:  # every micro-batch's stats are in the buffer already
            stats = ops.zeros_like(self.moe.acc)
        # values of their own: the buffers are emptied at the end of this graph
        grads = _map(_copy, self.acc)
        return self._update(loss, grads, stats, hyper, True)


def sum_view(n: int) -> tuple[int, int]:
    """(r, c) with r * c = n, r the largest divisor of n up to its square root."""
    r = max(1, math.isqrt(n))
    while n % r:
        r -= 1
    return r, n // r


# the numerics' host side lives in _numerics (these names stay importable from here)
from mindloom_train._numerics import NUMERICS, NumericsFields, layer_numerics  # noqa: E402,F401


class MeanOver(nn.Cell):
    """Mean of a tensor over a process group (the data-parallel ranks)."""

    def __init__(self, group_name: str, size: int):
        super().__init__()
        self.op = ops.AllReduce(ops.ReduceOp.SUM, group=group_name)
        self.inv = 1.0 / size

    def construct(self, x):
        return self.op(x) * self.inv


class EvalStep(nn.Cell):
    def __init__(self, loss_net: nn.Cell, loss_reducer: nn.Cell | None = None):
        super().__init__(auto_prefix=False)
        self.loss_net = loss_net
        self.loss_reducer = loss_reducer

    def construct(self, tokens, labels, position_ids, segment_ids, loss_mask):
        loss = self.loss_net(tokens, labels, position_ids, segment_ids, loss_mask)
        if self.loss_reducer is not None:
            loss = self.loss_reducer(loss)
        return loss


def hyper_vector(
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_step: int,
    clip: float,
    spike: float | None,
    loss_scale: float,
    nan_loss: bool = False,
    inf_grad: bool = False,
    grad_mult: float = 1.0,
    prev_loss_sum: float = 0.0,
    n_micro: int = 1,
    stop: bool = False,
) -> Tensor:
    """Per-step scalars; `adam_step` is the 1-based count of applied updates (bias correction)."""
    bc1 = 1.0 - beta1**adam_step
    bc2 = 1.0 - beta2**adam_step
    h = np.zeros(H_SIZE, np.float32)
    h[H_LR] = lr * math.sqrt(bc2) / bc1
    h[H_B1], h[H_B2] = beta1, beta2
    h[H_EPS] = eps * math.sqrt(bc2)
    h[H_WD] = weight_decay * bc1 / math.sqrt(bc2)
    h[H_CLIP] = clip
    h[H_SPIKE] = np.inf if spike is None else spike
    h[H_SCALE] = loss_scale
    h[H_LPOISON] = np.nan if nan_loss else 0.0
    h[H_GPOISON] = np.inf if inf_grad else 0.0
    h[H_GMULT] = grad_mult
    h[H_PREV_LOSS] = prev_loss_sum
    h[H_NMICRO] = n_micro
    h[H_STOP] = 1.0 if stop else 0.0
    return Tensor(h)
