"""Tuple plumbing for `construct` methods over many tensors, written the way MindSpore's
frontend compiles quickly.

A tuple grown element by element in a graph (`t = t + (x,)` in a loop) is specialised
step by step, each step a new tuple, and `ops.split` with a tuple of sizes is a Python
loop of strided slices compiled as one. On a 60-tensor gradient tuple the two took 5.2 s
of graph compile where one `HyperMap`, tuple slices and the `SplitWithSize` primitive
took 0.6 s; at 120 tensors the loops exceeded MindSpore's call-depth limit (measured
2026-12-04, docs/testing.md "Session 24"). The values are the same ops' (reshape,
concat, split), so nothing numeric changes.

Selections are passed as contiguous runs (`runs`): a parameter list's dense tensors, or
one rank's owned ones, come in a few runs, and a loop over a few runs is cheap."""

from __future__ import annotations

import mindspore as ms
from mindspore import ops
from mindspore.ops.auto_generate import SplitWithSize

__all__ = [
    "SplitWithSize",
    "add_f32",
    "contiguous_reversed",
    "flatten",
    "reshape_to",
    "runs",
    "take_runs",
    "to_f32",
]

flatten = ops.MultitypeFuncGraph("flatten")
reshape_to = ops.MultitypeFuncGraph("reshape_to")


@flatten.register("Tensor")
def _flatten(t):
    return t.reshape(-1)


@reshape_to.register("Tensor", "Tuple")
def _reshape_to(t, shape):
    return t.reshape(shape)


def contiguous_reversed(bucket: tuple[int, ...]) -> tuple[int, int] | None:
    """(lo, hi) when `bucket` is hi-1, hi-2, ..., lo (make_buckets' form), else None."""
    hi = bucket[0] + 1
    lo = hi - len(bucket)
    return (lo, hi) if tuple(range(hi - 1, lo - 1, -1)) == tuple(bucket) else None


def runs(indices) -> tuple[tuple[int, int], ...]:
    """Ascending `indices` as contiguous (lo, hi) runs: (0, 1, 2, 5, 6) -> ((0, 3), (5, 7))."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((lo, hi) for lo, hi in out)


def take_runs(items, spans):
    """`items[lo:hi]` of every (lo, hi) in `spans` (`runs`' output), concatenated; called in
    `construct`: a few tuple slices, not one tuple grown per element."""
    out = ()
    for r in range(len(spans)):
        lo, hi = spans[r]
        out = out + items[lo:hi]
    return out


to_f32 = ops.MultitypeFuncGraph("to_f32")
add_f32 = ops.MultitypeFuncGraph("add_f32")


@to_f32.register("Tensor")
def _to_f32(g):
    return g.astype(ms.float32)


@add_f32.register("Tensor", "Tensor")
def _add_f32(acc, g):
    """A micro-batch's gradient added to its fp32 accumulator."""
    return acc + g.astype(ms.float32)
