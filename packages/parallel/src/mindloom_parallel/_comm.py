"""The collectives module: the only place that talks to MindSpore's communication ops.

Native ops where the backend has them (HCCL on Ascend, NCCL on GPU: AllGather and
ReduceScatter on subgroups, Send/Receive). On the CPU backend (MCCL) only AllReduce(SUM)
works on subgroups, so the same semantics are built from it:

- all-gather: every rank puts its piece into a zero buffer at its own slot, all-reduce;
  adding zeros is exact, so the result is bit-identical to a native all-gather.
- reduce-scatter: all-reduce, keep this rank's slice (no bandwidth saving on CPU).
- max: all-gather then max.
- point-to-point inside a two-rank group: over a Unix socket when both ranks are on one
  host (``_hostlink``: an AllReduce costs milliseconds here and its waiting rank spins on
  a core); otherwise an AllReduce in which the sender contributes the tensor and the
  receiver zeros (an exchange puts each side's tensor in its own slot).
- ``all_reduce(..., host=True)`` of a two-rank group (the step's loss, token count and
  norm sums) goes over the same socket: ``a0 + a1`` in both ranks, which is what a
  two-rank AllReduce computes (float addition commutes), so the result is unchanged.

Everything above this module is backend-independent. Each timed call (PyNative) is added
to the ``CommStats`` of whoever is communicating, found through the group it runs on: a
``ParallelEngine`` owns a ``CommRecorder`` and gives it to its groups
(``ParallelGroups.with_recorder``), and the recorder points at the engine's ``CommStats``
while a step runs (including the collectives its tensor-parallel region cells run in
backward); other calls are not recorded. A caller can also name the ``stats`` of one call
(``all_reduce(..., stats=)``). Nothing about recording is module-wide state.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindloom_parallel._groups import Group
from mindloom_parallel._hostlink import link_between

__all__ = ["CommRecorder", "CommStats", "native_collectives"]


class CommStats:
    """Wall time spent in collectives since the last ``reset()`` (PyNative, this rank)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.time_s = 0.0
        self.calls = 0
        self.bytes = 0

    def snapshot(self) -> dict:
        return {"comm_time_s": self.time_s, "comm_calls": self.calls, "comm_bytes": self.bytes}


class CommRecorder:
    """Where the timed collectives on the groups that carry it are added: ``stats`` while
    ``recording(stats)`` is active, nowhere otherwise (see the module docstring)."""

    def __init__(self):
        self.stats: CommStats | None = None

    @contextmanager
    def recording(self, stats: CommStats | None):
        """Time the collectives on this recorder's groups into ``stats`` inside the block
        (None: leave as is)."""
        if stats is None:
            yield
            return
        previous, self.stats = self.stats, stats
        try:
            yield
        finally:
            self.stats = previous


def _record(group: Group, seconds: float, calls: int = 1, nbytes: int = 0,
            stats: CommStats | None = None) -> None:  # fmt: skip
    if stats is None:
        recorder = group.recorder
        stats = recorder.stats if recorder is not None else None
    if stats is None:
        return
    stats.time_s += seconds
    stats.calls += calls
    stats.bytes += nbytes


_sync = getattr(getattr(ms, "runtime", None), "synchronize", None)


def _timed(fn, x, nbytes: int, group: Group, stats: CommStats | None = None):
    # PyNative may run ops asynchronously: synchronize so the time is the collective's own
    if _sync is not None:
        _sync()
    t0 = time.perf_counter()
    y = fn(x)
    if _sync is not None:
        _sync()
    _record(group, time.perf_counter() - t0, 1, nbytes, stats)
    return y


_native: bool | None = None


def native_collectives() -> bool:
    """True where the backend has subgroup AllGather/ReduceScatter and Send/Receive."""
    global _native
    if _native is None:
        _native = ms.get_context("device_target") in ("Ascend", "GPU")
    return _native


_op_cache: dict = {}


def _op(kind: str, group: Group, **kw):
    key = (kind, group.name, tuple(sorted(kw.items())))
    op = _op_cache.get(key)
    if op is None:
        if kind == "allreduce":
            op = ops.AllReduce(ops.ReduceOp.SUM, group=group.name)
        elif kind == "allgather":
            op = ops.AllGather(group=group.name)
        elif kind == "reducescatter":
            op = ops.ReduceScatter(ops.ReduceOp.SUM, group=group.name)
        else:  # pragma: no cover
            raise ValueError(kind)
        _op_cache[key] = op
    return op


def _nbytes(x) -> int:
    return int(x.size) * x.itemsize


# ----------------------------------------------------------------------- plain collectives


def all_reduce(x, group: Group, timed: bool = True, stats: CommStats | None = None,
               host: bool = False):  # fmt: skip
    """Sum over the group (every backend has this natively). ``stats``: record this call
    there instead of into the group's recorder. ``host``: a call from host code (not inside
    a cell), which may go over the host link of a two-rank group (module docstring)."""
    if group.size == 1:
        return x
    both = _host_pair(x, group, timed, stats) if host else None
    if both is not None:
        return Tensor(both[0] + both[1])
    op = _op("allreduce", group)
    return _timed(op, x, _nbytes(x), group, stats) if timed else op(x)


def _host_pair(x, group: Group, timed: bool, stats: CommStats | None = None):
    """Both ranks' ``x`` as NumPy arrays in group order, swapped over the host link of a
    two-rank group; None where there is no link (the caller uses the collective)."""
    link = _link(group)
    if link is None or _np_dtype(x.dtype) is None:
        return None
    mine = x.asnumpy()
    t0 = time.perf_counter()
    theirs = link.exchange(mine, mine.shape, mine.dtype)
    if timed:
        _record(group, time.perf_counter() - t0, 1, _nbytes(x), stats)
    return (mine, theirs) if group.index == 0 else (theirs, mine)


def all_gather(x, group: Group, axis: int = 0, timed: bool = True, host: bool = False):
    """Concatenate every rank's ``x`` along ``axis`` in group order. ``host``: as in
    ``all_reduce``."""
    if group.size == 1:
        return x
    both = _host_pair(x, group, timed) if host else None
    if both is not None:
        return Tensor(np.concatenate(both, axis))
    if native_collectives():
        xt = x if axis == 0 else x.swapaxes(0, axis)
        op = _op("allgather", group)
        y = _timed(op, xt, _nbytes(x), group) if timed else op(xt)
        return y if axis == 0 else y.swapaxes(0, axis)
    zero = ops.zeros_like(x)
    parts = [x if i == group.index else zero for i in range(group.size)]
    return all_reduce(ops.concat(parts, axis), group, timed)


def reduce_scatter(x, group: Group, axis: int = 0, timed: bool = True):
    """Sum over the group, then keep this rank's equal slice along ``axis``."""
    if group.size == 1:
        return x
    n = x.shape[axis] // group.size
    if native_collectives():
        xt = x if axis == 0 else x.swapaxes(0, axis)
        op = _op("reducescatter", group)
        y = _timed(op, xt, _nbytes(x), group) if timed else op(xt)
        return y if axis == 0 else y.swapaxes(0, axis)
    y = all_reduce(x, group, timed)
    return _slice(y, axis, group.index * n, n)


def split(x, group: Group, axis: int):
    """This rank's equal slice along ``axis`` (no communication)."""
    if group.size == 1:
        return x
    n = x.shape[axis] // group.size
    return _slice(x, axis, group.index * n, n)


def _slice(x, axis: int, start: int, n: int):
    begin = [0] * x.ndim
    size = list(x.shape)
    begin[axis] = start
    size[axis] = n
    return ops.slice(x, begin, size)


def all_reduce_max(x, group: Group):
    """Elementwise max over the group (CPU AllReduce has SUM only: gather, then max)."""
    if group.size == 1:
        return x
    return ops.amax(all_gather(x.expand_dims(0), group, 0), 0)


# ----------------------------------------------------------------------- point to point


def exchange(send, recv_shape, recv_dtype, pair: Group):
    """Send ``send`` (or None) to the other rank of a two-rank group and receive a tensor of
    ``recv_shape`` (or None). Both ranks must call it at the same point of their schedule.
    """
    assert pair.size == 2, "exchange needs a two-rank group"
    if send is None and recv_shape is None:
        return None
    if native_collectives():
        return _native_exchange(send, recv_shape, recv_dtype, pair)
    link = _link(pair)
    np_dtype = _np_dtype(recv_dtype if recv_dtype is not None else send.dtype)
    if link is not None and np_dtype is not None:
        out = None if send is None else send.asnumpy()  # waits for the graph that made it
        t0 = time.perf_counter()
        got = link.exchange(out, recv_shape, np_dtype)
        nbytes = (0 if out is None else out.nbytes) + (0 if got is None else got.nbytes)
        _record(pair, time.perf_counter() - t0, 1, nbytes)
        return None if got is None else Tensor(got)
    if recv_shape is None:  # one-way send: the receiver contributes zeros
        all_reduce(send, pair)
        return None
    if send is None:  # one-way receive
        return all_reduce(ops.zeros(tuple(recv_shape), recv_dtype), pair)
    assert tuple(send.shape) == tuple(recv_shape), "an exchange moves equal shapes both ways"
    zero = ops.zeros_like(send)
    slots = [send.expand_dims(0) if i == pair.index else zero.expand_dims(0) for i in range(2)]
    both = all_reduce(ops.concat(slots, 0), pair)
    return both[1 - pair.index]


def _link(pair: Group):
    """The host link of a two-rank group on the CPU backend, or None (``_hostlink``)."""
    if pair.size != 2 or native_collectives():
        return None

    def reduce(a):
        return all_reduce(Tensor(a), pair, timed=False).asnumpy()

    return link_between(pair.ranks, pair.index, reduce)


def _np_dtype(dtype):
    """NumPy's dtype for a MindSpore one, or None where NumPy has none (bfloat16)."""
    if dtype is None or dtype == ms.bfloat16:
        return None
    try:
        return np.dtype(ms.dtype_to_nptype(dtype))
    except (TypeError, KeyError):
        return None


_p2p_ops: dict = {}


def _native_exchange(send, recv_shape, recv_dtype, pair: Group):  # pragma: no cover - device only
    peer = pair.ranks[1 - pair.index]
    t0 = time.perf_counter()
    out = None

    def do_send():
        op = _p2p_ops.setdefault(("s", pair.name, peer), ops.Send(0, peer, group=pair.name))
        op(send)

    def do_recv():
        key = ("r", pair.name, peer, tuple(recv_shape), str(recv_dtype))
        op = _p2p_ops.setdefault(
            key, ops.Receive(0, peer, tuple(recv_shape), recv_dtype, group=pair.name)
        )
        return op()

    # the lower rank sends first and the upper receives first, so blocking p2p cannot deadlock
    if pair.index == 0:
        if send is not None:
            do_send()
        if recv_shape is not None:
            out = do_recv()
    else:
        if recv_shape is not None:
            out = do_recv()
        if send is not None:
            do_send()
    _record(pair, time.perf_counter() - t0, 1)
    return out


# ----------------------------------------------------------------------- autodiff-aware
# Tensor-parallel regions (Megatron's f / g and their sequence-parallel versions). Each is a
# Cell with a custom bprop so the backward communication is the transpose of the forward.
# PyNative runs a bprop as Python, so its collective is timed into its group's recorder like the
# forward's (the per-step communication share then includes the backward).


class CopyToTP(nn.Cell):
    """Forward identity; backward all-reduce (input of a column-parallel region)."""

    def __init__(self, group: Group):
        super().__init__()
        self.group = group

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (all_reduce(dout, self.group),)


class ReduceFromTP(nn.Cell):
    """Forward all-reduce; backward identity (output of a row-parallel region)."""

    def __init__(self, group: Group):
        super().__init__()
        self.group = group

    def construct(self, x):
        return all_reduce(x, self.group)

    def bprop(self, x, out, dout):
        return (dout,)


class GatherSeq(nn.Cell):
    """Sequence parallel: forward all-gather along the sequence; backward reduce-scatter."""

    def __init__(self, group: Group, axis: int = 1):
        super().__init__()
        self.group = group
        self.axis = axis

    def construct(self, x):
        return all_gather(x, self.group, self.axis)

    def bprop(self, x, out, dout):
        return (reduce_scatter(dout, self.group, self.axis),)


class ReduceScatterSeq(nn.Cell):
    """Sequence parallel: forward reduce-scatter along the sequence; backward all-gather."""

    def __init__(self, group: Group, axis: int = 1):
        super().__init__()
        self.group = group
        self.axis = axis

    def construct(self, x):
        return reduce_scatter(x, self.group, self.axis)

    def bprop(self, x, out, dout):
        return (all_gather(dout, self.group, self.axis),)
