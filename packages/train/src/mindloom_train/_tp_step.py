"""Tensor parallel (and tensor + sequence parallel) as the trainer's compiled step.

`CompiledRunner` keeps its `TrainStep` / `AccumStep` / `EvalStep` graphs; under a layout
with tp > 1 (pp = 1, zero_stage = 0, `context.mode: graph`) this module hands it what
changes: the model split in place by `mindloom_parallel.parallelize_llama_graph` (the
engine's split, with region cells whose collectives are graph ops), the vocab-parallel
loss net with `LlamaWithLoss`'s inputs, the gradient reducer (sequence-parallel norm
gradients over tp, then the data-parallel buckets), the global gradient norm over the
tensor-parallel shards, and the loss / stop-flag mean over the world. Checkpoints are the
engine path's: one model and one optimizer file per model-parallel rank, gathered to rank
0 (`ZeroAdamW.gather_shards` over the step's own moments), loaded from global tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from mindloom_train import _checkpoint as ck


def compiled_tp(dims, mode: str) -> bool:
    """Whether a layout runs the compiled tensor-parallel step: tp > 1 without pipeline
    stages, in graph mode (`context.mode: pynative` keeps the engine). With ZeRO-1 (dp > 1)
    the step's update is `ZeroShardUpdate` over each tp rank's data-parallel group
    (`_zero_step.CompiledZero` on the local shards)."""
    return dims.tp > 1 and dims.pp == 1 and mode == "graph"


class CompiledTP:
    """The split model and the graph cells of a compiled tensor-parallel step."""

    def __init__(self, built, cfg, runtime, log: Callable[[str], None]):
        from mindloom_parallel import (
            GradReducer,
            TPGradReducer,
            TPLlamaWithLoss,
            TPNormSquare,
            parallelize_llama_graph,
        )

        from mindloom_train import _step

        g, pcfg = runtime.groups, runtime.pcfg
        self.groups, self.pcfg, self.mcfg = g, pcfg, built.mcfg
        model = parallelize_llama_graph(built.model, pcfg, g)
        model.set_train(True)  # the cells the split added start in inference mode
        loss_net = TPLlamaWithLoss(model, g.tp)
        params = list(model.trainable_params())
        self.names = [p.name for p in params]
        self.built = dataclasses.replace(built, loss_net=loss_net, params=params)
        dp_red = (
            GradReducer(params, g.dp, pcfg.bucket_size_mb, mean=True) if g.dp.size > 1 else None
        )
        self.grad_reducer = TPGradReducer(params, self.names, g, pcfg.sequence_parallel, dp_red)
        # the loss is the same on every TP rank: a world mean gives the data-parallel mean
        # and carries the stop flags of every rank (see _runner._encode_flags)
        self.loss_reducer = _step.MeanOver(g.world.name, g.world.size)
        self.eval_reducer = _step.MeanOver(g.world.name, g.world.size)
        self.norm_reducer = TPNormSquare(self.names, g)
        self.params = params
        probe_dp = GradReducer(params, g.dp, pcfg.bucket_size_mb, mean=True) if dp_red else None
        self.probe = TPCommProbe(g, pcfg, built.mcfg, cfg.training.micro_batch_size,
                                 cfg.train_dataset.seq_length, cfg.grad_accum_steps, params,
                                 probe_dp)  # fmt: skip
        self.io = None
        total = sum(int(np.prod(p.shape)) for p in params)
        sp = " + sequence parallel" if pcfg.sequence_parallel else ""
        log(f"parallel: {g.describe()}; compiled tensor parallel{sp} (GRAPH_MODE), "
            f"{len(params)} local tensors ({total / 1e6:.3f}M values)")  # fmt: skip

    def attach(self, train_step, decay_flags, zero=None) -> None:
        """Checkpoint I/O over the step's own moments: a ``ZeroAdamW`` (zero_stage 0) whose
        moment tensors are the `TrainStep`'s, used only to gather and load them; under
        ZeRO-1 (`zero`, a `_zero_step.CompiledZero`) its zero_stage-1 one over the owned
        moments."""
        from mindloom_parallel import ZeroAdamW

        if zero is not None:
            self.io = zero.io
            return

        io = ZeroAdamW(self.params, self.names, self.groups, 0, decay_flags)
        io.exp_avg = dict(enumerate(train_step.exp_avg))
        io.exp_avg_sq = dict(enumerate(train_step.exp_avg_sq))
        self.io = io

    def layout_state(self, train_step):
        """This rank's weights and moments by global name (`_ckpt_own`), for the
        distributed checkpoint."""
        from mindloom_train._ckpt_own import LayoutState

        moments = list(zip(train_step.exp_avg, train_step.exp_avg_sq))
        return LayoutState(self.mcfg, self.pcfg, self.groups, self.names, self.params, moments)

    def checkpoint_shards(self, world: int) -> tuple[dict, dict] | None:
        """Collective over the world: every rank sends its shards, rank 0 writes them all
        (the engine path's files and metadata)."""
        from mindloom_train._parallel import chunk_metadata

        shards = self.io.gather_shards(self.mcfg, self.pcfg,
                                       lambda kind, rank: ck.shard_name(kind, rank, world))  # fmt: skip
        if self.groups.rank != 0:
            return None
        metadata = ck.default_metadata({}, world)
        metadata["tensors"], _ = chunk_metadata(self.mcfg, self.pcfg, world)
        return shards, metadata

    def _load_weights(self, tensors: dict[str, np.ndarray], where: str) -> None:
        import mindspore as ms
        from mindloom_parallel import shard_tensor, tensor_layout
        from mindspore import ops

        layout = tensor_layout(self.mcfg, self.pcfg)
        tp = self.groups.tp
        for n, p in zip(self.names, self.params):
            if tuple(tensors[n].shape) != layout[n].global_shape:
                raise ck.CheckpointError(
                    f"{where}: tensor {n!r} has shape {list(tensors[n].shape)}, the model "
                    f"expects {list(layout[n].global_shape)}"
                )
            local = shard_tensor(np.asarray(tensors[n]), layout[n], tp.index, tp.size)
            # in place: the compiled graphs hold these very parameters
            ops.assign(p, ms.Tensor(local, p.dtype))

    def load(self, tensors: dict[str, np.ndarray], where: str) -> None:
        """Weights and moments from GLOBAL tensors (a checkpoint of any layout)."""
        from mindloom_parallel import tensor_layout

        layout = tensor_layout(self.mcfg, self.pcfg)
        want = set(layout) | {f"exp_avg.{n}" for n in layout} | {f"exp_avg_sq.{n}" for n in layout}
        ck.check_tensor_names(want, set(tensors), where)
        self._load_weights(tensors, where)
        self.io.load_moments(tensors, self.mcfg, self.pcfg)

    def load_weights(self, tensors: dict[str, np.ndarray], where: str) -> None:
        """Weights only (continued pretraining), from global tensors."""
        from mindloom_parallel import tensor_layout

        ck.check_tensor_names(set(tensor_layout(self.mcfg, self.pcfg)), set(tensors), where)
        self._load_weights(tensors, where)


def tp_collectives(num_layers: int, sequence_parallel: bool) -> int:
    """All-reduces of a [B, S, D] activation in one micro-batch's forward and backward:
    2 + 4 L region cells (the embedding's exit, per layer two entries and two exits, the
    final norm's entry), one collective each without sequence parallel (f in backward, g
    in forward), two with it (a gather and a reduce-scatter each way, both all-reduces of
    the full sequence on the CPU backend)."""
    regions = 2 + 4 * num_layers
    return 2 * regions if sequence_parallel else regions


class TPCommProbe:
    """The compiled TP step's collectives in a graph of their own, for `comm_fields`: the
    same number of all-reduces of the same [B, S, D] bytes on the TP group per
    micro-batch, the loss's three row-sized ones, and the data-parallel buckets when
    dp > 1. The step runs them inside its graph, where the host cannot time them; this
    is the estimate the dp path makes the same way (its `comm_probe`)."""

    def __init__(self, groups, pcfg, mcfg, micro_batch_size: int, seq_length: int, accum: int,
                 params, dp_reducer=None):  # fmt: skip
        import mindspore as ms
        from mindspore import nn, ops

        b, s, d = micro_batch_size, seq_length, mcfg.hidden_size
        n_act = accum * tp_collectives(mcfg.num_layers, pcfg.sequence_parallel)
        n_row = accum * 3

        class Probe(nn.Cell):
            def __init__(self):
                super().__init__()
                self.tp = ops.AllReduce(ops.ReduceOp.SUM, group=groups.tp.name)
                self.dp = dp_reducer

            def construct(self, bufs):
                act, row = bufs[0], bufs[1]
                for _ in range(n_act):  # chained: one after another, as in the step
                    act = self.tp(act)
                for _ in range(n_row):
                    row = self.tp(row)
                out = (act, row)
                if self.dp is not None:
                    out = out + self.dp(bufs[2:])
                return out

        self.cell = Probe()
        bufs = (ms.Tensor(np.zeros((b, s, d), np.float32)), ms.Tensor(np.zeros(b * s, np.float32)))
        if dp_reducer is not None:
            bufs = bufs + tuple(ms.Tensor(np.zeros(p.shape, np.float32)) for p in params)
        self.inputs = bufs
