"""Expert parallel for DeepSeekMoE inside a compiled (GRAPH_MODE) train step.

Expert parallel is carved out of data parallel (Megatron's and MindSpore Transformers'
rule): ``ep`` divides ``dp``; data-parallel rank ``d`` is ``edp_index * ep + ep_index``,
so each run of ``ep`` consecutive data-parallel ranks (an ep group) splits the routed
experts, rank ``ep_index`` holding global experts ``[ep_index * E/ep, (ep_index + 1) *
E/ep)``, and the ``dp / ep`` ranks with the same ``ep_index`` (the expert-data-parallel
group) hold the same experts. Every rank still routes only its own tokens (the router and
its bias are replicated), so the routing is the one-process routing.

The exchange (``mindloom_model``'s ``MoE._expert_parallel``): the ep group's token rows,
choices and weights are all-gathered (``GatherSeqGraph``: its backward a reduce-scatter),
each rank runs its experts on the slots routed to them, and the partial outputs are
summed over the group with this rank's rows kept (``ReduceScatterSeqGraph``: its backward
an all-gather). On HCCL / NCCL these are the native AllGather / ReduceScatter; on the CPU
backend (MCCL) the AllGather is native when the ep group is the world group, else the
zero-padded all-reduce, and the reduce-scatter is an all-reduce and a slice. A native
all-to-all would move only the routed rows (k/ep of the gathered ones, both ways).

Gradients: dense parameters are averaged over dp as in plain data parallel; an expert's
gradient on its rank already sums every ep-group rank's loss (the combine's backward
gathers their output gradients), so expert gradients are summed over the expert-data-
parallel group only and divided by dp: the update is the one-process update of the
global batch.
"""

from __future__ import annotations

import itertools

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindloom_parallel._graph_tuples import runs, take_runs
from mindloom_parallel._groups import Group, coords_rank, rank_coords

__all__ = [
    "EPGradReducer",
    "EPNormSquare",
    "EPZeroShardUpdate",
    "ep_group_ranks",
    "ep_traffic",
    "expert_block",
    "expert_parallel",
    "gather_experts",
    "init_expert_groups",
    "is_expert_param",
]


def is_expert_param(name: str) -> bool:
    """The routed experts' [E, ...] tensors (split over ep); everything else is dense."""
    return ".mlp.experts." in name


def ep_group_ranks(rank: int, pcfg) -> dict[str, tuple[int, ...]]:
    """-> {"ep": the ranks splitting the experts with ``rank``, "edp": the ranks holding
    the same experts}, both in index order (pure; the tests use it)."""
    d, t, p = rank_coords(rank, pcfg)
    ep = pcfg.ep
    edp_index, ep_index = divmod(d, ep)
    return {
        "ep": tuple(coords_rank(edp_index * ep + i, t, p, pcfg) for i in range(ep)),
        "edp": tuple(coords_rank(j * ep + ep_index, t, p, pcfg) for j in range(pcfg.dp // ep)),
    }


def expert_block(n_experts: int, ep: int, ep_index: int) -> tuple[int, int]:
    """(first global expert, count) held by ep rank ``ep_index``."""
    per = n_experts // ep
    return ep_index * per, per


def init_expert_groups(rank: int, pcfg, comms=None) -> tuple[Group, Group]:
    """The ep and expert-data-parallel groups of ``rank`` (communicators created once;
    the whole world is MindSpore's world group, whose AllGather works on MCCL too)."""
    from mindloom_parallel._groups import PROCESS_COMMUNICATORS, _world_group_name

    comms = PROCESS_COMMUNICATORS if comms is None else comms
    out = []
    for ranks in ep_group_ranks(rank, pcfg).values():
        if len(ranks) == 1:
            out.append(Group(None, ranks, 0))
            continue
        if ranks == tuple(range(pcfg.world_size)):
            name = _world_group_name()
        else:
            name = "ml_" + "_".join(str(r) for r in ranks)
            comms.create(name, ranks)
        out.append(Group(name, ranks, ranks.index(rank)))
    return out[0], out[1]


def _moe_modules(model) -> list:
    mods = [layer.mlp for layer in model.layers if layer.is_moe]
    return mods + [m.block.mlp for m in model.mtp if m.block.is_moe]


def expert_parallel(model, ep_group: Group, world_allgather: bool = True):
    """Split a ``mindloom_model.DeepseekV3``'s routed experts in place over ``ep_group``:
    each MoE layer (trunk and MTP) keeps its block of experts and gets the exchange cells.
    Every rank must pass an identically initialized model (same seed). Parameter names
    stay the global ones (``layers.1.mlp.experts.w1``), now naming [E/ep, ...] blocks.
    ``world_allgather=False`` forces the CPU all-gather emulation (tests). Returns it."""
    from mindloom_parallel._tp_graph import GatherSeqGraph, ReduceScatterSeqGraph

    n = ep_group.size
    if n == 1:
        return model
    for moe in _moe_modules(model):
        start, count = expert_block(moe.e, n, ep_group.index)
        for p in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
            local = p.asnumpy()[start : start + count]
            p.set_data(ms.Tensor(np.ascontiguousarray(local), p.dtype), slice_shape=True)
        moe.ep_in = GatherSeqGraph(ep_group, world_allgather)
        moe.ep_out = ReduceScatterSeqGraph(ep_group, world_allgather)
        moe.ep_start, moe.ep_local = start, count
    return model


class EPGradReducer(nn.Cell):
    """Dense gradients: ``dp_reducer`` (the bucketed mean over dp); expert gradients:
    divided by dp, then summed over the expert-data-parallel group (none when dp == ep)."""

    def __init__(self, names, dp_size: int, edp: Group, dp_reducer=None):
        super().__init__()
        self.n = len(names)
        expert = [is_expert_param(n) for n in names]
        self.expert_idx = tuple(i for i in range(self.n) if expert[i])
        self.dense_runs = runs(i for i in range(self.n) if not expert[i])
        # the output in runs: (0, lo, hi) dense[lo:hi], (1, lo, hi) experts[lo:hi]
        merge, counts = [], [0, 0]
        for src, group in itertools.groupby(int(e) for e in expert):
            k = len(list(group))
            merge.append((src, counts[src], counts[src] + k))
            counts[src] += k
        self.merge = tuple(merge)
        self.scale = 1.0 / dp_size
        self.edp = ops.AllReduce(ops.ReduceOp.SUM, group=edp.name) if edp.size > 1 else None
        self.dp_reducer = dp_reducer

    def construct(self, grads):
        # few runs and few expert tensors: no tuple grown tensor by tensor (_graph_tuples)
        dense = take_runs(grads, self.dense_runs)
        if self.dp_reducer is not None:
            dense = self.dp_reducer(dense)
        experts = ()
        prev = dense
        for i in self.expert_idx:
            g = grads[i] * self.scale
            if self.edp is not None:
                # after the dense buckets and the previous expert tensor: one order of
                # collectives on ranks whose graphs differ (ZeRO-1)
                g = self.edp(ops.depend(g, prev))
                prev = g
            experts = experts + (g,)
        out = ()
        for m in range(len(self.merge)):
            src, lo, hi = self.merge[m]
            if src == 0:
                out = out + dense[lo:hi]
            else:
                out = out + experts[lo:hi]
        return out


class EPNormSquare(nn.Cell):
    """The squared global gradient norm: the dense tensors counted once (on ep index 0),
    every rank's expert blocks added, summed over the ep group."""

    def __init__(self, names, ep_group: Group):
        super().__init__()
        first = ep_group.index == 0
        w = [1.0 if (is_expert_param(n) or first) else 0.0 for n in names]
        self.weights = ms.Tensor(np.array(w, np.float32))
        self.allreduce = (
            ops.AllReduce(ops.ReduceOp.SUM, group=ep_group.name) if ep_group.size > 1 else None
        )

    def construct(self, sq):
        total = (ops.stack(sq) * self.weights).sum()
        if self.allreduce is None:
            return total
        return self.allreduce(total.reshape(1)).reshape(())


def gather_experts(arrays: dict[str, np.ndarray], ep_group: Group) -> dict[str, np.ndarray]:
    """Host side, collective over ``ep_group``: each expert tensor's blocks concatenated in
    ep order, i.e. the global [E, ...] tensor (checkpoints hold global tensors)."""
    from mindloom_parallel._comm import all_gather

    out = {}
    for name in sorted(arrays):
        out[name] = all_gather(ms.Tensor(arrays[name]), ep_group, 0, timed=False).asnumpy()
    return out


def ep_traffic(local_loads: np.ndarray, global_loads: np.ndarray, ep: int, ep_index: int):
    """Token-slots an all-to-all would move for this rank, summed over the MoE layers:
    sent = its own slots routed to other ranks' experts, received = other ranks' slots
    routed to its experts. local / global loads: [R, E] this rank's / the ep group's."""
    loc = np.asarray(local_loads, np.float64)
    glo = np.asarray(global_loads, np.float64)
    start, count = expert_block(loc.shape[-1], ep, ep_index)
    mine = slice(start, start + count)
    sent = float(loc.sum() - loc[..., mine].sum())
    received = float(glo[..., mine].sum() - loc[..., mine].sum())
    return sent, received


class EPZeroShardUpdate(nn.Cell):
    """ZeRO-1 under expert parallel, as graph ops (``ZeroShardUpdate``'s two methods):
    the dense parameters' AdamW state sharded over dp as without ep, each expert block's
    over the expert-data-parallel group (the ranks holding the same experts). With
    ``dp == ep`` that group is this rank alone: it owns and updates all of its expert
    blocks and shares none, so expert state is held exactly once in the world (each rank
    its own E/ep experts' moments, nowhere replicated). ``exp_avg`` / ``exp_avg_sq``: the
    owned moments, dense first; ``owned``: their indices into ``params``."""

    def __init__(self, params, dp: Group, edp: Group, decay_flags, bucket_size_mb: float = 25.0):
        super().__init__(auto_prefix=False)
        from mindloom_parallel._zero_graph import ZeroShardUpdate

        params = list(params)
        expert = [is_expert_param(p.name) for p in params]
        self.dense_idx = tuple(i for i in range(len(params)) if not expert[i])
        self.expert_idx = tuple(i for i in range(len(params)) if expert[i])
        self.dense_runs, self.expert_runs = runs(self.dense_idx), runs(self.expert_idx)
        flags = list(decay_flags)
        self.dense = ZeroShardUpdate([params[i] for i in self.dense_idx], dp,
                                     [flags[i] for i in self.dense_idx], bucket_size_mb)  # fmt: skip
        self.expert = ZeroShardUpdate([params[i] for i in self.expert_idx], edp,
                                      [flags[i] for i in self.expert_idx], bucket_size_mb)  # fmt: skip
        self.owned = tuple(self.dense_idx[j] for j in self.dense.owned) + tuple(
            self.expert_idx[j] for j in self.expert.owned
        )
        self.exp_avg = ms.ParameterTuple([*self.dense.exp_avg, *self.expert.exp_avg])
        self.exp_avg_sq = ms.ParameterTuple([*self.dense.exp_avg_sq, *self.expert.exp_avg_sq])
        self.groups = (dp, edp)
        self.sizes = [int(np.prod(p.shape)) for p in params]

    @property
    def state_values(self) -> int:
        """Values of AdamW state per moment this rank keeps."""
        return self.dense.state_values + self.expert.state_values

    def update(self, grads, factor, lr, beta1, beta2, eps, weight_decay, token):
        """AdamW on the owned dense and expert tensors (``grads``: all, already reduced)."""
        dense, expert = take_runs(grads, self.dense_runs), take_runs(grads, self.expert_runs)
        token = self.dense.update(dense, factor, lr, beta1, beta2, eps, weight_decay, token)
        return self.expert.update(expert, factor, lr, beta1, beta2, eps, weight_decay, token)

    def share(self, token):
        """The owners' values to the replicas: dense over dp, then experts over the
        expert-data-parallel group (nothing when it is this rank alone), one chain."""
        return self.expert.share(self.dense.share(token))

    def full_moments(self) -> dict[str, np.ndarray]:
        """Host side, collective over dp (and edp): every LOCAL tensor's moments (the dense
        ones whole, this rank's expert blocks), keyed ``exp_avg.<name>`` as the step's;
        each shard's owners contribute their moments and the others zeros (exact)."""
        from mindloom_parallel._zero import sum_over_group

        out = {}
        for cell, group in ((self.dense, self.groups[0]), (self.expert, self.groups[1])):
            if not cell.sizes:
                continue
            for kind, mine in (("exp_avg", cell.exp_avg), ("exp_avg_sq", cell.exp_avg_sq)):
                own = {cell.owned[k]: mine[k].asnumpy() for k in range(len(cell.owned))}
                parts = [own[i] if i in own else np.zeros(cell.shapes[i], np.float32)
                         for i in range(len(cell.sizes))]  # fmt: skip
                for p, arr in zip(cell.params, sum_over_group(parts, group)):
                    out[f"{kind}.{p.name}"] = arr
        return out
