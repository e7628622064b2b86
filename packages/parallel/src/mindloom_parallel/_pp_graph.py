"""Pipeline parallel with compiled stages: each stage's forward and backward are graphs
(``ms.jit``), the 1F1B schedule stays in Python between them.

``PipelineGraph`` is a ``ParallelEngine`` (same constructor, same ``forward_backward``,
``eval_loss``, ``grad_norm``, checkpoint and load methods, so the trainer's update and
checkpoint code take it unchanged) whose per-micro-batch work is compiled:

- forward graph: the stage (``pipeline_stage``'s cut of the model; on the last stage
  with its loss sum over the global token count), called for 1F1B's ``fwd`` on every stage
  but the last and for evaluation;
- backward graph: ``ms.vjp`` of the same stage (one forward, kept for its backward), fed
  the incoming activation gradient (the last stage: 1.0 on its loss), recomputing the
  stage's forward
  (only the stage input is kept between the two, as the engine does); the running fp32
  sum of the weight gradients goes in and out (a pure function), and it returns the
  input gradient (the last stage also its loss: 1F1B runs its fwd and bwd back to back,
  so the last stage's forward is never run twice).

Activations and gradients cross stages between graphs through ``_comm.exchange``
(native send/recv where the backend has them; on the CPU an all-reduce of the pair's
2-rank group in which the receiver contributes zeros), timed from the host. The tied
embedding's gradient sum over the first and last stage, the sequence-parallel norm
gradients over tp and the data-parallel buckets stay the engine's (``_step``).

Tensor parallel inside a stage uses the graph region cells of ``_tp_graph`` (the
compiled TP step's), so the same class serves pp with tp / sp.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from mindloom_parallel._engine import ParallelEngine, StageQueues
from mindloom_parallel._graph_tuples import add_f32, to_f32
from mindloom_parallel._pp import one_f_one_b
from mindloom_parallel._tp_graph import VocabParallelLossSumGraph
from mindloom_parallel._zero import ZeroAdamW

__all__ = ["PipelineGraph", "ZeroAdamWGraph"]


class _Forward(nn.Cell):
    def __init__(self, stage):
        super().__init__(auto_prefix=False)
        self.stage = stage

    @ms.jit
    def construct(self, x, pos, seg, labels, mask, denom, dkey=None):
        if dkey is None:
            return self.stage(x, pos, seg, labels, mask, denom)
        return self.stage(x, pos, seg, labels, mask, denom, dkey)


class _Unpacked(nn.Cell):
    """The stage without segment ids (no packed documents): ``ms.vjp`` takes only tensors."""

    def __init__(self, stage):
        super().__init__(auto_prefix=False)
        self.stage = stage

    def construct(self, x, pos, labels, mask, denom, dkey=None):
        return self.stage(x, pos, None, labels, mask, denom, dkey)


class _Backward(nn.Cell):
    """Recomputed forward and backward of one micro-batch -> (the stage's output: the loss
    on the last stage, input gradient, ``acc`` + this micro-batch's weight gradients in
    fp32). A pure function: the running sum goes in and out (MindSpore's CPU backend ran a
    graph that adds into Parameter buffers in place ~10x slower per call from PyNative)."""

    def __init__(self, stage, weights, first: bool):
        super().__init__(auto_prefix=False)
        self.stage = stage
        self.unpacked = _Unpacked(stage)
        self.weights = weights
        self.first = first  # its input is token ids: no input gradient to send
        self.map = ops.HyperMap()  # not a loop growing a tuple (_graph_tuples)

    @ms.jit
    def construct(self, x, pos, seg, labels, mask, denom, dy, acc=None, dkey=None):
        # one forward: ms.vjp keeps it for the backward (GradOperation next to a call of
        # the stage ran the forward twice)
        if seg is None and dkey is None:  # (a None input has no gradient slot)
            out, vjp_fn = ms.vjp(self.unpacked, x, pos, labels, mask, denom,
                                 weights=self.weights)  # fmt: skip
        elif seg is None:
            out, vjp_fn = ms.vjp(self.unpacked, x, pos, labels, mask, denom, dkey,
                                 weights=self.weights)  # fmt: skip
        elif dkey is None:
            out, vjp_fn = ms.vjp(self.stage, x, pos, seg, labels, mask, denom,
                                 weights=self.weights)  # fmt: skip
        else:
            out, vjp_fn = ms.vjp(self.stage, x, pos, seg, labels, mask, denom, dkey,
                                 weights=self.weights)  # fmt: skip
        in_grads, wgrads = vjp_fn(dy)
        dx = in_grads[0]
        if self.first:
            dx = ops.zeros((), ms.float32)
        if acc is None:
            return out, dx, self.map(to_f32, wgrads)
        return out, dx, self.map(add_f32, acc, wgrads)


class _SquareSum(nn.Cell):
    """The engine's ``grad_norm`` loop (the same ops in the same order) as one graph: ~4
    PyNative ops per parameter were ~10% of the trainer's pp2 step."""

    def __init__(self, counted: tuple[bool, ...]):
        super().__init__(auto_prefix=False)
        self.counted = counted

    @ms.jit
    def construct(self, grads):
        sq = ops.zeros((1,), ms.float32)
        for i in range(len(grads)):
            if self.counted[i]:
                sq = sq + (grads[i].astype(ms.float32) ** 2).sum()
        return sq


class PipelineGraph(ParallelEngine):
    """``ParallelEngine`` for pp > 1 with each stage's forward and backward compiled (see
    the module docstring). Arguments as ``ParallelEngine``'s."""

    def _split(self, model, pcfg, groups):
        from mindloom_parallel._tp_graph import parallelize_llama_graph

        model = parallelize_llama_graph(model, pcfg, groups)
        model.set_train(True)  # the region cells the split added start in inference mode
        return model

    def _loss_cell(self, group, start: int):
        # the engine's VocabParallelLossSum as graph ops
        return VocabParallelLossSumGraph(group, start)

    def _build_graphs(self) -> None:
        weights = ms.ParameterTuple(self.params)
        self._fwd_graph = _Forward(self.stage)
        self._bwd_graph = _Backward(self.stage, weights, self.groups.is_first_stage)
        self._square_sum = _SquareSum(self._norm_counted())

    def grad_norm(self, grads) -> float:
        return self._global_norm(self._square_sum(ms.mutable(tuple(grads))))

    def _forward_only(self, x, mb, denom):
        return self._fwd_graph(x, mb["position_ids"], mb["segment_ids"], mb["labels"],
                               mb["loss_mask"], denom, mb.get("dropout_key"))  # fmt: skip

    def _backward(self, x, mb, denom, dy, acc):
        if acc is not None:  # a tuple input is a graph constant unless mutable (recompiles)
            acc = ms.mutable(tuple(acc))
        return self._bwd_graph(x, mb["position_ids"], mb["segment_ids"], mb["labels"],
                               mb["loss_mask"], denom, dy, acc, mb.get("dropout_key"))  # fmt: skip

    def _no_pipeline(self, micro, denom):  # pragma: no cover - pp == 1 is not this class's
        raise NotImplementedError("PipelineGraph runs pp > 1 layouts; use ParallelEngine")

    def _one_f_one_b(self, micro, denom):
        """The engine's 1F1B loop (``_pp.one_f_one_b``) over the compiled graphs."""
        g = self.groups
        self._seq = micro[0]["tokens"].shape[1]
        shape, dtype = self._act_shape(), self.model.compute_dtype
        first, last = g.is_first_stage, g.is_last_stage
        q = StageQueues(g, shape, dtype)
        inputs: dict[int, object] = {}  # micro-batch -> stage input, until its backward
        total = ops.zeros((), ms.float32)
        one = ops.ones((), ms.float32)
        acc = None  # the weight gradients summed over the micro-batches so far
        for act in one_f_one_b(g.pp_rank, self.pcfg.pp, len(micro)):
            kind = act[0]
            if kind == "fwd":
                i = act[1]
                x = micro[i]["tokens"] if first else q.pending_in.pop(0)
                inputs[i] = x
                if not last:  # the last stage's forward runs inside its backward, next
                    q.outputs.append(self._forward_only(x, micro[i], denom))
            elif kind == "bwd":
                i = act[1]
                dy = one if last else q.pending_grad.pop(0)
                out, dx, acc = self._backward(inputs.pop(i), micro[i], denom, dy, acc)
                if last:
                    total = total + out
                if not first:
                    q.input_grads.append(dx)
            else:
                q.communicate(kind)
        return total, list(acc)


class _OwnedAdamW(nn.Cell):
    """The fused AdamW kernel over the owned parameters, one graph: the same kernel, the
    same scalars and the same gradient scaling as ``ZeroAdamW.update``'s host loop."""

    def __init__(self, opt):
        super().__init__(auto_prefix=False)
        owned = opt.owned
        self.params = ms.ParameterTuple([opt.params[i] for i in owned])
        self.m = ms.ParameterTuple([opt.exp_avg[i] for i in owned])
        self.v = ms.ParameterTuple([opt.exp_avg_sq[i] for i in owned])
        self.flags = tuple(float(opt.flags[i]) for i in owned)
        self.kernel = ops.AdamWeightDecay()

    @ms.jit
    def construct(self, grads, h):
        # h: lr, beta1, beta2, eps, weight decay, gradient factor (float32)
        done = h[0]
        for i in range(len(self.params)):
            r = self.kernel(self.params[i], self.m[i], self.v[i], h[0], h[1], h[2], h[3],
                            h[4] * self.flags[i], grads[i].astype(ms.float32) * h[5])  # fmt: skip
            done = ops.depend(done, r)
        return done


class ZeroAdamWGraph(ZeroAdamW):
    """``ZeroAdamW`` whose update of the owned parameters is one compiled graph (the same
    fused kernel and scalars); the ZeRO-1 share of the new values stays the host's
    all-reduce. Moments load in place, so the graph keeps holding them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._graph = _OwnedAdamW(self)

    def update(self, grads, lr, beta1, beta2, eps, weight_decay, grad_factor=1.0) -> None:
        import numpy as np
        from mindspore import Tensor

        h = Tensor(np.array([lr, beta1, beta2, eps, weight_decay, grad_factor], np.float32))
        # mutable: a plain tuple of tensors is a constant of the jit call, which then took
        # ~110-135 ms per step from PyNative on the debug preset here (3 ms as mutable)
        self._graph(ms.mutable(tuple(grads[i] for i in self.owned)), h)
        self._share_updates()
