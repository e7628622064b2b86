"""The trainer's step under a tensor / pipeline / ZeRO-1 layout (`mindloom launch`).

The world-size-1 and plain data-parallel runs keep their compiled `TrainStep`. Any other
layout runs here: `mindloom_parallel.ParallelEngine` does forward and backward for this
rank (PyNative: the pipeline schedule and the TP region ops are Python-level), and this
module applies the trainer's own update to this rank's shards: the same global gradient
norm (every parameter counted once across TP/PP shards and replicas), the same guards,
the same clipping and the same fused AdamW kernel with the scalars of `_step.hyper_vector`.

ZeRO-1 here partitions whole parameters over the data-parallel ranks (greedy by size):
each rank keeps AdamW moments for its own parameters only, updates them, and the new
values reach the other replicas through one all-reduce in which non-owners contribute
zeros (exact: adding zeros changes no bit).

Checkpoints: every rank contributes its shards to one all-gather on the world group
(AllGather on the world group works on every backend, CPU included); rank 0 writes one
model and one optimizer file per model-parallel rank (tp x pp), each tensor a chunk of its
global shape, with `mindloom_parallel.layout_metadata` alongside. Any layout (and one
process) loads the global tensors back from those chunks.
"""

from __future__ import annotations

import time

import numpy as np

from mindloom_train import _checkpoint as ck


def effective_pcfg(cfg):
    """The ParallelConfig of a run; `micro_batch_num` is the number of micro-batches each
    data-parallel rank runs per step (the pipeline's, or the trainer's accumulation)."""
    from mindloom_parallel import ParallelConfig

    p = cfg.parallelism
    mbn = p.micro_batch_num if p.micro_batch_num > 1 or p.pp > 1 else cfg.grad_accum_steps
    return ParallelConfig(dp=p.dp, tp=p.tp, pp=p.pp, sequence_parallel=p.sequence_parallel,
                          micro_batch_num=mbn, zero_stage=p.zero_stage,
                          bucket_size_mb=p.bucket_size_mb)  # fmt: skip


def needs_engine(cfg) -> bool:
    p = cfg.parallelism
    return p.tp > 1 or p.pp > 1 or p.zero_stage > 0


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


def chunk_metadata(model_cfg, pcfg, world: int) -> tuple[dict, dict]:
    """metadata.json tensor entries for a checkpoint written by `EngineStep.save_shards`,
    and {model rank: (model file, optim file)}. Pure (no MindSpore): tested directly."""
    from mindloom_parallel._groups import coords_rank
    from mindloom_parallel._layout import tensor_layout

    layout = tensor_layout(model_cfg, pcfg)
    files = {}
    for pp_rank in range(pcfg.pp):
        for tp_rank in range(pcfg.tp):
            r = coords_rank(0, tp_rank, pp_rank, pcfg)
            files[r] = (ck.shard_name("model", r, world), ck.shard_name("optim", r, world))
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


class EngineStep:
    """Forward/backward through ParallelEngine plus the trainer's update, for one rank."""

    def __init__(self, model, cfg, pcfg, groups, log):
        import mindspore as ms
        from mindloom_parallel import ParallelEngine
        from mindspore import Parameter

        from mindloom_train import _step

        self.cfg, self.pcfg, self.groups = cfg, pcfg, groups
        self.model_cfg = model.config
        self.engine = ParallelEngine(model, pcfg, groups, cfg.training.micro_batch_size)
        self.params = list(self.engine.params)
        self.names = list(self.engine.param_names)
        self.flags = _step.decay_flags(self.params, cfg.optimizer.decay_embeddings)
        sizes = [int(np.prod(p.shape)) for p in self.params]
        dp = groups.dp.size
        if pcfg.zero_stage == 1 and dp > 1:
            self.owner = zero_owners(sizes, dp)
        else:
            self.owner = [groups.dp_rank] * len(self.params)
        self.owned = [i for i, o in enumerate(self.owner) if o == groups.dp_rank]
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
        self._ms = ms
        self.rank_metrics = {"comm_s": 0.0, "step_s": 0.0}
        kept = sum(sizes[i] for i in self.owned)
        log(
            f"parallel: {groups.describe()}; ParallelEngine (PyNative), "
            f"{len(self.params)} local tensors ({sum(sizes) / 1e6:.3f}M values), AdamW state "
            f"for {kept / 1e6:.3f}M" + (" (ZeRO-1)" if self.owner != [groups.dp_rank] * len(sizes) else "")
        )  # fmt: skip

    # ------------------------------------------------------------------ the step

    def step(self, micro_batches: list[dict], hyper: np.ndarray, *, stop: bool, time_up: bool):
        """-> (loss, grad_norm, ok, stop_any, time_up_any); every rank gets the same values."""
        import mindspore as ms
        from mindloom_parallel import comm_stats
        from mindloom_parallel._comm import all_gather
        from mindspore import Tensor, ops

        from mindloom_train import _step as S

        t0 = time.perf_counter()
        batch = {k: np.concatenate([b[k] for b in micro_batches]) for k in micro_batches[0]}
        loss, grads = self.engine.forward_backward(batch)  # resets comm_stats
        loss = float(np.float32(loss) + np.float32(hyper[S.H_LPOISON]))
        grads = list(grads)
        if hyper[S.H_GMULT] != 1.0:
            grads = [g * float(hyper[S.H_GMULT]) for g in grads]
        if hyper[S.H_GPOISON] != 0.0 and grads:
            grads[0] = grads[0] + float(hyper[S.H_GPOISON])
        gnorm = self.engine.grad_norm(grads)
        # one tiny all-gather makes every rank take the same branch and log the same kind
        # of anomaly (a fault or a signal on one rank must not leave the others waiting
        # in a collective): any non-finite loss, the largest grad norm, any stop / time up
        mine = np.array([[loss, gnorm, float(stop), float(time_up)]], np.float32)
        every = all_gather(Tensor(mine), self.groups.world, 0, timed=False).asnumpy()
        if not np.isfinite(every[:, 0]).all():
            loss = float("nan")
        gnorm = float("inf") if not np.isfinite(every[:, 1]).all() else float(every[:, 1].max())
        stop_any, time_up_any = bool(every[:, 2].max() > 0), bool(every[:, 3].max() > 0)
        ok = bool(np.isfinite(loss) and np.isfinite(gnorm) and gnorm <= float(hyper[S.H_SPIKE]))
        if ok:
            clip = np.float32(hyper[S.H_CLIP])
            factor = (
                min(clip / (np.float32(gnorm) + np.float32(1e-6)), np.float32(1.0))
                if clip > 0
                else np.float32(1.0)
            )
            h = {k: Tensor(np.float32(hyper[k])) for k in (S.H_LR, S.H_B1, S.H_B2, S.H_EPS)}
            for i in self.owned:
                S._adamw(self.params[i], self.exp_avg[i], self.exp_avg_sq[i], h[S.H_LR],
                         h[S.H_B1], h[S.H_B2], h[S.H_EPS],
                         Tensor(np.float32(hyper[S.H_WD] * self.flags[i])),
                         grads[i].astype(ms.float32) * Tensor(np.float32(factor)))  # fmt: skip
            self._share_zero_updates(ops)
        step_s = time.perf_counter() - t0
        self.rank_metrics = {"comm_s": comm_stats.time_s, "step_s": step_s}
        return loss, gnorm, ok, stop_any, time_up_any

    def _share_zero_updates(self, ops) -> None:
        """ZeRO-1: owners hold the new values; one dp all-reduce gives them to every replica."""
        from mindloom_parallel._comm import all_reduce

        dp = self.groups.dp
        if dp.size == 1 or len(self.owned) == len(self.params):
            return
        flat = ops.concat(
            [
                p.reshape(-1) if self.owner[i] == dp.index else ops.zeros(p.size, p.dtype)
                for i, p in enumerate(self.params)
            ]
        )
        full = all_reduce(flat, dp)
        off = 0
        for i, p in enumerate(self.params):
            n = int(p.size)
            if self.owner[i] != dp.index:
                ops.assign(p, full[off : off + n].reshape(p.shape))
            off += n

    def gather_metrics(self, comm_s: float, step_s: float) -> list[tuple[float, float]]:
        """Every rank's (comm_s, step_s), in rank order (a world all-gather)."""
        from mindloom_parallel._comm import all_gather
        from mindspore import Tensor

        mine = Tensor(np.array([[comm_s, step_s]], np.float32))
        both = all_gather(mine, self.groups.world, 0, timed=False).asnumpy()
        return [(float(a), float(b)) for a, b in both]

    # ------------------------------------------------------------------ eval

    def eval_loss(self, batch: dict) -> float:
        return self.engine.eval_loss(batch)

    # ------------------------------------------------------------------ state

    def _local(self) -> dict[str, dict[str, np.ndarray]]:
        """This rank's contribution: weights, and the moments it owns (zeros otherwise, so
        a sum over the data-parallel replicas gives exactly one copy)."""
        w = {n: p.asnumpy() for n, p in zip(self.names, self.params)}
        m, v = {}, {}
        for i, n in enumerate(self.names):
            if i in self.owned and (self.pcfg.zero_stage == 1 or self.groups.dp_rank == 0):
                m[n] = self.exp_avg[i].asnumpy()
                v[n] = self.exp_avg_sq[i].asnumpy()
            else:
                m[n] = np.zeros(self.params[i].shape, np.float32)
                v[n] = np.zeros(self.params[i].shape, np.float32)
        return {"w": w, "m": m, "v": v}

    def gather_shards(self) -> dict[str, dict[str, np.ndarray]] | None:
        """Collective over the world: on rank 0 {file name: {key: local array}} for every
        model-parallel rank; None elsewhere."""
        from mindloom_parallel._comm import all_gather
        from mindloom_parallel._groups import rank_coords
        from mindloom_parallel._layout import rank_tensor_names, tensor_layout
        from mindspore import Tensor

        pcfg, world = self.pcfg, self.groups.world_size
        layout = tensor_layout(self.model_cfg, pcfg)

        def names_of(rank):
            return rank_tensor_names(layout, rank_coords(rank, pcfg)[2])

        def size_of(rank):
            return sum(int(np.prod(layout[n].local_shape(pcfg.tp))) for n in names_of(rank))

        longest = max(size_of(r) for r in range(world))
        loc = self._local()
        mine = names_of(self.groups.rank)
        flat = np.zeros((1, 3 * longest), np.float32)
        off = 0
        for key in ("w", "m", "v"):
            for n in mine:
                a = loc[key][n].reshape(-1)
                flat[0, off : off + a.size] = a
                off += a.size
        allv = all_gather(Tensor(flat), self.groups.world, 0, timed=False).asnumpy()
        if self.groups.rank != 0:
            return None
        _, files = chunk_metadata(self.model_cfg, pcfg, world)
        out: dict[str, dict[str, np.ndarray]] = {}
        for mrank, (mfile, ofile) in files.items():
            d0, t0, p0 = rank_coords(mrank, pcfg)
            replicas = [r for r in range(world) if rank_coords(r, pcfg)[1:] == (t0, p0)]
            names = names_of(mrank)
            shapes = [layout[n].local_shape(pcfg.tp) for n in names]
            sizes = [int(np.prod(s)) for s in shapes]
            total = sum(sizes)
            w = allv[mrank, :total]
            mv = sum(allv[r, total : 3 * total].astype(np.float64) for r in replicas)
            mv = mv.astype(np.float32)
            model, optim = {}, {}
            o = 0
            for n, s, k in zip(names, shapes, sizes):
                model[n] = w[o : o + k].reshape(s).copy()
                optim["exp_avg." + n] = mv[o : o + k].reshape(s).copy()
                optim["exp_avg_sq." + n] = mv[total + o : total + o + k].reshape(s).copy()
                o += k
            out[mfile], out[ofile] = model, optim
        return out

    def load(self, tensors: dict[str, np.ndarray], where: str) -> None:
        """Weights and moments from GLOBAL tensors (a checkpoint of any layout)."""
        from mindloom_parallel._layout import shard_tensor, tensor_layout
        from mindspore import Tensor, ops

        layout = tensor_layout(self.model_cfg, self.pcfg)
        want = set(layout) | {f"exp_avg.{n}" for n in layout} | {f"exp_avg_sq.{n}" for n in layout}
        ck.check_tensor_names(want, set(tensors), where)
        for n in layout:
            if tuple(tensors[n].shape) != layout[n].global_shape:
                raise ck.CheckpointError(
                    f"{where}: tensor {n!r} has shape {list(tensors[n].shape)}, the model "
                    f"expects {list(layout[n].global_shape)}"
                )
        self.engine.load_state({n: tensors[n] for n in layout})
        tp = self.groups.tp
        for i in self.owned:
            n = self.names[i]
            for prefix, store in (("exp_avg.", self.exp_avg), ("exp_avg_sq.", self.exp_avg_sq)):
                local = shard_tensor(np.asarray(tensors[prefix + n], np.float32), layout[n],
                                     tp.index, tp.size)  # fmt: skip
                ops.assign(store[i], Tensor(local))

    def load_weights(self, tensors: dict[str, np.ndarray]) -> None:
        """Weights only (continued pretraining), from global tensors."""
        from mindloom_parallel._layout import tensor_layout

        layout = tensor_layout(self.model_cfg, self.pcfg)
        self.engine.load_state({n: tensors[n] for n in layout})
