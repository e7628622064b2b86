"""Data parallel: the bucketed gradient all-reduce (ZeRO-1 is in ``_zero``)."""

from __future__ import annotations

import numpy as np
from mindspore import nn, ops

from mindloom_parallel._graph_tuples import SplitWithSize, contiguous_reversed, flatten, reshape_to
from mindloom_parallel._groups import Group

__all__ = ["GradReducer", "make_buckets"]


def make_buckets(sizes_bytes: list[int], bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Group parameter indices into buckets of about ``bucket_bytes``, last parameter first
    (backward produces the last layers' gradients first, as in PyTorch DDP)."""
    buckets, cur, cur_bytes = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        cur.append(i)
        cur_bytes += sizes_bytes[i]
        if cur_bytes >= bucket_bytes:
            buckets.append(tuple(cur))
            cur, cur_bytes = [], 0
    if cur:
        buckets.append(tuple(cur))
    return tuple(buckets)


class GradReducer(nn.Cell):
    """Sum gradients over the data-parallel group, one all-reduce per bucket.

    A Cell: call it on the gradient tuple inside a compiled train step (GRAPH_MODE or
    ``@ms.jit``) as well as in PyNative. The buckets are fixed at construction (static
    shapes), so the compiled graph holds one AllReduce per bucket. ``mean=True`` divides by
    the group size (use it when each rank's loss is its own mean); ``ParallelEngine``
    normalizes the loss by the global token count instead and sums.
    """

    def __init__(self, params, group: Group, bucket_size_mb: float = 25.0, mean: bool = False):
        super().__init__()
        self.group = group
        self.shapes = tuple(tuple(p.shape) for p in params)
        sizes = [int(np.prod(s)) * 4 for s in self.shapes]
        self.buckets = make_buckets(sizes, int(bucket_size_mb * 2**20))
        self.bucket_sizes = tuple(tuple(sizes[i] // 4 for i in b) for b in self.buckets)
        order = [i for b in self.buckets for i in b]
        self.scale = 1.0 / group.size if mean else 1.0
        self.allreduce = (
            ops.AllReduce(ops.ReduceOp.SUM, group=group.name) if group.size > 1 else None
        )
        # make_buckets' buckets are contiguous runs, last tensor first: each is one tuple
        # slice, reversed, and the pieces of all buckets in order are the tensors reversed
        self.bounds = tuple(contiguous_reversed(b) for b in self.buckets)
        assert all(self.bounds) and order == list(reversed(range(len(self.shapes))))
        self.map = ops.HyperMap()
        self.split = SplitWithSize()

    def construct(self, grads):
        if self.allreduce is None:
            return grads
        pieces = ()
        reduced = None
        for b in range(len(self.buckets)):
            lo, hi = self.bounds[b]
            flat = ops.concat(self.map(flatten, grads[lo:hi][::-1]))
            if reduced is not None:
                # the buckets' all-reduces in one order on every rank: nothing else orders
                # them, and ranks whose graphs differ (ZeRO-1 updates other tensors) were
                # scheduled in different orders (a 2-rank all-reduce then paired two
                # buckets of different sizes)
                flat = ops.depend(flat, reduced)
            reduced = self.allreduce(flat)
            if self.scale != 1.0:
                reduced = reduced * self.scale
            pieces = pieces + self.split(reduced, self.bucket_sizes[b], 0)
        return self.map(reshape_to, pieces[::-1], self.shapes)
