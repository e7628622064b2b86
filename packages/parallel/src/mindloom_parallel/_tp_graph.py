"""Tensor and sequence parallelism inside a compiled (GRAPH_MODE / ``jit``) train step.

The same split of the same ``mindloom_model.Llama`` as the engine (``parallelize_llama``
and the model package's plan), with region cells whose collectives are graph ops: each
primitive is built once per cell, nothing is timed from the host, and every backward
collective is the cell's custom ``bprop`` (the transpose of its forward):

- ``CopyToTPGraph`` (Megatron's *f*): identity forward, all-reduce backward;
- ``ReduceFromTPGraph`` (*g*): all-reduce forward, identity backward;
- ``GatherSeqGraph``: all-gather along the sequence forward, reduce-scatter backward;
- ``ReduceScatterSeqGraph``: reduce-scatter forward, all-gather backward.

On the CPU backend (MCCL) only AllReduce works on a subgroup and AllGather only on the
world group, and ReduceScatter not at all: a reduce-scatter is an all-reduce and this
rank's slice; an all-gather is the native op when the tensor-parallel group is the world,
else a zero buffer with this rank's slot filled and an all-reduce (adding zeros is exact,
so both give the same bytes). On Ascend / GPU (HCCL / NCCL) the native ops run.

``VocabParallelLossMean`` is the vocab-parallel cross-entropy of the engine's
``VocabParallelLossSum`` divided by the micro-batch's unmasked token count, i.e. the
one-process ``causal_lm_loss``; ``TPLlamaWithLoss`` pairs it with the split model and has
``LlamaWithLoss``'s signature, so the trainer's compiled ``TrainStep`` runs it unchanged.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindloom_parallel._comm import native_collectives
from mindloom_parallel._groups import Group
from mindloom_parallel._tp import VocabParallelNLL

__all__ = [
    "CopyToTPGraph",
    "GatherSeqGraph",
    "ReduceFromTPGraph",
    "ReduceScatterSeqGraph",
    "TPGradReducer",
    "TPLlamaWithLoss",
    "TPEPNormSquare",
    "TPNormSquare",
    "VocabParallelLossMean",
    "VocabParallelLossSumGraph",
    "parallelize_deepseek_graph",
    "parallelize_llama_graph",
]


def _allreduce(group: Group):
    return ops.AllReduce(ops.ReduceOp.SUM, group=group.name) if group.size > 1 else None


def _is_world(group: Group) -> bool:
    from mindspore.communication import get_group_size

    return group.size == get_group_size()


class _SeqOps(nn.Cell):
    """All-gather / reduce-scatter of [B, S, ...] along axis 1 over ``group``, as graph ops."""

    def __init__(self, group: Group, world_allgather: bool = True):
        super().__init__()
        self.n, self.index = group.size, group.index
        self.allreduce = _allreduce(group)
        # a native AllGather: on HCCL / NCCL always, on MCCL only over the world group
        native = group.size > 1 and (native_collectives() or (world_allgather and _is_world(group)))
        self.allgather = ops.AllGather(group=group.name) if native else None
        self.native_rs = group.size > 1 and native_collectives()
        self.reducescatter = (
            ops.ReduceScatter(ops.ReduceOp.SUM, group=group.name) if self.native_rs else None
        )

    def gather(self, x):
        if self.allreduce is None:
            return x
        if self.allgather is not None:
            # AllGather stacks along axis 0: bring the sequence there and back
            return self.allgather(x.swapaxes(0, 1)).swapaxes(0, 1)
        b, s = x.shape[0], x.shape[1]
        rest = x.shape[2:]
        parts = ()
        if self.index > 0:
            parts = parts + (ops.zeros((b, self.index * s) + rest, x.dtype),)
        parts = parts + (x,)
        if self.index < self.n - 1:
            parts = parts + (ops.zeros((b, (self.n - 1 - self.index) * s) + rest, x.dtype),)
        return self.allreduce(ops.concat(parts, 1))

    def scatter(self, x):
        if self.allreduce is None:
            return x
        if self.reducescatter is not None:
            return self.reducescatter(x.swapaxes(0, 1)).swapaxes(0, 1)
        s = x.shape[1] // self.n
        return self.allreduce(x)[:, self.index * s : (self.index + 1) * s]


class CopyToTPGraph(nn.Cell):
    """Forward identity; backward all-reduce over the TP group (column-parallel input)."""

    def __init__(self, group: Group):
        super().__init__()
        self.allreduce = _allreduce(group)

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        if self.allreduce is None:
            return (dout,)
        return (self.allreduce(dout),)


class ReduceFromTPGraph(nn.Cell):
    """Forward all-reduce over the TP group; backward identity (row-parallel output)."""

    def __init__(self, group: Group):
        super().__init__()
        self.allreduce = _allreduce(group)

    def construct(self, x):
        if self.allreduce is None:
            return x
        return self.allreduce(x)

    def bprop(self, x, out, dout):
        return (dout,)


class GatherSeqGraph(nn.Cell):
    """Sequence parallel region entry: all-gather along the sequence; backward
    reduce-scatter. ``world_allgather=False``: the CPU emulation even over the world group
    (tests run it on two workers)."""

    def __init__(self, group: Group, world_allgather: bool = True):
        super().__init__()
        self.seq = _SeqOps(group, world_allgather)

    def construct(self, x):
        return self.seq.gather(x)

    def bprop(self, x, out, dout):
        return (self.seq.scatter(dout),)


class ReduceScatterSeqGraph(nn.Cell):
    """Sequence parallel region exit: reduce-scatter along the sequence; backward
    all-gather."""

    def __init__(self, group: Group, world_allgather: bool = True):
        super().__init__()
        self.seq = _SeqOps(group, world_allgather)

    def construct(self, x):
        return self.seq.scatter(x)

    def bprop(self, x, out, dout):
        return (self.seq.gather(dout),)


class _GroupMax(nn.Cell):
    """Elementwise max of [1, N] over the group, no gradient (all-gather, then max)."""

    def __init__(self, group: Group, world_allgather: bool = True):
        super().__init__()
        self.n, self.index = group.size, group.index
        self.allreduce = _allreduce(group)
        native = group.size > 1 and (native_collectives() or (world_allgather and _is_world(group)))
        self.allgather = ops.AllGather(group=group.name) if native else None

    def construct(self, x):
        if self.allreduce is None:
            return x
        if self.allgather is not None:
            rows = self.allgather(x)
        else:
            parts = ()
            for i in range(self.n):
                parts = parts + ((x if i == self.index else ops.zeros_like(x)),)
            rows = self.allreduce(ops.concat(parts, 0))
        return ops.amax(rows, 0, keepdims=True)


class VocabParallelLossSumGraph(nn.Cell):
    """sum of nll over the unmasked tokens of local-vocab logits [B, S, V/tp] (fp32), as
    graph ops: the row max through an all-gather, the two sums through all-reduces over
    tp; the same value on every TP rank."""

    def __init__(self, group: Group, vocab_start: int, world_allgather: bool = True):
        super().__init__()
        self.row_max = _GroupMax(group, world_allgather)
        self.nll = VocabParallelNLL(vocab_start, ReduceFromTPGraph(group), ReduceFromTPGraph(group))

    def masked_nll(self, logits, labels, m):
        """nll * m per token, m the flat fp32 loss mask."""
        v = logits.shape[-1]
        flat = logits.reshape(-1, v).astype(ms.float32)
        # any per-row constant that is the same on every rank stabilizes the exp
        row_max = ops.stop_gradient(self.row_max(ops.amax(flat, -1).reshape(1, -1)))
        return self.nll(flat - row_max.reshape(-1, 1), labels) * m

    def construct(self, logits, labels, loss_mask):
        return self.masked_nll(logits, labels, loss_mask.reshape(-1).astype(ms.float32)).sum()


class VocabParallelLossMean(VocabParallelLossSumGraph):
    """mean of nll over the unmasked tokens of local-vocab logits [B, S, V/tp] (fp32): the
    one-process ``causal_lm_loss`` of the full logits, the same value on every TP rank."""

    def construct(self, logits, labels, loss_mask):
        m = loss_mask.reshape(-1).astype(ms.float32)
        return self.masked_nll(logits, labels, m).sum() / ops.maximum(
            m.sum(), ops.ones((), ms.float32)
        )


class TPLlamaWithLoss(nn.Cell):
    """``LlamaWithLoss`` for a Llama split by ``parallelize_llama_graph``: the same inputs,
    the global mean loss of the micro-batch on every TP rank."""

    def __init__(self, model, tp: Group, world_allgather: bool = True):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        from mindloom_parallel._tp import vocab_start

        self.model = model
        self.loss = VocabParallelLossMean(tp, vocab_start(model.config, tp), world_allgather)

    def construct(
        self, tokens, labels, position_ids=None, segment_ids=None, loss_mask=None, dropout_key=None
    ):
        logits = self.model(tokens, position_ids, segment_ids, dropout_key)
        if loss_mask is None:
            loss_mask = ops.ones(labels.shape, ms.float32)
        return self.loss(logits, labels, loss_mask)


def parallelize_llama_graph(model, pcfg, groups, world_allgather: bool = True):
    """``parallelize_llama`` with the graph region cells above: the model split in place
    for ``groups.tp`` (sequence parallel when ``pcfg.sequence_parallel``), to be run
    inside a compiled step. Returns the model. ``world_allgather=False`` forces the CPU
    all-gather emulation even where the TP group is the world (tests)."""
    from mindloom_parallel._tp import parallelize_llama

    tp, wa = groups.tp, world_allgather
    if pcfg.sequence_parallel:
        regions = (lambda: GatherSeqGraph(tp, wa), lambda: ReduceScatterSeqGraph(tp, wa))
    else:
        regions = (lambda: CopyToTPGraph(tp), lambda: ReduceFromTPGraph(tp))
    return parallelize_llama(model, pcfg, groups, regions=regions)


def parallelize_deepseek_graph(model, pcfg, groups):
    """``parallelize_deepseek`` with the graph region cells (*f* / *g*): a DeepseekV3 split
    in place for ``groups.tp``, to be run inside a compiled step. Returns the model."""
    from mindloom_parallel._tp import parallelize_deepseek

    tp = groups.tp
    regions = (lambda: CopyToTPGraph(tp), lambda: ReduceFromTPGraph(tp))
    return parallelize_deepseek(model, pcfg, groups, regions=regions)


def tp_replicated(names) -> tuple[bool, ...]:
    """Per parameter name: True when every TP rank holds it whole (the norm weights)."""
    return tuple(n.endswith("norm.weight") for n in names)


_reduce_if = ops.MultitypeFuncGraph("reduce_if")


@_reduce_if.register("Function", "Tensor", "Bool")
def _reduce_if_partial(allreduce, g, partial):
    return allreduce(g) if partial else g


class TPGradReducer(nn.Cell):
    """The gradients of a compiled TP step before the update: the gradients that are
    partial sums over the TP ranks get one all-reduce over tp each (with sequence parallel
    the replicated norm weights, whose tokens are split; ``partial``: a flag per
    parameter, DeepSeek-V3's MLA down-projections); then the data-parallel reducer
    (``GradReducer``, ``EPGradReducer``) when given."""

    def __init__(self, params, names, groups, sequence_parallel: bool, dp_reducer=None,
                 partial=None):  # fmt: skip
        super().__init__()
        self.n = len(params)
        if partial is None:
            partial = tp_replicated(names) if sequence_parallel else (False,) * self.n
        self.partial = tuple(bool(f) for f in partial)
        self.allreduce = _allreduce(groups.tp) if any(self.partial) else None
        self.map = ops.HyperMap()  # not a loop growing a tuple (_graph_tuples)
        self.dp_reducer = dp_reducer

    def construct(self, grads):
        if self.allreduce is not None:
            grads = self.map(ops.partial(_reduce_if, self.allreduce), grads, self.partial)
        if self.dp_reducer is not None:
            grads = self.dp_reducer(grads)
        return grads


class TPNormSquare(nn.Cell):
    """The squared global gradient norm from per-tensor squared norms of this rank's local
    shards: sum over the TP group, every replicated tensor counted once (on TP rank 0)."""

    def __init__(self, names, groups):
        super().__init__()
        rep = tp_replicated(names)
        first = groups.tp.index == 0
        self.weights = ms.Tensor(
            np.array([1.0 if (first or not r) else 0.0 for r in rep], np.float32)
        )
        self.allreduce = _allreduce(groups.tp)

    def construct(self, sq):
        total = (ops.stack(sq) * self.weights).sum()
        if self.allreduce is None:
            return total
        return self.allreduce(total.reshape(1)).reshape(())


class TPEPNormSquare(nn.Cell):
    """The squared global gradient norm of a tp (x ep) step from per-tensor squared norms
    of this rank's tensors: the dense part summed over the TP group (``split``: a flag per
    parameter, True for a tp shard; a whole tensor counted once, on TP rank 0), plus the
    routed-expert blocks (``expert``) summed over the ep group: each tp rank holds the same
    blocks, each ep rank others."""

    def __init__(self, split, expert, tp: Group, ep: Group):
        super().__init__()
        first = tp.index == 0
        dense = [0.0 if e else (1.0 if (s or first) else 0.0) for s, e in zip(split, expert)]
        self.dense_w = ms.Tensor(np.array(dense, np.float32))
        self.expert_w = ms.Tensor(np.array([1.0 if e else 0.0 for e in expert], np.float32))
        self.tp_sum = _allreduce(tp)
        self.ep_sum = _allreduce(ep)

    def construct(self, sq):
        sq = ops.stack(sq)
        dense = (sq * self.dense_w).sum().reshape(1)
        expert = (sq * self.expert_w).sum().reshape(1)
        if self.tp_sum is not None:
            dense = self.tp_sum(dense)
        if self.ep_sum is not None:
            expert = self.ep_sum(ops.depend(expert, dense))
        return (dense + expert).reshape(())
