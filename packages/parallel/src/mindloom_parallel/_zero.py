"""ZeRO-1 with the one AdamW, and the optimizer state gathered and scattered by layout.

ZeRO-1 partitions whole parameters over the data-parallel ranks (greedy by size, the same
on every rank): each rank keeps AdamW moments for its own parameters only and updates
them; the new values reach the other replicas through one all-reduce in which non-owners
contribute zeros (exact: adding zeros changes no bit, so every replica holds the owner's
bytes). ``zero_stage = 0`` (or dp = 1) keeps every moment on every rank.

The update is MindSpore's fused ``AdamWeightDecay`` kernel, the one the compiled train
step runs, with the per-step scalars the caller passes (bias correction folded into lr,
eps and weight decay; see ``adamw_scalars``), so the engine path and the compiled path
apply the same arithmetic.

Checkpoints: every rank contributes its weights and moments to one all-gather on the
world group; rank 0 gets one model and one optimizer dict per model-parallel rank
(tp x pp), each tensor a chunk of its global shape, described by ``chunk_metadata``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ZeroAdamW", "adamw_scalars", "chunk_metadata", "gather_rows", "zero_owners"]


def zero_owners(sizes: list[int], dp: int) -> list[int]:
    """ZeRO-1 ownership: parameter i -> data-parallel rank, largest first onto the least
    loaded rank (deterministic, the same on every rank)."""
    load = [0] * dp
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(dp), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def adamw_scalars(
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> tuple[float, float, float]:
    """torch AdamW's bias correction folded into the fused kernel's scalars for the 1-based
    ``step``: -> (lr, eps, weight_decay) such that ``AdamWeightDecay`` (no correction of its
    own) applies ``p -= lr*wd*p + lr*mhat/(sqrt(vhat)+eps)``."""
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    return lr * math.sqrt(bc2) / bc1, eps * math.sqrt(bc2), weight_decay * bc1 / math.sqrt(bc2)


def sum_over_group(arrays: list[np.ndarray], group) -> list[np.ndarray]:
    """Host side, collective over ``group``: each float32 array summed over the group's
    ranks, all in one untimed all-reduce (none for a group of one). With the owner giving
    its moments and every other rank zeros, the sum is the owner's bytes exactly."""
    from mindspore import Tensor

    from mindloom_parallel._comm import all_reduce

    flat = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays])
    if group.size > 1:
        flat = all_reduce(Tensor(flat), group, timed=False).asnumpy()
    out, off = [], 0
    for a in arrays:
        out.append(flat[off : off + a.size].reshape(a.shape))
        off += a.size
    return out


def gather_rows(values, group) -> np.ndarray:
    """Every rank's row of float32 ``values`` in group order, [group.size, len(values)]
    (an untimed all-gather: bookkeeping, not the step's communication)."""
    from mindspore import Tensor

    from mindloom_parallel._comm import all_gather

    mine = Tensor(np.asarray(values, np.float32).reshape(1, -1))
    return all_gather(mine, group, 0, timed=False, host=True).asnumpy()


def chunk_metadata(model_cfg, pcfg, shard_name) -> tuple[dict, dict]:
    """metadata.json tensor entries for the shards ``ZeroAdamW.gather_shards`` returns, and
    {model rank: (model file, optim file)}. ``shard_name(kind, rank)`` names a file
    (``kind`` "model" or "optim"). Pure (no MindSpore)."""
    from mindloom_parallel._groups import coords_rank
    from mindloom_parallel._layout import tensor_layout

    layout = tensor_layout(model_cfg, pcfg)
    files = {}
    for pp_rank in range(pcfg.pp):
        for tp_rank in range(pcfg.tp):
            r = coords_rank(0, tp_rank, pp_rank, pcfg)
            files[r] = (shard_name("model", r), shard_name("optim", r))
    tensors = {}
    for name, spec in layout.items():
        stage = spec.pp_stages[0]
        nt = pcfg.tp if spec.tp_axis is not None else 1
        local = spec.local_shape(pcfg.tp)
        for kind, prefix in ((0, ""), (1, "exp_avg."), (1, "exp_avg_sq.")):
            chunks = []
            for t in range(nt):
                off = [0] * len(local)
                if spec.tp_axis is not None:
                    off[spec.tp_axis] = t * local[spec.tp_axis]
                r = coords_rank(0, t, stage, pcfg)
                chunks.append({"file": files[r][kind], "key": prefix + name, "offset": off,
                               "shape": list(local)})  # fmt: skip
            tensors[prefix + name] = {
                "file": chunks[0]["file"],
                "dtype": "float32",
                "global_shape": list(spec.global_shape),
                "split": {
                    "tp_axis": spec.tp_axis,
                    "tp": pcfg.tp,
                    "pp_stages": list(spec.pp_stages),
                },  # fmt: skip
                "chunks": chunks,
            }
    return tensors, files


class ZeroAdamW:
    """AdamW over this rank's local parameters, moments sharded over dp when ZeRO-1.

    ``params`` / ``names``: the rank's local tensors and their global names (a
    ``ParallelEngine``'s ``params`` / ``param_names``). ``decay_flags[i]`` multiplies the
    weight decay of parameter i (0 exempts it). ``comm_stats``: where the update's
    all-reduce is timed (the engine's ``comm_stats``; None: untimed).
    """

    def __init__(self, params, names, groups, zero_stage: int, decay_flags=None,
                 comm_stats=None):  # fmt: skip
        from mindspore import Parameter, ops

        self.params, self.names = list(params), list(names)
        self.groups, self.zero_stage, self.comm_stats = groups, int(zero_stage), comm_stats
        self.flags = list(decay_flags) if decay_flags is not None else [1.0] * len(self.params)
        self.sizes = [int(np.prod(p.shape)) for p in self.params]
        dp = groups.dp.size
        if self.zero_stage == 1 and dp > 1:
            self.owner = zero_owners(self.sizes, dp)
        else:
            self.owner = [groups.dp_rank] * len(self.params)
        self.owned = [i for i, o in enumerate(self.owner) if o == groups.dp_rank]
        self.sharded = len(self.owned) < len(self.params)
        self.exp_avg = {
            i: Parameter(np.zeros(self.params[i].shape, np.float32),
                         name="exp_avg." + self.names[i], requires_grad=False)
            for i in self.owned
        }  # fmt: skip
        self.exp_avg_sq = {
            i: Parameter(np.zeros(self.params[i].shape, np.float32),
                         name="exp_avg_sq." + self.names[i], requires_grad=False)
            for i in self.owned
        }  # fmt: skip
        self._kernel = ops.AdamWeightDecay()

    @property
    def state_size(self) -> int:
        """Values of AdamW state (per moment) this rank keeps."""
        return sum(self.sizes[i] for i in self.owned)

    # ------------------------------------------------------------------ the update

    def update(self, grads, lr, beta1, beta2, eps, weight_decay, grad_factor=1.0) -> None:
        """One AdamW update of the owned parameters with the kernel's scalars as given
        (``adamw_scalars`` folds in the bias correction), gradients times ``grad_factor``
        (clipping), then the new values shared with every data-parallel replica."""
        import mindspore as ms
        from mindspore import Tensor

        h = [Tensor(np.float32(x)) for x in (lr, beta1, beta2, eps)]
        for i in self.owned:
            self._kernel(self.params[i], self.exp_avg[i], self.exp_avg_sq[i], *h,
                         Tensor(np.float32(weight_decay * self.flags[i])),
                         grads[i].astype(ms.float32) * Tensor(np.float32(grad_factor)))  # fmt: skip
        self._share_updates()

    def step(self, grads, step: int, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
             weight_decay: float = 0.0) -> None:  # fmt: skip
        """torch.optim.AdamW's update for the 1-based ``step`` (decoupled decay)."""
        lr_k, eps_k, wd_k = adamw_scalars(step, lr, betas[0], betas[1], eps, weight_decay)
        self.update(grads, lr_k, betas[0], betas[1], eps_k, np.float32(wd_k))

    def _share_updates(self) -> None:
        """ZeRO-1: owners hold the new values; one dp all-reduce gives them to every replica."""
        from mindspore import ops

        from mindloom_parallel._comm import all_reduce

        dp = self.groups.dp
        if dp.size == 1 or not self.sharded:
            return
        flat = ops.concat(
            [
                p.reshape(-1) if self.owner[i] == dp.index else ops.zeros(p.size, p.dtype)
                for i, p in enumerate(self.params)
            ]
        )
        full = all_reduce(flat, dp, timed=self.comm_stats is not None, stats=self.comm_stats)
        off = 0
        for i, p in enumerate(self.params):
            n = int(p.size)
            if self.owner[i] != dp.index:
                ops.assign(p, full[off : off + n].reshape(p.shape))
            off += n

    # ------------------------------------------------------------------ state

    def local_moments(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(exp_avg, exp_avg_sq) by name: the moments this rank owns, zeros for the others
        (and on every replica but the first without ZeRO-1), so a sum over the
        data-parallel replicas gives exactly one copy."""
        m, v = {}, {}
        keep_all = self.zero_stage == 1 or self.groups.dp_rank == 0
        for i, n in enumerate(self.names):
            if i in self.exp_avg and keep_all:
                m[n] = self.exp_avg[i].asnumpy()
                v[n] = self.exp_avg_sq[i].asnumpy()
            else:
                m[n] = np.zeros(self.params[i].shape, np.float32)
                v[n] = np.zeros(self.params[i].shape, np.float32)
        return m, v

    def gather_moments(self) -> dict[str, np.ndarray]:
        """The full moments of this rank's local parameters (collective over dp):
        ``{"exp_avg.<name>": ..., "exp_avg_sq.<name>": ...}``."""
        m, v = self.local_moments()
        out = {}
        for prefix, part in (("exp_avg.", m), ("exp_avg_sq.", v)):
            summed = sum_over_group([part[n] for n in self.names], self.groups.dp)
            out.update({prefix + n: arr for n, arr in zip(self.names, summed)})
        return out

    def load_moments(self, tensors: dict[str, np.ndarray], model_cfg, pcfg) -> None:
        """This rank's shards of GLOBAL moments (``exp_avg.<name>``, ``exp_avg_sq.<name>``;
        a checkpoint of any layout)."""
        from mindspore import Tensor, ops

        from mindloom_parallel._layout import shard_tensor, tensor_layout

        layout = tensor_layout(model_cfg, pcfg)
        tp = self.groups.tp
        for i in self.owned:
            n = self.names[i]
            for prefix, store in (("exp_avg.", self.exp_avg), ("exp_avg_sq.", self.exp_avg_sq)):
                local = shard_tensor(np.asarray(tensors[prefix + n], np.float32), layout[n],
                                     tp.index, tp.size)  # fmt: skip
                ops.assign(store[i], Tensor(local))

    def gather_shards(self, model_cfg, pcfg, shard_name) -> dict[str, dict[str, np.ndarray]] | None:
        """Collective over the world: on rank 0 {file name: {key: local array}} for every
        model-parallel rank (files named as in ``chunk_metadata``); None elsewhere."""
        from mindloom_parallel._groups import rank_coords
        from mindloom_parallel._layout import rank_tensor_names, tensor_layout

        groups = self.groups
        world = groups.world_size
        layout = tensor_layout(model_cfg, pcfg)

        def names_of(rank):
            return rank_tensor_names(layout, rank_coords(rank, pcfg)[2])

        def size_of(rank):
            return sum(int(np.prod(layout[n].local_shape(pcfg.tp))) for n in names_of(rank))

        longest = max(size_of(r) for r in range(world))
        w = {n: p.asnumpy() for n, p in zip(self.names, self.params)}
        m, v = self.local_moments()
        flat = np.zeros(3 * longest, np.float32)
        off = 0
        for part in (w, m, v):
            for n in names_of(groups.rank):
                a = part[n].reshape(-1)
                flat[off : off + a.size] = a
                off += a.size
        allv = gather_rows(flat, groups.world)
        if groups.rank != 0:
            return None
        _, files = chunk_metadata(model_cfg, pcfg, shard_name)
        out: dict[str, dict[str, np.ndarray]] = {}
        for mrank, (mfile, ofile) in files.items():
            _, t0, p0 = rank_coords(mrank, pcfg)
            replicas = [r for r in range(world) if rank_coords(r, pcfg)[1:] == (t0, p0)]
            names = names_of(mrank)
            shapes = [layout[n].local_shape(pcfg.tp) for n in names]
            sizes = [int(np.prod(s)) for s in shapes]
            total = sum(sizes)
            weights = allv[mrank, :total]
            mv = sum(allv[r, total : 3 * total].astype(np.float64) for r in replicas)
            mv = mv.astype(np.float32)
            model, optim = {}, {}
            o = 0
            for n, s, k in zip(names, shapes, sizes):
                model[n] = weights[o : o + k].reshape(s).copy()
                optim["exp_avg." + n] = mv[o : o + k].reshape(s).copy()
                optim["exp_avg_sq." + n] = mv[total + o : total + o + k].reshape(s).copy()
                o += k
            out[mfile], out[ofile] = model, optim
        return out
