"""The compiled steps' per-parameter work as HyperMap functions over the parameter tuples
(`_step` maps them); the same ops per element as a loop, so the same floats."""

from __future__ import annotations

import mindspore as ms
from mindspore import ops

__all__ = []  # private to _step

_adamw = ops.AdamWeightDecay()

# Per-parameter work as HyperMap over the parameter tuples, not Python loops in construct:
# MindSpore's frontend parses and type-infers an unrolled loop of tuple concatenations per
# element, ~50 ms per parameter and loop (a 130-tensor loop compiled in 6.9 s against 1.0 s
# as a HyperMap, measured in session 15), which was most of the compile of an update graph.
# The same ops per element, so the same floats.
_map = ops.HyperMap()
_accumulate = ops.MultitypeFuncGraph("accumulate")
_plus_buffer = ops.MultitypeFuncGraph("plus_buffer")
_copy = ops.MultitypeFuncGraph("copy")
_square_sum = ops.MultitypeFuncGraph("square_sum")
_adamw_update = ops.MultitypeFuncGraph("adamw_update")
_zero = ops.MultitypeFuncGraph("zero")
_after = ops.MultitypeFuncGraph("after")


@_accumulate.register("Tensor", "Tensor")
def _accumulate_one(acc, g):
    return ops.assign_add(acc, g.astype(ms.float32))


@_plus_buffer.register("Tensor", "Tensor")
def _plus_buffer_one(g, acc):
    return g.astype(ms.float32) + acc


@_copy.register("Tensor")
def _copy_one(x):
    return x * 1.0


@_square_sum.register("Tensor")
def _square_sum_one(g):
    # [1, n] x [n, 1]: MindSpore's CPU ReduceSum is several times slower on these sizes
    flat = g.astype(ms.float32).reshape(1, -1)
    return ops.matmul(flat, flat.T).reshape(())


# lr, beta1, beta2, eps, weight decay, gradient factor (bound by partial); weight, exp_avg,
# exp_avg_sq, its decay flag, gradient (mapped). A signature that matches no registration
# runs as interpreted Python (PyExecute), which MindIR cannot hold: the compile cache fails
@_adamw_update.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                        "Tensor", "Tensor", "Tensor", "Number", "Tensor")  # fmt: skip
def _adamw_update_one(lr, b1, b2, eps, wd, factor, w, m, v, flag, g):
    return _adamw(w, m, v, lr, b1, b2, eps, wd * flag, g.astype(ms.float32) * factor)


def adamw_kernel_update(kernel) -> ops.MultitypeFuncGraph | None:
    """`_adamw_update` on mindloom_model's fused in-place kernel (`adamw_kernel`): the same
    values to the bit in one pass (None without a kernel). Bound by partial: the kernel's
    scalars for decayed and for plain tensors (`kernel_scalars`); mapped as
    `_adamw_update`."""
    if kernel is None:
        return None
    update = ops.MultitypeFuncGraph("adamw_kernel_update")

    @update.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Number", "Tensor")
    def _one(decayed, plain, w, m, v, flag, g):
        return kernel(w, m, v, g.astype(ms.float32), decayed if flag else plain)

    return update


def kernel_scalars(lr, b1, b2, eps, wd, factor):
    """The kernel's [6] scalars for the tensors that decay and for those that do not (the
    portable map's `wd * flag`)."""
    f = factor.astype(ms.float32)
    return ops.stack((lr, b1, b2, eps, wd, f)), ops.stack((lr, b1, b2, eps, wd * 0.0, f))


@_zero.register("Tensor")
def _zero_one(acc):
    return ops.assign(acc, ops.zeros_like(acc))


@_after.register("Tensor", "Tensor")
def _after_one(first, x):
    # x, made to wait for `first`: each numerics update after its weight's copy (mapped
    # over both tuples), or every gradient after one collective's result (`first` bound
    # by partial: orders collectives between ZeRO-1 / ep graphs that differ)
    return ops.depend(x, first)


def sum_all(x, r: int, c: int):
    """The sum of all elements of `x` (r * c of them) as ones[1, r] @ x[r, c] @ ones[c, 1]:
    on MindSpore's CPU backend ~4x faster than ReduceSum/ReduceMean of the whole tensor and
    ~2x faster than a [1, n] x [n, 1] matmul on the 17m preset's tensors (with those the
    statistics took ~0.6 s of a 1.6 s step)."""
    left = ops.ones((1, r), ms.float32)
    right = ops.ones((c, 1), ms.float32)
    return ops.matmul(ops.matmul(left, x.reshape(r, c)), right).reshape(())


_numerics_row = ops.MultitypeFuncGraph("numerics_row")


@_numerics_row.register(
    "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tuple"
)
def _numerics_row_one(loss, inv, weight, before, exp_avg, exp_avg_sq, sq, view):
    """NUMERICS of one tensor after the update (each read waits for `loss`, i.e. the
    update): [grad norm^2, param norm^2 before, update norm^2, mean |m|, mean sqrt(v)]."""
    after = ops.depend(weight, loss)
    d = after - before
    m = ops.abs(ops.depend(exp_avg, loss))
    v = ops.sqrt(ops.depend(exp_avg_sq, loss))
    r, c = view
    return ops.stack((
        sq * inv * inv,
        sum_all(before * before, r, c),
        sum_all(d * d, r, c),
        sum_all(m, r, c) / (r * c),
        sum_all(v, r, c) / (r * c),
    ))  # fmt: skip
