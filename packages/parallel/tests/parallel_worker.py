"""Run by the tests: 4 training steps of the `debug` Llama under several layouts.

    python parallel_worker.py --reference OUT          one process, plain model path
    msrun ... parallel_worker.py --layouts dp2,tp2 OUT  every layout in the same workers

Every layout starts from the same seeded weights and sees the same global batches (each
data-parallel rank takes its slice); the test compares losses and final weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

# 2 steps: the second step's loss and gradients are taken at the weights the first update
# wrote (so a layout's update path is on trial, not only its forward and backward), every
# weight has moved by > 1e-3 (SGD lr 0.5; AdamW ~lr per step), and each planted layout bug
# (tied-embedding gradient not summed, sequence-parallel norm gradient not reduced) moves
# the final weights far outside the 1e-4 tolerance (re-observed at 2 steps, docs/testing.md).
# The engine runs in PyNative: each step costs ~2 CPU-seconds per rank and layout, so the
# launches' cost is mostly steps (4 steps until session 8, 10 before that).
STEPS = 2
GBS = 8
SEQ = 32
SGD_LR = 0.5
ADAM_LR = 3e-3
ADAM_WD = 0.1

# name -> (ParallelConfig kwargs, optimizer, model overrides)
LAYOUTS = {
    "dp2": (dict(dp=2, micro_batch_num=2, zero_stage=1), "adamw", {}),
    "dp2_sgd": (dict(dp=2), "sgd", {}),
    "dp2_compiled": (dict(dp=2), "sgd", {}),
    "tp2": (dict(tp=2), "sgd", {}),
    "tp2_sp": (dict(tp=2, sequence_parallel=True), "sgd", {}),
    # the same layouts as one compiled (@jit) step: mindloom_parallel's graph region cells
    "tp2_compiled": (dict(tp=2), "sgd", {}),
    "tp2_sp_compiled": (dict(tp=2, sequence_parallel=True), "sgd", {}),
    "pp2": (dict(pp=2, micro_batch_num=4), "sgd", {}),
    "pp2_tied": (dict(pp=2, micro_batch_num=2), "sgd", {"tie_embeddings": True}),
    # the same pipelines with each stage's forward and backward compiled (PipelineGraph):
    # the 1F1B schedule and the stage-to-stage exchanges in Python between the graphs
    "pp2_compiled": (dict(pp=2, micro_batch_num=4), "sgd", {}),
    "pp2_tied_compiled": (dict(pp=2, micro_batch_num=2), "sgd", {"tie_embeddings": True}),
    # ZeRO-1 as one compiled step: GradReducer, owned-shard fused AdamW, owner share
    "dp2_zero1_compiled": (dict(dp=2, zero_stage=1), "adamw", {}),
    "dp2_tp2": (dict(dp=2, tp=2), "sgd", {}),
    # 4 workers: the TP region cells and the dp buckets in one compiled step
    "dp2_tp2_compiled": (dict(dp=2, tp=2), "sgd", {}),
    "dp2_tp2_sp_compiled": (dict(dp=2, tp=2, sequence_parallel=True), "sgd", {}),
    "dp2_pp2": (dict(dp=2, pp=2, micro_batch_num=2), "sgd", {}),
    "tp2_pp2_sp": (dict(tp=2, pp=2, micro_batch_num=2, sequence_parallel=True), "sgd", {}),
    # 4 workers: compiled stage graphs with the dp buckets / the TP region cells inside
    "dp2_pp2_compiled": (dict(dp=2, pp=2, micro_batch_num=2), "sgd", {}),
    "tp2_pp2_sp_compiled": (
        dict(tp=2, pp=2, micro_batch_num=2, sequence_parallel=True),
        "sgd",
        {},
    ),
}


def batches(vocab: int):
    """STEPS global batches: two packed documents per sample, some masked labels."""
    rng = np.random.default_rng(1234)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, vocab, (GBS, SEQ + 1), dtype=np.int64).astype(np.int32)
        cut = rng.integers(4, SEQ - 4, GBS)
        seg = (np.arange(SEQ)[None, :] >= cut[:, None]).astype(np.int32)
        pos = np.where(seg == 0, np.arange(SEQ)[None, :], np.arange(SEQ)[None, :] - cut[:, None])
        mask = (rng.random((GBS, SEQ)) > 0.15).astype(np.float32)
        out.append(
            {
                "tokens": tokens[:, :-1].copy(),
                "labels": tokens[:, 1:].copy(),
                "position_ids": pos.astype(np.int32),
                "segment_ids": seg,
                "loss_mask": mask,
            }
        )
    return out


class SGD:
    """Plain SGD, p -= lr * g on every rank: the layouts' check of the gradients themselves
    (test-side; the package's one optimizer is ZeroAdamW)."""

    def __init__(self, params, lr: float):
        self.params, self.lr = list(params), lr

    def step(self, grads) -> None:
        from mindspore import ops

        for p, g in zip(self.params, grads):
            ops.assign(p, p - self.lr * g.astype(p.dtype))


class AdamW:
    """torch.optim.AdamW's update (bias correction, decoupled decay on every parameter)
    through mindloom_parallel.ZeroAdamW, ZeRO-1 when ``zero_stage`` is 1."""

    def __init__(self, params, names, groups, zero_stage: int):
        from mindloom_parallel import ZeroAdamW

        self.opt = ZeroAdamW(params, names, groups, zero_stage)
        self.t = 0

    def step(self, grads) -> None:
        self.t += 1
        self.opt.step(grads, self.t, ADAM_LR, weight_decay=ADAM_WD)

    def gather_state(self) -> dict:
        """The full moments (collective over dp), keyed ``<name>.exp_avg`` /
        ``<name>.exp_avg_sq``."""
        out = {}
        for key, v in self.opt.gather_moments().items():
            kind, name = key.split(".", 1)
            out[f"{name}.{kind}"] = v
        return out


def optimizer(params, names, kind, groups, zero_stage):
    if kind == "sgd":
        return SGD(params, SGD_LR)
    return AdamW(params, names, groups, zero_stage)


def numpy_adamw(
    params: dict, grads_per_step, lr: float, wd: float, betas=(0.9, 0.95), eps: float = 1e-8
) -> dict:
    """torch.optim.AdamW's update written out in float64 NumPy (bias correction, decoupled
    decay on every parameter, as the AdamW above): the independent reference.
    -> {name: weight, "exp_avg.name": m, "exp_avg_sq.name": v} after the last step."""
    b1, b2 = betas
    w = {n: np.asarray(v, np.float64).copy() for n, v in params.items()}
    m = {n: np.zeros_like(v) for n, v in w.items()}
    v2 = {n: np.zeros_like(v) for n, v in w.items()}
    for t, grads in enumerate(grads_per_step, 1):
        for n in w:
            g = np.asarray(grads[n], np.float64)
            m[n] = b1 * m[n] + (1 - b1) * g
            v2[n] = b2 * v2[n] + (1 - b2) * g * g
            w[n] = w[n] * (1 - lr * wd)
            w[n] = w[n] - lr * (m[n] / (1 - b1**t)) / (np.sqrt(v2[n] / (1 - b2**t)) + eps)
    out = dict(w)
    out.update({f"exp_avg.{n}": x for n, x in m.items()})
    out.update({f"exp_avg_sq.{n}": x for n, x in v2.items()})
    return out


def reference(out: Path, kind: str, overrides: dict) -> dict:
    """The one-process run: the model's own loss cell and MindSpore autodiff, no engine.
    For AdamW, the same gradients also go through `numpy_adamw` (reference_adamw_numpy.npz):
    ZeroAdamW (and so ZeRO-1) is checked against an optimizer that is not itself."""
    import mindspore as ms
    from mindloom_model import Llama, LlamaWithLoss, get_preset
    from mindloom_parallel import ParallelConfig, init_parallel

    cfg = get_preset("debug", **overrides)
    model = Llama(cfg)
    net = LlamaWithLoss(model)
    params = model.trainable_params()
    names = [n for n, _ in model.parameters_and_names()]
    grad_fn = ms.value_and_grad(net, None, params)
    opt = optimizer(params, names, kind, init_parallel(ParallelConfig()), 0)
    init = {n: p.asnumpy().copy() for n, p in zip(names, params)}  # asnumpy may share memory
    losses, all_grads = [], []
    for b in batches(cfg.vocab_size):
        t = {k: ms.Tensor(v) for k, v in b.items()}
        loss, grads = grad_fn(
            t["tokens"], t["labels"], t["position_ids"], t["segment_ids"], t["loss_mask"]
        )
        losses.append(float(loss.asnumpy()))
        all_grads.append({n: g.asnumpy() for n, g in zip(names, grads)})
        opt.step(grads)
    if kind == "adamw":
        np.savez(out / "reference_adamw_numpy.npz",
                 **numpy_adamw(init, all_grads, ADAM_LR, ADAM_WD))  # fmt: skip
    np.savez(
        out / f"reference_{kind}{_tag(overrides)}.npz",
        **{n: p.asnumpy() for n, p in zip(names, params)},
    )
    return {"losses": losses}


def _tag(overrides: dict) -> str:
    return "_tied" if overrides.get("tie_embeddings") else ""


def Llama_state(cfg) -> dict:
    """The seed-0 initial weights every run starts from (name -> numpy)."""
    from mindloom_model import Llama

    return {n: p.asnumpy() for n, p in Llama(cfg).parameters_and_names()}


def _masked_loss_cell(model):
    """A Cell class: the model's masked token NLL summed over the batch / `denom`, written
    here from MindSpore ops (no mindloom_parallel code), for the hand-built compiled steps."""
    from mindspore import nn, ops

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.model = model

        def construct(self, tokens, labels, pos, seg, mask, denom):
            logits = self.model(tokens, pos, seg)
            logp = ops.log_softmax(logits.reshape(-1, logits.shape[-1]), -1)
            nll = -ops.gather_elements(logp, 1, labels.reshape(-1, 1)).reshape(-1)
            return (nll * mask.reshape(-1)).sum() / denom

    return Loss


def run_compiled_dp(name: str, out: Path, steps: int = STEPS) -> dict:
    """dp2 with the forward, backward and bucketed GradReducer in ONE compiled graph."""
    import mindspore as ms
    from mindloom_model import Llama, get_preset
    from mindloom_parallel import GradReducer, ParallelConfig, dp_slice, init_parallel
    from mindspore import Tensor, nn, ops

    cfg = get_preset("debug")
    pcfg = ParallelConfig(dp=2)
    groups = init_parallel(pcfg, cfg)
    model = Llama(cfg)
    params = model.trainable_params()
    names = [n for n, _ in model.parameters_and_names()]

    Loss = _masked_loss_cell(model)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.loss = Loss()
            self.weights = ms.ParameterTuple(params)
            self.grad = ops.GradOperation(get_by_list=True)
            self.reducer = GradReducer(params, groups.dp, bucket_size_mb=0.1)

        @ms.jit
        def construct(self, tokens, labels, pos, seg, mask, denom):
            loss = self.loss(tokens, labels, pos, seg, mask, denom)
            grads = self.grad(self.loss, self.weights)(tokens, labels, pos, seg, mask, denom)
            return loss, self.reducer(grads)

    step = Step()
    assert len(step.reducer.buckets) > 1
    opt = optimizer(params, names, "sgd", groups, 0)
    losses = []
    for b in batches(cfg.vocab_size)[:steps]:
        denom = Tensor(np.float32(b["loss_mask"].sum()))
        loc = {k: Tensor(v) for k, v in dp_slice(b, groups.dp_rank, 2).items()}
        loss, grads = step(
            loc["tokens"],
            loc["labels"],
            loc["position_ids"],
            loc["segment_ids"],
            loc["loss_mask"],
            denom,
        )
        from mindloom_parallel._comm import all_reduce

        losses.append(float(all_reduce(loss.reshape((1,)), groups.dp).asnumpy()[0]))
        opt.step(grads)
    np.savez(
        out / f"{name}_rank{groups.rank}.npz", **{n: p.asnumpy() for n, p in zip(names, params)}
    )
    # no comm_share: the all-reduce runs inside the compiled graph, where it is not timed
    return {"losses": losses, "grad_norms": [], "comm_share": None, "rank": groups.rank}


MLP_SHAPES = {"x": (2, 4, 8), "w1": (12, 8), "w2": (8, 12)}  # column w1, row w2


def mlp_arrays():
    """Input, target and the full weights of the column+row parallel MLP check."""
    rng = np.random.default_rng(5)
    a = {k: rng.standard_normal(s).astype(np.float32) for k, s in MLP_SHAPES.items()}
    a["t"] = rng.standard_normal(MLP_SHAPES["x"]).astype(np.float32)
    return a


def run_mlp_compiled(name: str, out: Path, steps: int = STEPS) -> dict:
    """The smallest compiled TP check: y = (silu(f(x) W1_r^T)) W2_r^T summed by g, loss
    mean((y - t)^2), in one @jit graph on each of two ranks; the loss, the input's
    gradient (the all-reduce in f's bprop) and each rank's weight-shard gradients are
    saved for the test to compare with NumPy."""
    import mindspore as ms
    from mindloom_parallel import ParallelConfig, init_parallel
    from mindloom_parallel._tp_graph import CopyToTPGraph, ReduceFromTPGraph
    from mindspore import Parameter, Tensor, nn, ops

    groups = init_parallel(ParallelConfig(tp=2))
    r, n = groups.tp.index, groups.tp.size
    a = mlp_arrays()
    k1, k2 = MLP_SHAPES["w1"][0] // n, MLP_SHAPES["w2"][1] // n
    w1 = Parameter(Tensor(a["w1"][r * k1 : (r + 1) * k1]), name="w1")
    w2 = Parameter(Tensor(a["w2"][:, r * k2 : (r + 1) * k2]), name="w2")

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = w1, w2
            self.enter = CopyToTPGraph(groups.tp)
            self.exit = ReduceFromTPGraph(groups.tp)

        def construct(self, x, t):
            h = ops.silu(ops.matmul(self.enter(x), self.w1.T))
            y = self.exit(ops.matmul(h, self.w2.T))
            return ((y - t) ** 2).mean()

    class Step(nn.Cell):
        def __init__(self):
            super().__init__()
            self.net = MLP()
            self.grad = ops.GradOperation(get_all=True, get_by_list=True)
            self.weights = ms.ParameterTuple([w1, w2])

        @ms.jit
        def construct(self, x, t):
            return self.net(x, t), self.grad(self.net, self.weights)(x, t)

    loss, ((dx, _), (g1, g2)) = Step()(Tensor(a["x"]), Tensor(a["t"]))
    np.savez(out / f"{name}_rank{groups.rank}.npz", loss=loss.asnumpy(), dx=dx.asnumpy(),
             w1=g1.asnumpy(), w2=g2.asnumpy())  # fmt: skip
    return {"losses": [float(loss.asnumpy())], "rank": groups.rank}


def run_compiled_tp(name: str, out: Path, steps: int = STEPS) -> dict:
    """tp2 (and tp2+sp) as ONE compiled graph per step: forward, backward with every
    region's collective, the sequence-parallel norm gradients' all-reduce and the global
    gradient norm (mindloom_parallel._tp_graph), on the engine's split of the same model."""
    import mindspore as ms
    from mindloom_model import Llama, get_preset
    from mindloom_parallel import (
        GradReducer,
        ParallelConfig,
        dp_slice,
        init_parallel,
        shard_tensor,
        tensor_layout,
    )
    from mindloom_parallel._tp_graph import (
        TPGradReducer,
        TPLlamaWithLoss,
        TPNormSquare,
        parallelize_llama_graph,
    )
    from mindspore import Tensor, nn, ops

    class MeanOver(nn.Cell):
        def __init__(self, group_name, size):
            super().__init__()
            self.op = ops.AllReduce(ops.ReduceOp.SUM, group=group_name)
            self.inv = 1.0 / size

        def construct(self, x):
            return self.op(x) * self.inv

    kw, kind, overrides = LAYOUTS[name]
    cfg = get_preset("debug", **overrides)
    pcfg = ParallelConfig(**kw)
    groups = init_parallel(pcfg, cfg)
    # tp2+sp runs the CPU emulation of the all-gather (zero-padded all-reduce) that a TP
    # group smaller than the world needs; tp2 the native AllGather of the world group
    native = not pcfg.sequence_parallel
    model = parallelize_llama_graph(Llama(cfg, seed=99), pcfg, groups, world_allgather=native)
    tp_net = TPLlamaWithLoss(model, groups.tp, world_allgather=native)

    class Weighted(nn.Cell):
        """dp > 1: this rank's token-mean loss times its share of the global batch's
        tokens, so the dp sum of losses and gradients is the one-process token mean."""

        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = tp_net

        def construct(self, tokens, labels, pos, seg, mask, share):
            return self.net(tokens, labels, pos, seg, mask) * share

    net = Weighted()
    params = model.trainable_params()
    names = [p.name for p in params]
    layout = tensor_layout(cfg, pcfg)
    full = Llama_state(cfg)
    for n, p in zip(names, params):  # the checkpoint path: full tensors, this rank's shard
        ops.assign(p, Tensor(shard_tensor(full[n], layout[n], groups.tp.index, groups.tp.size)))

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net
            self.weights = ms.ParameterTuple(params)
            self.grad = ops.GradOperation(get_by_list=True)
            dp_red = GradReducer(params, groups.dp, 0.1) if pcfg.dp > 1 else None
            self.reduce = TPGradReducer(params, names, groups, pcfg.sequence_parallel, dp_red)
            self.norm_sq = TPNormSquare(names, groups)
            self.loss_sum = MeanOver(groups.dp.name, 1) if pcfg.dp > 1 else None

        @ms.jit
        def construct(self, tokens, labels, pos, seg, mask, share):
            loss = self.net(tokens, labels, pos, seg, mask, share)
            grads = self.grad(self.net, self.weights)(tokens, labels, pos, seg, mask, share)
            grads = self.reduce(grads)
            if self.loss_sum is not None:
                loss = self.loss_sum(loss)
            sq = ()
            for g in grads:
                sq = sq + ((g * g).sum(),)
            return loss, ops.sqrt(self.norm_sq(sq)), grads

    step = Step()
    opt = optimizer(params, names, kind, groups, 0)
    losses, norms = [], []
    t0 = time.perf_counter()
    for b in batches(cfg.vocab_size)[:steps]:
        local = dp_slice(b, groups.dp_rank, pcfg.dp)
        share = Tensor(np.float32(local["loss_mask"].sum() / b["loss_mask"].sum()))
        t = {k: Tensor(v) for k, v in local.items()}
        loss, norm, grads = step(t["tokens"], t["labels"], t["position_ids"],
                                 t["segment_ids"], t["loss_mask"], share)  # fmt: skip
        opt.step(grads)
        losses.append(float(loss.asnumpy()))
        norms.append(float(norm.asnumpy()))
    np.savez(
        out / f"{name}_rank{groups.rank}.npz", **{n: p.asnumpy() for n, p in zip(names, params)}
    )
    # no comm_share: the collectives run inside the compiled graph, where they are not timed
    return {"losses": losses, "grad_norms": norms, "comm_share": None, "rank": groups.rank,
            "seconds": time.perf_counter() - t0}  # fmt: skip


def run_compiled_zero(name: str, out: Path, steps: int = STEPS) -> dict:
    """dp2 + ZeRO-1 as ONE compiled graph per step: forward, backward, the bucketed
    GradReducer, the fused AdamW on this rank's owned parameters (ZeroShardUpdate.update)
    and the owners' values shared with the other replica (ZeroShardUpdate.share)."""
    import mindspore as ms
    from mindloom_model import Llama, get_preset
    from mindloom_parallel import (
        GradReducer,
        ParallelConfig,
        ZeroAdamW,
        ZeroShardUpdate,
        adamw_scalars,
        dp_slice,
        init_parallel,
    )
    from mindspore import Tensor, nn, ops

    kw, kind, overrides = LAYOUTS[name]
    cfg = get_preset("debug", **overrides)
    pcfg = ParallelConfig(**kw)
    groups = init_parallel(pcfg, cfg)
    model = Llama(cfg, seed=99)
    params = model.trainable_params()
    names = [n for n, _ in model.parameters_and_names()]
    full = Llama_state(cfg)
    for n, p in zip(names, params):  # the checkpoint path: full tensors loaded in place
        ops.assign(p, Tensor(full[n]))

    Loss = _masked_loss_cell(model)

    zero = ZeroShardUpdate(params, groups.dp, [1.0] * len(params), bucket_size_mb=0.1)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.loss = Loss()
            self.weights = ms.ParameterTuple(params)
            self.grad = ops.GradOperation(get_by_list=True)
            self.reducer = GradReducer(params, groups.dp, bucket_size_mb=0.1)
            self.zero = zero
            self.sum = ops.AllReduce(ops.ReduceOp.SUM, group=groups.dp.name)

        @ms.jit
        def construct(self, tokens, labels, pos, seg, mask, denom, h):
            loss = self.loss(tokens, labels, pos, seg, mask, denom)
            grads = self.grad(self.loss, self.weights)(tokens, labels, pos, seg, mask, denom)
            grads = self.reducer(grads)
            # after the buckets: each rank's graph differs, the collectives' order must not
            loss = self.sum(ops.depend(loss.reshape((1,)), grads))
            loss = self.zero.update(grads, h[0], h[1], h[2], h[3], h[4], h[5], loss)
            return self.zero.share(loss)

    step = Step()
    assert len(zero.bounds) > 1  # several share buckets
    losses = []
    t0 = time.perf_counter()
    for t, b in enumerate(batches(cfg.vocab_size)[:steps], 1):
        denom = Tensor(np.float32(b["loss_mask"].sum()))
        loc = {k: Tensor(v) for k, v in dp_slice(b, groups.dp_rank, 2).items()}
        lr, eps, wd = adamw_scalars(t, ADAM_LR, 0.9, 0.95, 1e-8, ADAM_WD)
        h = Tensor(np.array([1.0, lr, 0.9, 0.95, eps, wd], np.float32))
        loss = step(loc["tokens"], loc["labels"], loc["position_ids"], loc["segment_ids"],
                    loc["loss_mask"], denom, h)  # fmt: skip
        losses.append(float(loss.asnumpy()[0]))
    seconds = time.perf_counter() - t0
    np.savez(
        out / f"{name}_rank{groups.rank}.npz", **{n: p.asnumpy() for n, p in zip(names, params)}
    )
    # the full moments: a ZeroAdamW over the cell's own moment tensors gathers them (the
    # trainer's checkpoint path, _zero_step)
    io = ZeroAdamW(params, names, groups, 1)
    io.exp_avg = dict(zip(zero.owned, zero.exp_avg))
    io.exp_avg_sq = dict(zip(zero.owned, zero.exp_avg_sq))
    state = {f"{k.split('.', 1)[1]}.{k.split('.', 1)[0]}": v
             for k, v in io.gather_moments().items()}  # fmt: skip
    np.savez(out / f"{name}_optim_rank{groups.rank}.npz", **state)
    return {"losses": losses, "grad_norms": [], "comm_share": None, "rank": groups.rank,
            "seconds": seconds, "state_values": zero.state_values,
            "moment_tensors": len(zero.exp_avg), "values": sum(zero.sizes)}  # fmt: skip


def run_ep_zero(name: str, out: Path, steps: int = STEPS) -> dict:
    """dp4 x ep2 + ZeRO-1 (DeepSeek-V3, `ep_worker`'s own step count and reference): in
    this launch so that the expert-data-parallel group of 2 runs in the default suite
    without a launch of its own."""
    import ep_worker

    return ep_worker.run_dp_zero(name, out)


RUNNERS = {"dp2_compiled": run_compiled_dp, "dp2_zero1_compiled": run_compiled_zero,
           "dp4_ep2_zero1": run_ep_zero,
           "dp2_tp2_compiled": run_compiled_tp, "dp2_tp2_sp_compiled": run_compiled_tp, "tp2_mlp_compiled": run_mlp_compiled,
           "tp2_compiled": run_compiled_tp, "tp2_sp_compiled": run_compiled_tp}  # fmt: skip


def run_layout(name: str, out: Path, steps: int = STEPS) -> dict:
    from mindloom_model import Llama, get_preset
    from mindloom_parallel import (
        ParallelConfig,
        ParallelEngine,
        PipelineGraph,
        _hostlink,
        dp_slice,
        init_parallel,
    )

    kw, kind, overrides = LAYOUTS[name]
    cfg = get_preset("debug", **overrides)
    pcfg = ParallelConfig(**kw)
    groups = init_parallel(pcfg, cfg)
    mbs = GBS // (pcfg.dp * pcfg.micro_batch_num)
    # built from another seed, then loaded from the full seed-0 weights: the path a
    # checkpoint from any layout takes into this one
    cls = PipelineGraph if name.endswith("_compiled") else ParallelEngine
    # the engine's layouts exchange and sum through MindSpore's AllReduce, the compiled
    # stages over the host link (_hostlink): each transport is checked against one process
    _hostlink.set_host_links(cls is PipelineGraph)
    engine = cls(Llama(cfg, seed=99), pcfg, groups, micro_batch_size=mbs)
    engine.load_state(Llama_state(cfg))
    t0 = time.perf_counter()
    opt = optimizer(engine.params, engine.param_names, kind, groups, pcfg.zero_stage)
    losses, norms, shares = [], [], []
    for b in batches(cfg.vocab_size)[:steps]:
        loss, grads = engine.forward_backward(dp_slice(b, groups.dp_rank, pcfg.dp))
        norms.append(engine.grad_norm(grads))
        opt.step(grads)
        losses.append(loss)
        shares.append(engine.metrics["comm_share"])
    np.savez(out / f"{name}_rank{groups.rank}.npz", **engine.local_state())
    if kind == "adamw":  # the full moments, gathered from the ZeRO-1 shards (collective)
        state = opt.gather_state()
        np.savez(out / f"{name}_optim_rank{groups.rank}.npz", **state)
    return {
        "losses": losses,
        "grad_norms": norms,
        "comm_share": shares,
        "rank": groups.rank,
        "seconds": time.perf_counter() - t0,
    }


def _late_all_reduce(late_rank: int, late_s: float, out: Path) -> int:
    """Every rank sums its rank + 1 once all ranks are in, then again with `late_rank`
    `late_s` seconds behind the others (a peer compiling or saving); the sums go to
    out/late_rank<r>.json, written only if both all-reduces succeeded."""
    import mindspore as ms
    from mindloom_parallel import mark_run_ended
    from mindspore import Tensor, nn, ops
    from mindspore.communication import GlobalComm, get_rank, init

    # graph mode: a rank waiting in a compiled all-reduce sleeps, while a PyNative one spins
    # a whole core for the 40 s (measured: 3.02 CPU-s in a 3 s wait), which the other test
    # files running beside this one need
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    init()
    rank = get_rank()

    class Reduce(nn.Cell):
        def __init__(self):
            super().__init__()
            self.op = ops.AllReduce(group=GlobalComm.WORLD_COMM_GROUP)

        def construct(self, x):
            return self.op(x)

    reduce = Reduce()
    mine = Tensor(np.full(4, rank + 1, np.float32))
    sums = [float(reduce(mine).asnumpy()[0])]
    t0 = time.monotonic()
    if rank == late_rank:
        time.sleep(late_s)
    sums.append(float(reduce(mine).asnumpy()[0]))
    waited = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    retry = [os.environ.get(n) for n in ("MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER")]
    (out / f"late_rank{rank}.json").write_text(
        json.dumps({"sums": sums, "waited_s": waited, "retry_interval": retry})
    )
    mark_run_ended(0)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layouts", default="")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--tied", action="store_true", help="also the tied-embedding reference")
    ap.add_argument("--fail-rank", type=int, default=-1, help="this rank raises (launcher test)")
    ap.add_argument("--crash-after-end", type=int, default=-1,
                    help="this rank marks its run ended, then dies by SIGSEGV (launcher test)")  # fmt: skip
    ap.add_argument(
        "--late-rank",
        type=int,
        default=-1,
        help="this rank joins an all-reduce --late-s seconds after its peers",
    )
    ap.add_argument("--late-s", type=float, default=0.0)  # fmt: skip
    a = ap.parse_args(argv)
    rank = int(os.environ.get("RANK_ID", "0"))
    if a.late_rank >= 0:
        return _late_all_reduce(a.late_rank, a.late_s, Path(a.out))
    if rank == a.fail_rank:
        raise RuntimeError(f"injected failure on rank {rank}")
    if a.crash_after_end >= 0:
        import signal

        from mindloom_parallel import guard_worker, mark_run_ended

        guard_worker()  # its pid line names the rank in the launcher's warning
        mark_run_ended(0)
        if rank == a.crash_after_end:
            os.kill(os.getpid(), signal.SIGSEGV)  # as MindSpore 2.10's teardown does, rarely
        return 0
    if not a.layouts and not a.reference:
        return 0
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    ms.set_seed(0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.reference:
        res = {}
        kinds = [("sgd", {}), ("adamw", {})] + (
            [("sgd", {"tie_embeddings": True})] if a.tied else []
        )
        for kind, ov in kinds:
            res[f"{kind}{_tag(ov)}"] = reference(out, kind, ov)
        (out / "reference.json").write_text(json.dumps(res))
        return 0
    res = {
        name: RUNNERS.get(name, run_layout)(name, out, a.steps)
        for name in a.layouts.split(",")
        if name
    }
    rank = next(iter(res.values()))["rank"] if res else rank
    tmp = out / f"result_rank{rank}.json.tmp"
    tmp.write_text(json.dumps(res))
    os.replace(tmp, out / f"result_rank{rank}.json")
    from mindloom_parallel import mark_run_ended

    mark_run_ended(0)  # durable results: a crash in MindSpore's teardown is not a failure
    return 0


if __name__ == "__main__":
    sys.exit(main())
