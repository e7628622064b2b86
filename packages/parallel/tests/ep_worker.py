"""Run by test_parallel_ep_four.py (and, for dp4_ep2_zero1 inside parallel_worker.py's
launch, test_parallel_msrun_four.py): 20 AdamW steps (MINDLOOM_EP_STEPS) of a 2-layer
DeepSeek-V3 (both layers MoE, one MTP block: 3 routers), one process or several 4-worker
expert-parallel layouts.

    python ep_worker.py OUT --reference                 one process, the model's own loss cell
    msrun ... ep_worker.py OUT --layouts pp2_ep2,...    every layout in the same workers

Every run starts from the same seeded weights and sees the same global batches, split into
the same four micro-batches of 2 samples: micro-batch j is samples [2j, 2j + 2), which is
pp2_ep2's data-parallel rank j // 2, micro-batch j % 2 and dp4_ep2_zero1's rank j. The
loss is the mean over the four micro-batches of the loss cell's loss (main + MTP weight x
MTP + balance), the update the fused AdamW kernel with constant scalars, then every
router's bias moves by the sign rule on the loads of the whole global batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

# 20 steps (issue 17's count); MINDLOOM_EP_STEPS shortens a run (the plants were tried so)
STEPS = int(os.environ.get("MINDLOOM_EP_STEPS", "20"))
GBS, SEQ, MBS = 8, 32, 2
N_MICRO = GBS // MBS
LR, B1, B2, EPS, WD = 3e-3, 0.9, 0.95, 1e-8, 0.1
SPEED, AUX = 0.01, 0.01

# name -> ParallelDims kwargs (4 workers)
LAYOUTS = {
    # pipeline stages with ep inside dp: stage 0 = layer 0 (1 router) on ranks 0, 1;
    # stage 1 = layer 1 + MTP (2 routers) on ranks 2, 3; each stage's ep group splits 8 experts
    "pp2_ep2": dict(dp=2, pp=2, ep=2, micro_batch_num=2),
    # ZeRO-1 with dp > ep: ep groups {0, 1}, {2, 3}; expert-data-parallel {0, 2}, {1, 3}
    "dp4_ep2_zero1": dict(dp=4, ep=2, zero_stage=1),
    # tensor parallel with ep inside dp: tp groups {0, 1}, {2, 3}; ep groups {0, 2}, {1, 3}
    # (the ranks with the same tp index); each rank runs two micro-batches per step
    "tp2_ep2": dict(dp=2, tp=2, ep=2),
}


def model_config():
    from mindloom_model import get_preset

    return get_preset("deepseek-v3-debug", num_layers=2, first_k_dense_replace=0,
                      max_seq_len=SEQ, moe_bias_update_speed=SPEED,
                      moe_aux_loss_weight=AUX)  # fmt: skip


def batches(vocab: int) -> list[dict]:
    """STEPS global batches: two packed documents per sample, some masked labels."""
    rng = np.random.default_rng(4321)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, vocab, (GBS, SEQ + 1)).astype(np.int32)
        cut = rng.integers(4, SEQ - 4, GBS)
        seg = (np.arange(SEQ)[None, :] >= cut[:, None]).astype(np.int32)
        pos = np.where(seg == 0, np.arange(SEQ)[None, :], np.arange(SEQ)[None, :] - cut[:, None])
        mask = (rng.random((GBS, SEQ)) > 0.15).astype(np.float32)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "position_ids": pos.astype(np.int32), "segment_ids": seg,
                    "loss_mask": mask})  # fmt: skip
    return out


def _cells():
    """The cells every run shares: the loss with its stats, the fused AdamW, and one
    micro-batch's forward and backward."""
    import mindspore as ms
    from mindspore import nn, ops

    class LossStats(nn.Cell):
        """The model's own loss cell / N_MICRO, and [main, MTP, balance, dropped, loads]."""

        def __init__(self, net):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, tokens, labels, pos, seg, mask):
            loss, main, mtp, aux, loads, dropped = self.net(tokens, labels, pos, seg, mask)
            head = ops.stack((main, mtp, aux, dropped))
            stats = ops.concat((head, loads.reshape(-1))).astype(ms.float32)
            return loss / N_MICRO, ops.stop_gradient(stats)

    class AdamW(nn.Cell):
        """The fused kernel on every given parameter (decay on matrices only)."""

        def __init__(self, params):
            super().__init__(auto_prefix=False)
            self.params = ms.ParameterTuple(params)
            self.m = self.params.clone("m", "zeros")
            self.v = self.params.clone("v", "zeros")
            self.flags = tuple(float(len(p.shape) >= 2) for p in params)
            self.kernel = ops.AdamWeightDecay()
            self.h = ms.Tensor(np.array([LR, B1, B2, EPS, WD], np.float32))

        @ms.jit
        def construct(self, grads):
            h = self.h
            done = h[0]
            for i in range(len(self.params)):
                r = self.kernel(self.params[i], self.m[i], self.v[i], h[0], h[1], h[2], h[3],
                                h[4] * self.flags[i], grads[i].astype(ms.float32))  # fmt: skip
                done = ops.depend(done, r)
            return done

    class ForwardBackward(nn.Cell):
        """(LossStats' loss and stats, the gradients of `params`) of one micro-batch."""

        def __init__(self, model, params):
            super().__init__(auto_prefix=False)
            from mindloom_model import DeepseekV3WithLoss

            self.net = LossStats(DeepseekV3WithLoss(model))
            self.weights = ms.ParameterTuple(params)

        @ms.jit
        def construct(self, tokens, labels, pos, seg, mask):
            fn = ms.value_and_grad(self.net, None, self.weights, has_aux=True)
            return fn(tokens, labels, pos, seg, mask)

    return LossStats, AdamW, ForwardBackward


class _Clock:
    """rec["seconds"]: [the first step (its graphs compile), every later step]."""

    def __init__(self, rec: dict):
        self.rec, self.t = rec, None
        rec["seconds"] = []

    def tick(self) -> None:
        import time

        now = time.perf_counter()
        if self.t is not None:
            self.rec["seconds"].append(now - self.t)
        self.t = now


def _tensors(mb: dict):
    from mindspore import Tensor

    keys = ("tokens", "labels", "position_ids", "segment_ids", "loss_mask")
    return [Tensor(np.ascontiguousarray(mb[k])) for k in keys]


def _state(model) -> dict:
    return {n: p.asnumpy() for n, p in model.parameters_and_names()}


def reference(out: Path) -> None:
    """One process: the four micro-batches' gradients summed on the host, AdamW, the bias
    rule from the summed loads (no mindloom_parallel code on the model path)."""
    import mindspore as ms
    from mindloom_model import DeepseekV3, moe_routers
    from mindspore import ops

    cfg = model_config()
    model = DeepseekV3(cfg)
    np.savez(out / "reference_init.npz", **_state(model))
    _, AdamW, ForwardBackward = _cells()
    params = model.trainable_params()
    fb = ForwardBackward(model, params)
    opt = AdamW(params)
    biases = [r.expert_bias for r in moe_routers(model)]
    rec = {"loss": [], "stats": [], "loads": [], "biases": [], "grad_norm": []}
    for b in batches(cfg.vocab_size):
        loss, stats, acc = 0.0, None, None
        for j in range(N_MICRO):
            mb = {k: v[j * MBS : (j + 1) * MBS] for k, v in b.items()}
            (lo, st), grads = fb(*_tensors(mb))
            loss += float(lo.asnumpy())
            stats = st if stats is None else stats + st
            acc = list(grads) if acc is None else [a + g for a, g in zip(acc, grads)]
        opt(ms.mutable(tuple(acc)))  # a plain tuple input is a graph constant: recompiles
        rec["grad_norm"].append(float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum()
                                                  for g in acc))))  # fmt: skip
        st = stats.asnumpy().astype(np.float64)
        loads = st[4:].reshape(len(biases), -1)
        for bias, load in zip(biases, loads):  # the rule written out, not the library's
            step = np.sign(load.mean() - load).astype(np.float32) * np.float32(SPEED)
            ops.assign(bias, ms.Tensor(bias.asnumpy() + step))
        rec["loss"].append(loss)
        rec["stats"].append(st[:4].tolist())
        rec["loads"].append(loads.tolist())
        rec["biases"].append([bias.asnumpy().tolist() for bias in biases])
    rec["eval"] = _eval_reference(model, batches(cfg.vocab_size)[0])
    np.savez(out / "reference.npz", **_state(model))
    np.savez(out / "reference_moments.npz", **{p.name: p.asnumpy() for p in (*opt.m, *opt.v)})
    (out / "reference.json").write_text(json.dumps(rec))


def _eval_reference(model, batch: dict) -> float:
    """The held-out loss of the final weights: the main model's CE (no MTP, no balance
    term) of each micro-batch of ``batch``, averaged."""
    from mindloom_model import causal_lm_loss

    model.set_train(False)
    losses = []
    for j in range(N_MICRO):
        tokens, labels, pos, seg, mask = _tensors({k: v[j * MBS : (j + 1) * MBS]
                                                   for k, v in batch.items()})  # fmt: skip
        losses.append(float(causal_lm_loss(model(tokens, pos, seg), labels, mask).asnumpy()))
    model.set_train(True)
    return float(np.mean(losses))


def run_pp(name: str, out: Path) -> dict:
    import mindspore as ms
    from mindloom_model import DeepseekV3
    from mindloom_parallel import MoEPipelineGraph, ParallelDims, dp_slice, init_parallel

    cfg = model_config()
    pcfg = ParallelDims(**LAYOUTS[name])
    groups = init_parallel(pcfg, cfg)
    model = DeepseekV3(cfg)
    eng = MoEPipelineGraph(model, pcfg, groups, MBS)
    _, AdamW, _ = _cells()
    opt = AdamW(eng.params)
    rec = {"loss": [], "stats": [], "loads": [], "grad_norm": [], "rank": groups.rank,
           "stage": groups.pp_rank, "ep_index": eng.ep.index, "tp_index": 0}  # fmt: skip
    clock = _Clock(rec)
    for b in batches(cfg.vocab_size):
        clock.tick()
        loss, head, loads, grads = eng.step(dp_slice(b, groups.dp_rank, pcfg.dp))
        rec["grad_norm"].append(eng.grad_norm(grads))
        opt(ms.mutable(tuple(grads)))  # a plain tuple input is a graph constant: recompiles
        eng.update_bias()
        rec["loss"].append(loss)
        rec["stats"].append(head.tolist())
        rec["loads"].append(loads.tolist())
    clock.tick()
    model.set_train(False)
    rec["eval"] = eng.eval_loss(dp_slice(batches(cfg.vocab_size)[0], groups.dp_rank, pcfg.dp))
    model.set_train(True)
    np.savez(out / f"{name}_rank{groups.rank}.npz", **_state(model))
    return rec


def _record(rec: dict, biases, loss, stats) -> None:
    """One step of a one-compiled-step layout: the biases moved by the sign rule on the
    global loads (stats [main, MTP, balance, dropped, loads...]), the loss, parts and loads
    recorded."""
    from mindloom_parallel import moe_bias_step

    st = stats.asnumpy().astype(np.float64)
    moe_bias_step(biases, st[4:], SPEED)
    rec["loss"].append(float(loss.asnumpy()))
    rec["stats"].append(st[:4].tolist())
    rec["loads"].append(st[4:].reshape(len(biases), -1).tolist())


def run_dp_zero(name: str, out: Path) -> dict:
    """dp4 + ep2 + ZeRO-1 as one compiled step: the exchange in the MoE layers, dense
    gradients over dp, expert blocks over the expert-data-parallel group, EPZeroShardUpdate
    (dense state over dp, expert state over edp), the stats summed over dp."""
    import mindspore as ms
    from mindloom_model import DeepseekV3, DeepseekV3WithLoss, moe_routers
    from mindloom_parallel import (
        EPGradReducer,
        EPZeroShardUpdate,
        GradReducer,
        ParallelDims,
        dp_slice,
        expert_parallel,
        init_expert_groups,
        init_parallel,
        is_expert_param,
    )
    from mindspore import nn, ops

    cfg = model_config()
    pcfg = ParallelDims(**LAYOUTS[name])
    groups = init_parallel(pcfg, cfg)
    model = DeepseekV3(cfg)
    ep, edp = init_expert_groups(groups.rank, pcfg)
    expert_parallel(model, ep)
    LossStats, _, _ = _cells()
    params = model.trainable_params()
    names = [p.name for p in params]
    dense = [p for p in params if not is_expert_param(p.name)]
    flags = [len(p.shape) >= 2 for p in params]

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = LossStats(DeepseekV3WithLoss(model))
            self.weights = ms.ParameterTuple(params)
            # the loss is / N_MICRO already: dense grads summed over dp, experts over edp
            self.reducer = EPGradReducer(names, 1, edp, GradReducer(dense, groups.dp, 0.05))
            self.zero = EPZeroShardUpdate(params, groups.dp, edp, flags, 0.05)
            self.sum_dp = ops.AllReduce(ops.ReduceOp.SUM, group=groups.dp.name)
            self.h = ms.Tensor(np.array([LR, B1, B2, EPS, WD, 1.0], np.float32))

        @ms.jit
        def construct(self, tokens, labels, pos, seg, mask):
            fn = ms.value_and_grad(self.net, None, self.weights, has_aux=True)
            (loss, stats), grads = fn(tokens, labels, pos, seg, mask)
            grads = self.reducer(grads)
            loss = self.sum_dp(ops.depend(loss, grads))
            stats = self.sum_dp(ops.depend(stats, loss))
            h = self.h
            token = self.zero.update(grads, h[5], h[0], h[1], h[2], h[3], h[4],
                                     ops.depend(loss, stats))  # fmt: skip
            return ops.depend(loss, self.zero.share(token)), stats

    step = Step()
    biases = [r.expert_bias for r in moe_routers(model)]
    rec = {"loss": [], "stats": [], "loads": [], "rank": groups.rank, "stage": 0,
           "ep_index": ep.index, "tp_index": 0, "owned": len(step.zero.owned),
           "state_values": [step.zero.dense.state_values, step.zero.expert.state_values]}  # fmt: skip
    clock = _Clock(rec)
    for b in batches(cfg.vocab_size):
        clock.tick()
        loss, stats = step(*_tensors(dp_slice(b, groups.dp_rank, pcfg.dp)))
        _record(rec, biases, loss, stats)
    clock.tick()
    np.savez(out / f"{name}_rank{groups.rank}.npz", **_state(model))
    moments = step.zero.full_moments()
    np.savez(out / f"{name}_moments_rank{groups.rank}.npz", **moments)
    return rec


def run_tp_ep(name: str, out: Path) -> dict:
    """tp2 x dp2 with ep2 inside dp: the model split by the DeepSeek-V3 tp plan (MLA over
    heads, the shared experts over their width, routed experts whole) and its routed experts
    over the ep group; two micro-batches per rank (forward and backward compiled, their
    gradients added), then one compiled reduction: the MLA down-projections' partial
    gradients over tp, dense over dp, expert blocks over the expert-data-parallel group
    (this rank alone here), the global norm, the loss and stats summed over dp."""
    import mindspore as ms
    from mindloom_model import DeepseekV3, deepseek_tp_plan, moe_routers
    from mindloom_parallel import (
        EPGradReducer,
        GradReducer,
        ParallelDims,
        TPEPNormSquare,
        TPGradReducer,
        dp_slice,
        expert_parallel,
        init_expert_groups,
        init_parallel,
        is_expert_param,
        parallelize_deepseek_graph,
        tp_param_names,
    )
    from mindspore import nn, ops

    cfg = model_config()
    pcfg = ParallelDims(**LAYOUTS[name])
    groups = init_parallel(pcfg, cfg)
    model = DeepseekV3(cfg)
    ep, edp = init_expert_groups(groups.rank, pcfg)
    parallelize_deepseek_graph(model, pcfg, groups)
    expert_parallel(model, ep)
    _, AdamW, ForwardBackward = _cells()
    params = model.trainable_params()
    names = [p.name for p in params]
    plan = deepseek_tp_plan(cfg.first_k_dense_replace)
    partial = set(tp_param_names(model, plan, ("partial_grad",)))
    split = set(tp_param_names(model, plan, ("colwise", "rowwise", "vocab")))
    dense = [p for p in params if not is_expert_param(p.name)]

    class Reduce(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            # the loss is / N_MICRO already: dense grads summed over dp, experts over edp
            dp_red = EPGradReducer(names, 1, edp, GradReducer(dense, groups.dp, 0.05))
            self.reducer = TPGradReducer(params, names, groups, False, dp_red,
                                         partial=tuple(n in partial for n in names))  # fmt: skip
            self.norm = TPEPNormSquare([n in split for n in names],
                                       [is_expert_param(n) for n in names], groups.tp, ep)  # fmt: skip
            self.sum_dp = ops.AllReduce(ops.ReduceOp.SUM, group=groups.dp.name)

        @ms.jit
        def construct(self, grads, loss, stats):
            grads = self.reducer(grads)
            sq = ()
            for g in grads:
                sq = sq + ((g * g).sum(),)
            norm = ops.sqrt(self.norm(sq))
            loss = self.sum_dp(ops.depend(loss.reshape(1), norm))
            stats = self.sum_dp(ops.depend(stats, loss))
            return grads, loss.reshape(()), stats, norm

    fb, reduce_, opt = ForwardBackward(model, params), Reduce(), AdamW(params)
    biases = [r.expert_bias for r in moe_routers(model)]
    rec = {"loss": [], "stats": [], "loads": [], "grad_norm": [], "rank": groups.rank,
           "stage": 0, "ep_index": ep.index, "tp_index": groups.tp.index}  # fmt: skip
    clock = _Clock(rec)
    per_rank = N_MICRO // pcfg.dp
    for b in batches(cfg.vocab_size):
        clock.tick()
        mine = dp_slice(b, groups.dp_rank, pcfg.dp)
        loss, stats, acc = None, None, None
        for j in range(per_rank):
            mb = {k: v[j * MBS : (j + 1) * MBS] for k, v in mine.items()}
            (lo, st), grads = fb(*_tensors(mb))
            loss = lo if loss is None else loss + lo
            stats = st if stats is None else stats + st
            acc = list(grads) if acc is None else [a + g for a, g in zip(acc, grads)]
        grads, loss, stats, norm = reduce_(ms.mutable(tuple(acc)), loss, stats)
        opt(ms.mutable(tuple(grads)))
        _record(rec, biases, loss, stats)
        rec["grad_norm"].append(float(norm.asnumpy()))
    clock.tick()
    np.savez(out / f"{name}_rank{groups.rank}.npz", **_state(model))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--layouts", default="")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GLOG_v", "3")
    if args.reference:
        reference(out)
        return 0
    from mindloom_parallel import guard_worker, mark_run_ended

    guard_worker()
    results = {}
    for name in [n for n in args.layouts.split(",") if n]:
        run = run_pp if name.startswith("pp") else run_tp_ep if name.startswith("tp") \
            else run_dp_zero  # fmt: skip
        results[name] = run(name, out)
        rank = results[name]["rank"]
    (out / f"result_rank{rank}.json").write_text(json.dumps(results))
    mark_run_ended(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
