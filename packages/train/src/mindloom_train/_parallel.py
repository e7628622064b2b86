"""The trainer's step under a tensor / pipeline / ZeRO-1 layout (`mindloom launch`).

The world-size-1, plain data-parallel and (in graph mode) tensor-parallel runs keep their
compiled `TrainStep` (`_tp_step`). Any other layout runs here, on `mindloom_parallel`'s public API: `ParallelEngine` does forward and
backward for this rank (PyNative), `ZeroAdamW` applies the update to this rank's shards
(ZeRO-1 ownership, the same fused AdamW kernel as the compiled step, the updated values
shared over the data-parallel replicas) and gathers the checkpoint shards. What stays
here is the trainer's side of the step: the hyper vector's scalars, the fault poisons, the
guards and clipping that every rank decides the same way.
"""

from __future__ import annotations

import time

import numpy as np

from mindloom_train import _checkpoint as ck


def chunk_metadata(model_cfg, pcfg, world: int) -> tuple[dict, dict]:
    """metadata.json tensor entries for a checkpoint written by `EngineStep.gather_shards`,
    and {model rank: (model file, optim file)}, files named as every checkpoint's."""
    from mindloom_parallel import chunk_metadata as chunks

    return chunks(model_cfg, pcfg, lambda kind, rank: ck.shard_name(kind, rank, world))


class EngineStep:
    """Forward/backward through ParallelEngine plus the trainer's update, for one rank.
    A subclass swaps the engine and the optimizer (mindloom_parallel's public names) and
    says what it runs in the log line."""

    ENGINE, OPTIMIZER = "ParallelEngine", "ZeroAdamW"
    DESCRIPTION = "ParallelEngine (PyNative)"

    def __init__(self, model, cfg, pcfg, groups, log):
        import mindloom_parallel

        from mindloom_train import _step

        engine_cls = getattr(mindloom_parallel, self.ENGINE)
        optimizer_cls = getattr(mindloom_parallel, self.OPTIMIZER)
        self.cfg, self.pcfg, self.groups = cfg, pcfg, groups
        self.model_cfg = model.config
        self.engine = engine_cls(model, pcfg, groups, cfg.training.micro_batch_size)
        self.params = list(self.engine.params)
        self.names = list(self.engine.param_names)
        self.opt = optimizer_cls(self.params, self.names, groups, pcfg.zero_stage,
                                 _step.decay_flags(self.params, cfg.optimizer.decay_embeddings),
                                 comm_stats=self.engine.comm_stats)  # fmt: skip
        self.exp_avg, self.exp_avg_sq = self.opt.exp_avg, self.opt.exp_avg_sq
        self.rank_metrics = {"comm_s": 0.0, "step_s": 0.0}
        total = sum(self.opt.sizes)
        log(
            f"parallel: {groups.describe()}; {self.DESCRIPTION}, "
            f"{len(self.params)} local tensors ({total / 1e6:.3f}M values), AdamW state "
            f"for {self.opt.state_size / 1e6:.3f}M" + (" (ZeRO-1)" if self.opt.sharded else "")
        )  # fmt: skip

    # ------------------------------------------------------------------ the step

    def step(self, micro_batches: list[dict], hyper: np.ndarray, *, stop: bool, time_up: bool,
             dropout_keys=None):  # fmt: skip
        """-> (loss, grad_norm, ok, stop_any, time_up_any); every rank gets the same values.
        ``dropout_keys``: one per micro-batch (see ``ParallelEngine.forward_backward``)."""
        from mindloom_parallel import gather_rows

        from mindloom_train import _step as S

        t0 = time.perf_counter()
        batch = {k: np.concatenate([b[k] for b in micro_batches]) for k in micro_batches[0]}
        loss, grads = self.engine.forward_backward(batch, dropout_keys)  # resets comm_stats
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
        every = gather_rows([loss, gnorm, float(stop), float(time_up)], self.groups.world)
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
            self.opt.update(grads, hyper[S.H_LR], hyper[S.H_B1], hyper[S.H_B2], hyper[S.H_EPS],
                            hyper[S.H_WD], factor)  # fmt: skip
        step_s = time.perf_counter() - t0
        self.rank_metrics = {"comm_s": self.engine.comm_stats.time_s, "step_s": step_s}
        return loss, gnorm, ok, stop_any, time_up_any

    def gather_metrics(self, comm_s: float, step_s: float) -> list[tuple[float, float]]:
        """Every rank's (comm_s, step_s), in rank order (a world all-gather)."""
        from mindloom_parallel import gather_rows

        both = gather_rows([comm_s, step_s], self.groups.world)
        return [(float(a), float(b)) for a, b in both]

    # ------------------------------------------------------------------ eval

    def eval_loss(self, batch: dict) -> float:
        return self.engine.eval_loss(batch)

    # ------------------------------------------------------------------ state

    def gather_shards(self) -> dict[str, dict[str, np.ndarray]] | None:
        """Collective over the world: on rank 0 {file name: {key: local array}} for every
        model-parallel rank; None elsewhere."""
        world = self.groups.world_size
        return self.opt.gather_shards(self.model_cfg, self.pcfg,
                                      lambda kind, rank: ck.shard_name(kind, rank, world))  # fmt: skip

    def load(self, tensors: dict[str, np.ndarray], where: str) -> None:
        """Weights and moments from GLOBAL tensors (a checkpoint of any layout)."""
        from mindloom_parallel import tensor_layout

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
        self.opt.load_moments(tensors, self.model_cfg, self.pcfg)

    def load_weights(self, tensors: dict[str, np.ndarray]) -> None:
        """Weights only (continued pretraining), from global tensors."""
        from mindloom_parallel import tensor_layout

        layout = tensor_layout(self.model_cfg, self.pcfg)
        self.engine.load_state({n: tensors[n] for n in layout})
