"""ParallelEngine: one forward/backward over a data-parallel rank's batch under any
(dp, tp, pp, sp) layout, returning the global loss and fully reduced gradients.

The trainer keeps its optimizer, LR schedule, clipping and logging; for world size 1 it
may keep its own compiled step, and the engine reproduces it exactly (tests prove it).
"""

from __future__ import annotations

import time

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindloom_parallel._comm import CommRecorder, CommStats, all_reduce, exchange
from mindloom_parallel._config import ParallelConfigError
from mindloom_parallel._dp import GradReducer
from mindloom_parallel._groups import ParallelGroups
from mindloom_parallel._pp import one_f_one_b, pipeline_stage, stage_layers
from mindloom_parallel._tp import VocabParallelLossSum, parallelize_llama, vocab_start

__all__ = ["ParallelEngine"]


class _Stage(nn.Cell):
    """This rank's pipeline stage (the model cut by ``pipeline_stage``), and on the last
    stage its loss: the model's own forward, so every layout computes the same function."""

    def __init__(self, model, last: bool, loss_sum):
        super().__init__(auto_prefix=False)
        self.model = model
        self.last = last
        self.loss_sum = loss_sum

    def construct(self, x, position_ids, segment_ids, labels, loss_mask, denom, dropout_key=None):
        out = self.model(x, position_ids, segment_ids, dropout_key)
        if not self.last:
            return out
        return self.loss_sum(out, labels, loss_mask) / denom


class StageQueues:
    """What a pipeline stage's 1F1B actions hand each other, and its communication
    actions (``_pp.one_f_one_b``: each one exchange with a neighbour stage)."""

    def __init__(self, groups, shape, dtype):
        self.groups, self.shape, self.dtype = groups, shape, dtype
        self.pending_in: list = []  # received activations, in micro-batch order
        self.pending_grad: list = []  # received output gradients, in micro-batch order
        self.outputs: list = []  # forward outputs still to be sent, in order
        self.input_grads: list = []  # input gradients still to be sent, in order

    def communicate(self, kind: str) -> None:
        g, shape, dtype = self.groups, self.shape, self.dtype
        if kind == "send_fwd":
            exchange(self.outputs.pop(0), None, dtype, g.pp_next)
        elif kind == "recv_fwd":
            self.pending_in.append(exchange(None, shape, dtype, g.pp_prev))
        elif kind == "send_fwd_recv_bwd":
            self.pending_grad.append(exchange(self.outputs.pop(0), shape, dtype, g.pp_next))
        elif kind == "send_bwd_recv_fwd":
            self.pending_in.append(exchange(self.input_grads.pop(0), shape, dtype, g.pp_prev))
        elif kind == "recv_bwd":
            self.pending_grad.append(exchange(None, shape, dtype, g.pp_next))
        elif kind == "send_bwd":
            exchange(self.input_grads.pop(0), None, dtype, g.pp_prev)
        else:
            raise ValueError(f"unknown pipeline action {kind!r}")


class ParallelEngine:
    """Forward and backward of one optimizer step for this rank.

    ``model``: a ``mindloom_model.Llama`` built identically (same seed) on every rank; it is
    split in place (TP via ``parallelize_llama``, PP by keeping this stage's layers).
    ``micro_batch_size``: samples per micro-batch; each step consumes
    ``micro_batch_size * micro_batch_num`` samples on each data-parallel rank.

    ``params`` / ``param_names``: the parameters this rank owns and updates (local shards),
    in a fixed order; ``forward_backward`` returns gradients in that order.
    """

    def __init__(self, model, pcfg, groups: ParallelGroups, micro_batch_size: int):
        # this engine's communication time since the start of its last step (the ZeRO-1
        # update records into it too, see ZeroAdamW): its own groups carry the recorder,
        # which points at comm_stats while a step runs
        self.comm_stats = CommStats()
        self._recorder = CommRecorder()
        groups = groups.with_recorder(self._recorder)
        self.pcfg, self.groups = pcfg, groups
        self.micro_batch_size = micro_batch_size
        self.model = self._split(model, pcfg, groups)
        cfg = model.config
        self.model_config = cfg
        self.tp_group = groups.tp
        self.sp = bool(pcfg.sequence_parallel) and groups.tp.size > 1
        first, last = groups.is_first_stage, groups.is_last_stage
        self.layer_ids = stage_layers(cfg.num_layers, pcfg.pp, groups.pp_rank)
        self.loss_sum = self._loss_cell(groups.tp, vocab_start(cfg, groups.tp))
        pipeline_stage(model, self.layer_ids, first, last)
        self.stage = _Stage(model, last, self.loss_sum)
        tied = bool(cfg.tie_embeddings)
        keep = []
        for name, p in model.parameters_and_names():
            top = name.split(".")[0]
            if top == "embed":
                mine = first or (last and tied)
            elif top == "layers":
                mine = int(name.split(".")[1]) in self.layer_ids
            else:  # norm, lm_head
                mine = last
            if mine:
                keep.append((name, p))
        self.param_names = [n for n, _ in keep]
        self.params = [p for _, p in keep]
        for name, p in keep:
            p.name = name
        # gradients that are partial sums over TP ranks (sequence-parallel norms)
        self._sp_idx = [
            i for i, n in enumerate(self.param_names) if self.sp and n.endswith("norm.weight")
        ]
        # the tied embedding lives on the first and the last stage: sum its two gradients
        self._embed_idx = [
            i
            for i, n in enumerate(self.param_names)
            if tied and pcfg.pp > 1 and n == "embed.weight"
        ]
        self.reducer = GradReducer(self.params, groups.dp, pcfg.bucket_size_mb)
        self.metrics: dict = {}
        self._build_graphs()

    # hooks: the split, the loss and compiled graphs of a subclass (_pp_graph.PipelineGraph)

    def _split(self, model, pcfg, groups):
        return parallelize_llama(model, pcfg, groups)

    def _loss_cell(self, group, start: int):
        return VocabParallelLossSum(group, start)

    def _build_graphs(self) -> None:
        pass

    # ------------------------------------------------------------------ batches

    def _check_batch(self, batch: dict) -> int:
        want = self.micro_batch_size * self.pcfg.micro_batch_num
        n = batch["tokens"].shape[0]
        if n != want:
            raise ParallelConfigError(
                f"rank {self.groups.rank}: got {n} samples, but a data-parallel rank takes "
                f"micro_batch_size*micro_batch_num = {self.micro_batch_size}*"
                f"{self.pcfg.micro_batch_num} = {want} per step (its slice of the global batch; "
                "see mindloom_parallel.dp_slice)"
            )
        return n

    def _micro(self, batch: dict, i: int) -> dict:
        b = self.micro_batch_size
        tokens = batch["tokens"][i * b : (i + 1) * b]
        s = tokens.shape[1]
        pos = batch.get("position_ids")
        pos = (
            np.broadcast_to(np.arange(s, dtype=np.int32), tokens.shape)
            if pos is None
            else pos[i * b : (i + 1) * b]
        )
        seg = batch.get("segment_ids")
        mask = batch.get("loss_mask")
        mask = np.ones(tokens.shape, np.float32) if mask is None else mask[i * b : (i + 1) * b]
        return {
            "tokens": Tensor(np.ascontiguousarray(tokens, dtype=np.int32)),
            "position_ids": Tensor(np.ascontiguousarray(pos, dtype=np.int32)),
            "segment_ids": None
            if seg is None
            else Tensor(np.ascontiguousarray(seg[i * b : (i + 1) * b], dtype=np.int32)),
            "labels": Tensor(
                np.ascontiguousarray(batch["labels"][i * b : (i + 1) * b], dtype=np.int32)
            ),
            "loss_mask": Tensor(np.ascontiguousarray(mask, dtype=np.float32)),
        }

    # ------------------------------------------------------------------ step

    def forward_backward(self, batch: dict, dropout_keys=None):
        """-> (loss: float, grads: tuple of Tensors aligned with ``self.params``).

        ``batch``: this data-parallel rank's slice of the global batch (numpy arrays
        ``tokens``, ``labels`` and optionally ``position_ids``, ``segment_ids``,
        ``loss_mask``). The loss is the mean over every unmasked token of the GLOBAL batch,
        the same number on every rank; the gradients are summed over data-parallel ranks.
        ``dropout_keys``: one ``mindloom_model.dropout_key`` per micro-batch, the same on
        every tp/pp rank of a replica, so a resumed step redraws the same masks (None: the
        model's stateful dropout, which does not resume exactly).
        """
        t0 = time.perf_counter()
        self.comm_stats.reset()
        with self._recorder.recording(self.comm_stats):
            loss_value, grads = self._step(batch, dropout_keys)
        step_s = time.perf_counter() - t0
        stats = self.comm_stats
        self.metrics = {
            **stats.snapshot(),
            "step_compute_s": step_s,
            "comm_share": stats.time_s / step_s if step_s > 0 else 0.0,
        }
        return loss_value, tuple(grads)

    def _step(self, batch: dict, dropout_keys=None):
        self._check_batch(batch)
        g = self.groups
        mask = batch.get("loss_mask")
        local_tokens = float(
            np.prod(batch["labels"].shape) if mask is None else np.asarray(mask, np.float64).sum()
        )
        denom = all_reduce(Tensor(np.array([local_tokens], np.float32)), g.dp, host=True)
        denom = ops.maximum(denom.reshape(()), ops.ones((), ms.float32))
        nmb = self.pcfg.micro_batch_num
        micro = [self._micro(batch, i) for i in range(nmb)]
        if dropout_keys is not None:
            if len(dropout_keys) != nmb:
                raise ParallelConfigError(
                    f"rank {g.rank}: {len(dropout_keys)} dropout keys for {nmb} micro-batches"
                )
            for mb, key in zip(micro, dropout_keys):
                mb["dropout_key"] = key
        if self.pcfg.pp == 1:
            loss, grads = self._no_pipeline(micro, denom)
        else:
            loss, grads = self._one_f_one_b(micro, denom)
        grads = list(grads)
        for i in self._sp_idx:
            grads[i] = all_reduce(grads[i], g.tp, host=True)
        for i in self._embed_idx:
            grads[i] = all_reduce(grads[i], g.embed, host=True)
        t_red = time.perf_counter()
        grads = self.reducer(tuple(grads))
        if g.dp.size > 1:
            # the bucketed reducer is a Cell (usable compiled) and so not timed per call
            _sync()
            self.comm_stats.time_s += time.perf_counter() - t_red
            self.comm_stats.calls += len(self.reducer.buckets)
        loss = all_reduce(loss.reshape((1,)), g.dp, host=True)
        loss = all_reduce(loss, g.pp, host=True)  # only the last stage holds a non-zero loss
        loss_value = float(loss.asnumpy()[0])
        return loss_value, grads

    def _fwd(self, x, mb, denom):
        def fn(inp):
            return self.stage(inp, mb["position_ids"], mb["segment_ids"], mb["labels"],
                              mb["loss_mask"], denom, mb.get("dropout_key"))  # fmt: skip

        return ms.vjp(fn, x, weights=self.params)

    def _forward_only(self, x, mb, denom):
        return self.stage(x, mb["position_ids"], mb["segment_ids"], mb["labels"],
                          mb["loss_mask"], denom, mb.get("dropout_key"))  # fmt: skip

    def _no_pipeline(self, micro, denom):
        total, acc = None, None
        one = ops.ones((), ms.float32)
        for mb in micro:
            out, vjp_fn = self._fwd(mb["tokens"], mb, denom)
            _, wgrads = vjp_fn(one)
            total = out if total is None else total + out
            acc = list(wgrads) if acc is None else [a + b for a, b in zip(acc, wgrads)]
        return total, acc

    def _act_shape(self):
        cfg = self.model_config
        s = self._seq // (self.tp_group.size if self.sp else 1)
        return (self.micro_batch_size, s, cfg.hidden_size)

    def _one_f_one_b(self, micro, denom):
        g = self.groups
        self._seq = micro[0]["tokens"].shape[1]
        shape = self._act_shape()
        dtype = self.model.compute_dtype
        first, last = g.is_first_stage, g.is_last_stage
        acts = one_f_one_b(g.pp_rank, self.pcfg.pp, len(micro))
        q = StageQueues(g, shape, dtype)
        inputs: dict[int, object] = {}  # micro-batch -> stage input, until its backward
        total = ops.zeros((), ms.float32)
        acc = None
        one = ops.ones((), ms.float32)
        for act in acts:
            kind = act[0]
            if kind == "fwd":
                i = act[1]
                x = micro[i]["tokens"] if first else q.pending_in.pop(0)
                # MindSpore's PyNative keeps one taped forward at a time, so the tape is
                # rebuilt at the backward (one extra forward per micro-batch; like full
                # activation recompute, only the stage input is kept)
                out = self._forward_only(x, micro[i], denom)
                inputs[i] = x
                if last:
                    total = total + out
                else:
                    q.outputs.append(out)
            elif kind == "bwd":
                i = act[1]
                dy = one if last else q.pending_grad.pop(0)
                _, vjp_fn = self._fwd(inputs.pop(i), micro[i], denom)
                in_grads, wgrads = vjp_fn(dy)
                acc = list(wgrads) if acc is None else [a + b for a, b in zip(acc, wgrads)]
                if not first:
                    q.input_grads.append(in_grads[0])
            else:
                q.communicate(kind)
        return total, acc

    def eval_loss(self, batch: dict) -> float:
        """Forward only: the mean loss over every unmasked token of the global batch (this
        rank's slice, any multiple of ``micro_batch_size`` samples), the same on every rank.
        Activations flow stage to stage micro-batch by micro-batch; nothing is taped."""
        g = self.groups
        n, b = batch["tokens"].shape[0], self.micro_batch_size
        if n % b:
            raise ParallelConfigError(
                f"rank {g.rank}: an eval batch of {n} samples is not a multiple of "
                f"micro_batch_size = {b}"
            )
        mask = batch.get("loss_mask")
        local_tokens = float(
            np.prod(batch["labels"].shape) if mask is None else np.asarray(mask, np.float64).sum()
        )
        denom = all_reduce(
            Tensor(np.array([local_tokens], np.float32)), g.dp, timed=False, host=True
        )
        denom = ops.maximum(denom.reshape(()), ops.ones((), ms.float32))
        self._seq = batch["tokens"].shape[1]
        shape, dtype = self._act_shape(), self.model.compute_dtype
        total = ops.zeros((), ms.float32)
        for i in range(n // b):
            mb = self._micro(batch, i)
            x = mb["tokens"] if g.is_first_stage else exchange(None, shape, dtype, g.pp_prev)
            out = self._forward_only(x, mb, denom)
            if g.is_last_stage:
                total = total + out
            else:
                exchange(out, None, dtype, g.pp_next)
        loss = all_reduce(total.reshape((1,)), g.dp, timed=False, host=True)
        loss = all_reduce(loss, g.pp, timed=False, host=True)
        return float(loss.asnumpy()[0])

    # ------------------------------------------------------------------ helpers

    def grad_norm(self, grads) -> float:
        """The global L2 norm of the full model's gradient (every shard counted once)."""
        sq = ops.zeros((1,), ms.float32)
        for counted, gr in zip(self._norm_counted(), grads):
            if counted:
                sq = sq + (gr.astype(ms.float32) ** 2).sum()
        return self._global_norm(sq)

    def _norm_counted(self) -> tuple[bool, ...]:
        """Per parameter: whether this rank's copy counts in the global norm."""
        g = self.groups
        return tuple(
            not (g.tp.index > 0 and name.endswith("norm.weight"))  # replicated over TP
            and not (name == "embed.weight" and self._embed_idx and not g.is_first_stage)
            for name in self.param_names  # (the second: the tied copy on the last stage)
        )

    def _global_norm(self, sq) -> float:
        sq = all_reduce(sq, self.groups.mp, host=True)
        return float(np.sqrt(sq.asnumpy()[0]))

    def load_state(self, full_state: dict) -> None:
        """Set this rank's parameters from FULL tensors (name -> global numpy array), e.g.
        a checkpoint assembled from any other layout with ``assemble_state``."""
        from mindloom_parallel._layout import shard_tensor, tensor_layout

        layout = tensor_layout(self.model_config, self.pcfg)
        for name, p in zip(self.param_names, self.params):
            if name not in full_state:
                raise KeyError(f"state has no tensor {name!r}")
            local = shard_tensor(
                np.asarray(full_state[name]),
                layout[name],
                self.groups.tp.index,
                self.groups.tp.size,
            )
            ops.assign(p, Tensor(local, p.dtype))

    def local_state(self) -> dict[str, np.ndarray]:
        """This rank's parameters (local shards) by global name, as numpy."""
        return {n: p.asnumpy() for n, p in zip(self.param_names, self.params)}


def _sync():
    sync = getattr(getattr(ms, "runtime", None), "synchronize", None)
    if sync is not None:
        sync()
