"""ZeRO-1 inside a compiled (GRAPH_MODE / ``jit``) train step.

``ZeroShardUpdate`` is a ``Cell`` a compiled step calls after its gradient all-reduce:

- ``update``: the fused ``AdamWeightDecay`` kernel (the compiled step's own) on the
  parameters this data-parallel rank owns, with AdamW moments held for those only;
- ``share``: the owners' new values to every replica, one all-reduce per bucket on the
  data-parallel group in which each rank contributes its owned parameters and zeros for
  the rest (adding zeros changes no bit, so every replica ends with the owner's bytes).

Each rank's graph differs (it updates other tensors), so the step's collectives must be
ordered explicitly: ``share`` chains its buckets after ``token``; the caller makes the
token wait for its gradient and loss all-reduces (MCCL fails a collective whose ranks
reach it in another order).

Ownership is ``zero_owners`` (whole parameters, largest first onto the least loaded rank),
the same as ``ZeroAdamW``'s, so a ``ZeroAdamW`` whose moment dicts point at this cell's
tensors gathers and loads checkpoints in the engine's file layout.

The all-reduce runs on any group on every backend (MCCL on CPU included); native
backends could use an all-gather of flat owner chunks instead, which moves half the
bytes; it is not wired (no multi-device machine here to check it on).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

from mindloom_parallel._dp import make_buckets
from mindloom_parallel._graph_tuples import SplitWithSize, contiguous_reversed
from mindloom_parallel._groups import Group
from mindloom_parallel._zero import zero_owners

__all__ = ["ZeroShardUpdate"]

_adamw = ops.AdamWeightDecay()

# share's per-tensor parts, mapped over a bucket (see _graph_tuples for why not a loop)
_held = ops.MultitypeFuncGraph("zero_held")
_take = ops.MultitypeFuncGraph("zero_take")


@_held.register("Tensor", "Tensor", "Bool", "Number")
def _held_value(token, param, mine, n):
    """What this rank adds to the share: its own parameter's values, else zeros."""
    if mine:
        return ops.depend(param, token).reshape(-1)
    return ops.zeros((n,), param.dtype)


@_take.register("Tensor", "Tensor", "Bool", "Tuple")
def _take_value(param, piece, mine, shape):
    """A replica's parameter set to the owner's values (an owner keeps its own)."""
    if mine:
        return ops.zeros((), ms.float32)
    return ops.depend(ops.zeros((), ms.float32), ops.assign(param, piece.reshape(shape)))


class ZeroShardUpdate(nn.Cell):
    """The owned-shard AdamW update and the owner-to-replica share of ZeRO-1, as graph ops.

    ``params``: this rank's trainable parameters (the step's weight order); ``dp``: the
    data-parallel group; ``decay_flags[i]`` multiplies parameter i's weight decay;
    ``bucket_size_mb``: the share's all-reduce bucket size (the gradient reducer's).
    ``exp_avg`` / ``exp_avg_sq`` hold one fp32 tensor per OWNED parameter (``owned``
    gives their parameter indices), named ``exp_avg.<name>`` as the compiled step's.
    """

    def __init__(self, params, dp: Group, decay_flags, bucket_size_mb: float = 25.0):
        super().__init__(auto_prefix=False)
        params = list(params)
        self.sizes = tuple(int(np.prod(p.shape)) for p in params)
        self.owner = zero_owners(self.sizes, dp.size)
        me = dp.index
        self.owned = tuple(i for i, o in enumerate(self.owner) if o == me)
        self.mine = ms.ParameterTuple([params[i] for i in self.owned])
        self.flags = tuple(float(decay_flags[i]) for i in self.owned)
        self.exp_avg = ms.ParameterTuple(
            [Parameter(np.zeros(params[i].shape, np.float32), name="exp_avg." + params[i].name,
                       requires_grad=False) for i in self.owned]
        )  # fmt: skip
        self.exp_avg_sq = ms.ParameterTuple(
            [Parameter(np.zeros(params[i].shape, np.float32), name="exp_avg_sq." + params[i].name,
                       requires_grad=False) for i in self.owned]
        )  # fmt: skip
        self.params = ms.ParameterTuple(params)
        buckets = make_buckets([4 * s for s in self.sizes], int(bucket_size_mb * 2**20))
        self.bucket_sizes = tuple(tuple(self.sizes[i] for i in b) for b in buckets)
        self.shapes = tuple(tuple(p.shape) for p in params)
        # make_buckets' buckets are contiguous runs, last tensor first: tuple slices
        self.bounds = tuple(contiguous_reversed(b) for b in buckets)
        self.mine_flags = tuple(o == me for o in self.owner)
        self.map = ops.HyperMap()
        self.split = SplitWithSize()
        # a group of one (expert state under ep = dp: the expert-data-parallel group) owns
        # everything and shares nothing
        self.allreduce = ops.AllReduce(ops.ReduceOp.SUM, group=dp.name) if dp.size > 1 else None

    @property
    def state_values(self) -> int:
        """Values of AdamW state per moment this rank keeps (all parameters' without ZeRO)."""
        return sum(self.sizes[i] for i in self.owned)

    def update(self, grads, factor, lr, beta1, beta2, eps, weight_decay, token):
        """AdamW on the owned parameters (``grads`` for ALL parameters, already reduced over
        dp; times ``factor``); returns ``token`` made to wait for every update."""
        for k in range(len(self.owned)):
            g = grads[self.owned[k]].astype(ms.float32) * factor
            r = _adamw(self.mine[k], self.exp_avg[k], self.exp_avg_sq[k], lr, beta1, beta2,
                       eps, weight_decay * self.flags[k], g)  # fmt: skip
            token = ops.depend(token, r)
        return token

    def share(self, token):
        """Every replica gets the owners' values (after whatever ``token`` waits for: the
        update, applied or skipped); returns ``token`` made to wait for the copies."""
        if self.allreduce is None:
            return token
        for b in range(len(self.bounds)):
            lo, hi = self.bounds[b]
            params, mine = self.params[lo:hi][::-1], self.mine_flags[lo:hi][::-1]
            held = self.map(ops.partial(_held, token), params, mine, self.sizes[lo:hi][::-1])
            # every bucket waits for `token` and the next for this one: the ranks' graphs
            # differ (each owns other tensors), so only explicit order keeps their
            # collectives in the same sequence (a bucket of zeros alone would run early)
            full = self.allreduce(ops.depend(ops.concat(held), token))
            token = ops.depend(token, full)
            pieces = self.split(full, self.bucket_sizes[b], 0)
            done = self.map(_take, params, pieces, mine, self.shapes[lo:hi][::-1])
            token = ops.depend(token, done)
        return token
