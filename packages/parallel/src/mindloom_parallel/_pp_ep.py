"""Pipeline parallel for DeepSeek-V3 (MoE, multi-token prediction), with expert parallel
inside data parallel, as compiled stage graphs; the 1F1B schedule stays in Python.

``MoEPipelineGraph`` is ``PipelineGraph``'s scheme (``_pp_graph``) for a
``mindloom_model.DeepseekV3``:

- the stage: the model cut to this stage's layers (``deepseek_stage``; names stay global).
  The first stage embeds the tokens; the last runs the final norm, the head, the main loss
  and the multi-token-prediction (MTP) blocks, which read the embedding too: the last stage
  keeps a copy of ``embed`` whose gradient is summed with the first stage's over the
  ``embed`` group (first + last stage of one data-parallel replica), as tied embeddings;
- its output: (hidden state, or on the last stage (main + w * MTP) / micro-batches; this
  stage's balance losses / micro-batches; the stats vector [main, MTP, balance, dropped,
  loads of this stage's routers]). The backward graph (``ms.vjp``, the forward recomputed
  as in ``PipelineGraph``) feeds (the incoming activation gradient, 1, 0): every stage's
  balance loss gets its gradient where its router lives, without crossing stages;
- expert parallel: ``expert_parallel`` splits this stage's MoE layers (trunk and MTP) over
  the ep group (the exchange inside the stage graphs); dense gradients are summed over dp,
  expert blocks over the expert-data-parallel group (the loss is already divided by the
  global batch's micro-batches, so no further 1/dp);
- the balancing bias of a router moves by the loads of the whole global batch: this stage's
  stats are summed over its data-parallel group (the ranks of the same stage, which see
  every token of the batch at this stage's routers), never over the pipeline (another
  stage's routers) or only the ep group (part of the batch when dp > ep).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindloom_parallel._comm import CommRecorder, CommStats, all_reduce, exchange
from mindloom_parallel._dp import GradReducer
from mindloom_parallel._engine import StageQueues
from mindloom_parallel._ep import (
    EPGradReducer,
    expert_parallel,
    init_expert_groups,
    is_expert_param,
)
from mindloom_parallel._graph_tuples import add_f32
from mindloom_parallel._pp import one_f_one_b, stage_layers
from mindloom_parallel._pp_graph import _SquareSum

__all__ = ["MoEPipelineGraph", "deepseek_stage", "moe_bias_step", "stage_routers"]

N_HEAD = 4  # stats: main, mtp, balance (weighted, as in the loss), dropped


def stage_routers(cfg, pp: int, stage: int) -> int:
    """How many routers (trunk MoE layers, then the MTP blocks on the last stage) a stage has."""
    if cfg.n_routed_experts <= 0:
        return 0
    # DeepSeek-V3's rule: layers from first_k_dense_replace on are MoE
    n = sum(1 for i in stage_layers(cfg.num_layers, pp, stage) if i >= cfg.first_k_dense_replace)
    return n + (cfg.num_nextn_predict_layers if stage == pp - 1 else 0)


def deepseek_stage(model, layer_ids, first: bool, last: bool):
    """Cut a ``DeepseekV3`` in place to one pipeline stage (global names kept): the layers
    ``layer_ids``; ``embed`` on the first stage and on the last when the MTP blocks or a
    tied head read it; the final norm, head and MTP blocks on the last. Returns it."""
    if not first and not (last and (model.tie_embeddings or len(model.mtp) > 0)):
        model.embed = None
        model.embed_dropout = None
    if not last:
        model.norm = None
        if not model.tie_embeddings:
            model.lm_head = None
        model.mtp = nn.CellList([])
    model.layers = nn.SequentialCell(OrderedDict((str(i), model.layers[i]) for i in layer_ids))
    for name, p in model.parameters_and_names():
        p.name = name  # global module paths, unique for graph mode
    return model


def moe_bias_step(biases, loads: np.ndarray, speed: float) -> None:
    """b_e += speed * sign(mean(load) - load_e) per router (``loads`` [R, E] token-slots of
    the whole global batch), in place (``ops.assign``: compiled graphs keep reading them);
    the sign as the trainer's in-graph rule, sum - E * load in exact integers."""
    loads = np.asarray(loads, np.float32).reshape(len(biases), -1)
    e = loads.shape[1]
    for b, load in zip(biases, loads):
        step = np.sign(load.sum() - e * load).astype(np.float32) * np.float32(speed)
        ops.assign(b, Tensor((b.asnumpy() + step).astype(np.float32)))


class _MoEStage(nn.Cell):
    def __init__(self, net, first: bool, last: bool, scale: float):
        super().__init__(auto_prefix=False)
        self.net, self.model = net, net.model
        self.first, self.last, self.scale = first, last, scale
        self.w = net.mtp_weight

    def construct(self, x, pos, seg, tokens, labels, mask):
        m = self.model
        cos, sin, bias = m.attention_inputs(pos, seg)
        if self.first:
            x = m.embed(x)
            if m.embed_dropout is not None:
                x = m.embed_dropout(x)
        loads = []
        aux = ops.zeros((), ms.float32)
        dropped = ops.zeros((), ms.float32)
        for layer in m.layers:
            x, load, drop, a = layer(x, cos, sin, bias)
            if layer.is_moe:
                loads.append(load)
                dropped = dropped + drop
                aux = aux + a
        main = ops.zeros((), ms.float32)
        mtp = ops.zeros((), ms.float32)
        if self.last:
            main, mtp, mtp_loads, drop, a = self.net.head_losses(x, cos, sin, bias, tokens,
                                                                 labels, seg, mask)  # fmt: skip
            if mtp_loads is not None:
                loads.append(mtp_loads.reshape(-1))
            dropped = dropped + drop
            aux = aux + a
            x = (main + self.w * mtp) * self.scale
        stats = ops.stack((main, mtp, aux, dropped))
        for ld in loads:
            stats = ops.concat((stats, ld.reshape(-1).astype(ms.float32)))
        return x, aux * self.scale, ops.stop_gradient(stats.astype(ms.float32))


class _Forward(nn.Cell):
    def __init__(self, stage):
        super().__init__(auto_prefix=False)
        self.stage = stage

    @ms.jit
    def construct(self, x, pos, seg, tokens, labels, mask):
        return self.stage(x, pos, seg, tokens, labels, mask)[0]


class _Backward(nn.Cell):
    """Recomputed forward and backward of one micro-batch -> (stats, input gradient,
    ``acc`` + the weight gradients in fp32): a pure function, as ``_pp_graph``'s."""

    def __init__(self, stage, weights, first: bool):
        super().__init__(auto_prefix=False)
        self.stage, self.weights, self.first = stage, weights, first
        self.map = ops.HyperMap()

    @ms.jit
    def construct(self, x, pos, seg, tokens, labels, mask, dy, acc):
        out, vjp_fn = ms.vjp(self.stage, x, pos, seg, tokens, labels, mask, weights=self.weights)
        sens = (dy, ops.ones((), ms.float32), ops.zeros_like(out[2]))
        in_grads, wgrads = vjp_fn(sens)
        dx = ops.zeros((), ms.float32) if self.first else in_grads[0]
        return out[2], dx, self.map(add_f32, acc, wgrads)


class _EvalForward(nn.Cell):
    """The held-out forward of one stage: the hidden state, or on the last stage the main
    model's next-token CE of the micro-batch (``MoEEvalNet``'s: no MTP, no balance term)."""

    def __init__(self, model, first: bool, last: bool):
        super().__init__(auto_prefix=False)
        from mindloom_model import causal_lm_loss

        self.model, self.first, self.last, self.ce = model, first, last, causal_lm_loss

    @ms.jit
    def construct(self, x, pos, seg, labels, mask):
        m = self.model
        cos, sin, bias = m.attention_inputs(pos, seg)
        if self.first:
            x = m.embed(x)
        for layer in m.layers:
            x = layer(x, cos, sin, bias)[0]
        if self.last:
            return self.ce(m.head(m.norm(x)), labels, mask)
        return x


class MoEPipelineGraph:
    """One rank's stage of a DeepSeek-V3 under pp (x dp, ep inside dp; tp = 1): the model is
    cut and its experts split in place. ``step(batch)`` runs 1F1B over this data-parallel
    rank's ``micro_batch_size * micro_batch_num`` samples and returns the global loss and
    stats; ``grads`` are reduced (dense over dp, experts over edp, embed over first + last
    stage); the caller applies its optimizer and then ``update_bias()``."""

    def __init__(self, model, pcfg, groups, micro_batch_size: int):
        from mindloom_model import DeepseekV3WithLoss

        cfg = model.config
        if pcfg.tp != 1:
            raise ValueError(f"MoEPipelineGraph runs tp = 1 (got tp = {pcfg.tp})")
        self.cfg, self.pcfg, self.groups = cfg, pcfg, groups
        self.micro_batch_size = micro_batch_size
        # the stage exchanges and the gradient reduction are timed into comm_stats while a
        # step runs (forward_backward), as ParallelEngine's
        self.comm_stats = CommStats()
        self._recorder = CommRecorder()
        groups = self.groups = groups.with_recorder(self._recorder)
        first, last = groups.is_first_stage, groups.is_last_stage
        self.layer_ids = stage_layers(cfg.num_layers, pcfg.pp, groups.pp_rank)
        deepseek_stage(model, self.layer_ids, first, last)
        self.ep, self.edp = init_expert_groups(groups.rank, pcfg)
        expert_parallel(model, self.ep)
        self.model = model
        self.routers = [layer.mlp.gate for layer in model.layers if layer.is_moe]
        self.routers += [mod.block.mlp.gate for mod in model.mtp if mod.block.is_moe]
        want = stage_routers(cfg, pcfg.pp, groups.pp_rank)
        if len(self.routers) != want:  # the cut (trunk MoE layers, MTP on the last stage)
            raise ValueError(f"pipeline stage {groups.pp_rank} holds {len(self.routers)} "
                             f"routers, DeepSeek-V3's layout gives it {want}")  # fmt: skip
        self.biases = [r.expert_bias for r in self.routers]
        n_micro = pcfg.micro_batch_num * pcfg.dp  # micro-batches of the global batch
        self.stage = _MoEStage(DeepseekV3WithLoss(model), first, last, 1.0 / n_micro)
        self.params = list(model.trainable_params())
        self.param_names = [p.name for p in self.params]
        dense = [p for p in self.params if not is_expert_param(p.name)]
        self.reducer = EPGradReducer(self.param_names, 1, self.edp,
                                     GradReducer(dense, groups.dp, pcfg.bucket_size_mb))  # fmt: skip
        self._embed_idx = [i for i, n in enumerate(self.param_names)
                           if n == "embed.weight" and pcfg.pp > 1]  # fmt: skip
        self._fwd = _Forward(self.stage)
        self._bwd = _Backward(self.stage, ms.ParameterTuple(self.params), first)
        self._eval = _EvalForward(model, first, last)
        # the global norm: this stage's dense tensors (the embedding's copy on the last
        # stage not again), its expert blocks summed over ep, then the stages summed
        expert = [is_expert_param(n) for n in self.param_names]
        copy = {i for i in self._embed_idx if not first}
        self._dense_sq = _SquareSum(tuple(not e and i not in copy for i, e in enumerate(expert)))
        self._expert_sq = _SquareSum(tuple(expert))
        self.last_loads = self.last_local_loads = self.last_head = None

    def _micro(self, batch: dict, i: int) -> dict:
        b = self.micro_batch_size
        sl = slice(i * b, (i + 1) * b)
        tokens = batch["tokens"][sl]
        s = tokens.shape[1]
        pos = batch.get("position_ids")
        pos = np.broadcast_to(np.arange(s), tokens.shape) if pos is None else pos[sl]
        seg = batch.get("segment_ids")
        seg = np.zeros(tokens.shape, np.int32) if seg is None else seg[sl]
        mask = batch.get("loss_mask")
        mask = np.ones(tokens.shape, np.float32) if mask is None else mask[sl]

        def t(a, dt):
            return Tensor(np.ascontiguousarray(a, dtype=dt))

        return {"tokens": t(tokens, np.int32), "pos": t(pos, np.int32), "seg": t(seg, np.int32),
                "labels": t(batch["labels"][sl], np.int32), "mask": t(mask, np.float32)}  # fmt: skip

    def step(self, batch: dict):
        """-> (loss, stats [main, MTP, balance, dropped] summed over the global batch's
        micro-batches, this stage's loads [R_stage, E] of the global batch, grads)."""
        g, pcfg = self.groups, self.pcfg
        nmb = pcfg.micro_batch_num  # the stage's loss scale holds it
        if batch["tokens"].shape[0] != nmb * self.micro_batch_size:
            raise ValueError(f"rank {g.rank}: a step takes micro_batch_num * micro_batch_size "
                             f"= {nmb} * {self.micro_batch_size} samples per data-parallel "
                             f"rank, got {batch['tokens'].shape[0]}")  # fmt: skip
        micro = [self._micro(batch, i) for i in range(nmb)]
        shape = (self.micro_batch_size, micro[0]["tokens"].shape[1], self.cfg.hidden_size)
        q = StageQueues(g, shape, self.model.compute_dtype)
        first, last = g.is_first_stage, g.is_last_stage
        # the running gradient sum starts at zeros: one backward graph for every call
        acc = ms.mutable(tuple(ops.zeros(p.shape, ms.float32) for p in self.params))
        inputs, stats = {}, None
        one = ops.ones((), ms.float32)
        for act in one_f_one_b(g.pp_rank, pcfg.pp, nmb):
            if act[0] == "fwd":
                i = act[1]
                mb = micro[i]
                x = mb["tokens"] if first else q.pending_in.pop(0)
                inputs[i] = x
                if not last:  # the last stage's forward runs inside its backward
                    q.outputs.append(self._fwd(x, mb["pos"], mb["seg"], mb["tokens"],
                                               mb["labels"], mb["mask"]))  # fmt: skip
            elif act[0] == "bwd":
                i = act[1]
                mb = micro[i]
                dy = one if last else q.pending_grad.pop(0)
                acc = ms.mutable(tuple(acc))  # a plain tuple input is a graph constant
                st, dx, acc = self._bwd(inputs.pop(i), mb["pos"], mb["seg"], mb["tokens"],
                                        mb["labels"], mb["mask"], dy, acc)  # fmt: skip
                stats = st if stats is None else stats + st
                if not first:
                    q.input_grads.append(dx)
            else:
                q.communicate(act[0])
        grads = list(acc)
        for i in self._embed_idx:  # the MTP blocks' use of the embedding, on the last stage
            grads[i] = all_reduce(grads[i], g.embed)
        t0 = time.perf_counter()
        grads = self.reducer(tuple(grads))
        _ = grads[0].asnumpy() if grads else None  # the reduction's own time (it runs async)
        self.comm_stats.time_s += time.perf_counter() - t0
        self.comm_stats.calls += 1
        # this rank's own loads (the tokens it routes), then the global batch at this
        # stage's routers: summed over the stage's dp ranks
        self.last_local_loads = stats.asnumpy()[N_HEAD:].astype(np.float64)
        stats = all_reduce(stats, g.dp, timed=False).asnumpy().astype(np.float64)
        head = all_reduce(Tensor(stats[:N_HEAD].astype(np.float32)), g.pp, timed=False)
        head = head.asnumpy().astype(np.float64)
        self.last_loads = stats[N_HEAD:].reshape(len(self.routers), -1)
        self.last_head = head
        loss = (head[0] + self.stage.w * head[1] + head[2]) / (nmb * pcfg.dp)
        return float(loss), head, self.last_loads, grads

    # ------------------------------------------------------------------ the engine's API
    # (what a trainer calls on ParallelEngine / PipelineGraph: forward_backward, grad_norm,
    # eval_loss, comm_stats, params, param_names)

    def forward_backward(self, batch: dict, dropout_keys=None):
        """``step`` with its communication timed into ``comm_stats`` -> (loss, grads).
        ``dropout_keys`` is accepted for the engine's signature; DeepSeek-V3 draws
        MindSpore's stateful dropout masks (as its compiled one-process step)."""
        self.comm_stats.reset()
        with self._recorder.recording(self.comm_stats):
            loss, _, _, grads = self.step(batch)
        return loss, tuple(grads)

    def grad_norm(self, grads) -> float:
        """The global L2 norm of the whole model's gradient (the reduced ``grads``): this
        stage's dense tensors once (the embedding on its first stage), its expert blocks
        summed over the ep group, the stages summed over the pipeline."""
        grads = ms.mutable(tuple(grads))
        sq = self._dense_sq(grads) + all_reduce(self._expert_sq(grads), self.ep, timed=False)
        sq = all_reduce(sq, self.groups.pp, timed=False, host=True)
        return float(np.sqrt(np.float64(sq.asnumpy()[0])))

    def eval_loss(self, batch: dict) -> float:
        """The held-out loss of this data-parallel rank's slice (any multiple of
        ``micro_batch_size`` samples): the main CE averaged over its micro-batches, then
        over the dp ranks, the same value on every rank. Nothing is taped."""
        g, b = self.groups, self.micro_batch_size
        n = batch["tokens"].shape[0]
        if n % b:
            raise ValueError(f"rank {g.rank}: an eval batch of {n} samples is not a multiple "
                             f"of micro_batch_size = {b}")  # fmt: skip
        shape = (b, batch["tokens"].shape[1], self.cfg.hidden_size)
        dtype = self.model.compute_dtype
        total = 0.0
        for i in range(n // b):
            mb = self._micro(batch, i)
            x = mb["tokens"] if g.is_first_stage else exchange(None, shape, dtype, g.pp_prev)
            out = self._eval(x, mb["pos"], mb["seg"], mb["labels"], mb["mask"])
            if g.is_last_stage:
                total += float(out.asnumpy())
            else:
                exchange(out, None, dtype, g.pp_next)
        mine = np.array([total / (n // b) / g.dp.size], np.float32)
        loss = all_reduce(Tensor(mine), g.dp, timed=False, host=True)  # the dp mean
        loss = all_reduce(loss, g.pp, timed=False, host=True)  # from the last stage
        return float(loss.asnumpy()[0])

    def update_bias(self) -> None:
        """After the optimizer step: every router of this stage moves by the global loads."""
        if self.biases:
            moe_bias_step(self.biases, self.last_loads, self.cfg.moe_bias_update_speed)
