"""dp2 on this machine's cores against the one-process run: tokens/s and communication share.

    ./dev bench benchmarks/parallel.py [--preset shakespeare-char] [--steps 20] [--repeats 3]

The peer is the same model trained by ONE process with the same global batch and the same
compiled (GRAPH_MODE) train step. dp2 runs that step in two msrun workers, each on half of
the batch, with mindloom_parallel's bucketed GradReducer inside the compiled graph.
Communication share: each worker also times the same compiled step WITHOUT the reducer
(interleaved, same process); share = 1 - t_without / t_with. Both arms run in this one
invocation, alternating (one-process, dp2, one-process, dp2, ...), medians reported.

With `--tp`, the same msrun workers then time tensor parallel (tp2, every rank on the
whole batch) as ONE compiled step (`mindloom_parallel.parallelize_llama_graph`: the region
collectives inside the graph) and through the PyNative `ParallelEngine` (the `context.mode:
pynative` path), and print their ms/step next to the compiled dp2 step's:

    ./dev bench benchmarks/parallel.py --preset debug --tp [--tp-sp]

With `--zero`, the same workers time dp2 + ZeRO-1 (AdamW state for the owned parameters
only) as ONE compiled step (`mindloom_parallel.ZeroShardUpdate`), the same step without
its collectives (its communication share), dp2 with the fused AdamW on every parameter
compiled (the peer) and ZeRO-1 through the PyNative engine (`ZeroAdamW`):

    ./dev bench benchmarks/parallel.py --preset debug --seq 32 --zero

With `--pp`, the same workers time pipeline parallel (pp2, `--pp-micro` micro-batches of
the whole batch, 1F1B) with each stage's forward and backward compiled
(`mindloom_parallel.PipelineGraph`, the `context.mode: graph` path) and through the
PyNative `ParallelEngine` (`context.mode: pynative`), both with an SGD update, next to the
compiled dp2 and one-process steps:

    ./dev bench benchmarks/parallel.py --preset debug --pp

What the CPU backend can show: that the DP algorithm runs and what its all-reduce costs
relative to compute when two workers share 2 cores. What it cannot show: scaling, since
one process already uses both cores; that needs one device per worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# this folder holds a benchmarks/tokenize.py that would shadow the standard library's
# tokenize module (imported by MindSpore through dill) when run as a script from here
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _batch(cfg, gbs, seq, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    t = rng.integers(0, cfg.vocab_size, (gbs, seq + 1)).astype(np.int32)
    return t[:, :-1].copy(), t[:, 1:].copy()


def _step_cell(model, reducer):
    import mindspore as ms
    from mindloom_model import causal_lm_loss
    from mindspore import nn, ops

    class Net(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.model = model

        def construct(self, tokens, labels):
            return causal_lm_loss(self.model(tokens), labels)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = Net()
            self.params = ms.ParameterTuple(model.trainable_params())
            self.grad = ops.GradOperation(get_by_list=True)
            self.reducer = reducer
            self.opt = nn.SGD(self.params, learning_rate=0.1)

        def construct(self, tokens, labels):
            loss = self.net(tokens, labels)
            grads = self.grad(self.net, self.params)(tokens, labels)
            if self.reducer is not None:
                grads = self.reducer(grads)
            self.opt(grads)
            return loss

    return Step()


def _tp_step_cell(model, pcfg, groups):
    """tp2 as one compiled step: the engine's split with graph region cells, SGD inside."""
    import mindspore as ms
    from mindloom_parallel import TPGradReducer, TPLlamaWithLoss, parallelize_llama_graph
    from mindspore import nn, ops

    model = parallelize_llama_graph(model, pcfg, groups)
    net = TPLlamaWithLoss(model, groups.tp)
    params = model.trainable_params()
    names = [p.name for p in params]

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net
            self.params = ms.ParameterTuple(params)
            self.grad = ops.GradOperation(get_by_list=True)
            self.reducer = TPGradReducer(params, names, groups, pcfg.sequence_parallel)
            self.opt = nn.SGD(self.params, learning_rate=0.1)

        def construct(self, tokens, labels):
            loss = self.net(tokens, labels)
            grads = self.reducer(self.grad(self.net, self.params)(tokens, labels))
            self.opt(grads)
            return loss

    return Step()


def _adamw_step_cell(model, groups, zero: bool, comm: bool):
    """dp2 with AdamW as one compiled step: the GradReducer (``comm``), then the fused
    AdamW on every parameter (plain dp) or ZeRO-1's owned ones plus the owners' share
    (``zero``, mindloom_parallel.ZeroShardUpdate). ``comm=False``: the same step without
    its collectives (the communication share's peer)."""
    import mindspore as ms
    import numpy as np
    from mindloom_model import causal_lm_loss
    from mindloom_parallel import GradReducer, ZeroShardUpdate, adamw_scalars
    from mindspore import Parameter, Tensor, nn, ops

    params = model.trainable_params()
    lr, eps, wd = adamw_scalars(1, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    adamw = ops.AdamWeightDecay()

    class Net(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.model = model

        def construct(self, tokens, labels):
            return causal_lm_loss(self.model(tokens), labels)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = Net()
            self.params = ms.ParameterTuple(params)
            self.grad = ops.GradOperation(get_by_list=True)
            self.reducer = GradReducer(params, groups.dp, mean=True) if comm else None
            self.zero = ZeroShardUpdate(params, groups.dp, [1.0] * len(params)) if zero else None
            if not zero:
                self.m = ms.ParameterTuple([Parameter(np.zeros(p.shape, np.float32),
                                            name="m." + p.name) for p in params])  # fmt: skip
                self.v = ms.ParameterTuple([Parameter(np.zeros(p.shape, np.float32),
                                            name="v." + p.name) for p in params])  # fmt: skip
            self.h = Tensor(np.array([1.0, lr, 0.9, 0.95, eps, wd], np.float32))

        def construct(self, tokens, labels):
            loss = self.net(tokens, labels)
            grads = self.grad(self.net, self.params)(tokens, labels)
            if self.reducer is not None:
                grads = self.reducer(grads)
            h = self.h
            if self.zero is not None:
                tok = self.zero.update(grads, h[0], h[1], h[2], h[3], h[4], h[5],
                                       ops.depend(loss, grads))  # fmt: skip
                if self.reducer is not None:
                    tok = self.zero.share(tok)
                return tok
            for i in range(len(grads)):
                r = adamw(self.params[i], self.m[i], self.v[i], h[1], h[2], h[3], h[4], h[5],
                          grads[i])  # fmt: skip
                loss = ops.depend(loss, r)
            return loss

    return Step()


def zero_arms(args, groups) -> dict:
    """ms/step of dp2 + ZeRO-1 compiled (and without its collectives: the communication
    share), dp2 with AdamW compiled (the peer), and ZeRO-1 through the PyNative engine."""
    import mindspore as ms
    from mindloom_model import Llama, get_preset
    from mindloom_parallel import (
        ParallelConfig,
        ParallelEngine,
        ZeroAdamW,
        dp_slice,
        init_parallel,
    )
    from mindspore import Tensor

    cfg = get_preset(args.preset)
    tokens, labels = _batch(cfg, args.global_batch, args.seq)
    local = dp_slice({"t": tokens, "l": labels}, groups.dp_rank, 2)
    t, lab = Tensor(local["t"]), Tensor(local["l"])
    cells = {
        "dp2_adamw_s": _adamw_step_cell(Llama(cfg), groups, zero=False, comm=True),
        "zero1_compiled_s": _adamw_step_cell(Llama(cfg), groups, zero=True, comm=True),
        "zero1_no_comm_s": _adamw_step_cell(Llama(cfg), groups, zero=True, comm=False),
    }
    runs = {k: [] for k in cells}
    for _ in range(args.repeats):  # interleaved in the same process
        for k, cell in cells.items():
            runs[k].append(_time_steps(cell, t, lab, args.steps))
    out = {k: statistics.median(v) for k, v in runs.items()}
    out["zero1_state_values"] = cells["zero1_compiled_s"].zero.state_values
    out["dp2_state_values"] = sum(cells["zero1_compiled_s"].zero.sizes)
    ms.set_context(mode=ms.PYNATIVE_MODE)  # the engine's mode (context.mode: pynative)
    pcfg = ParallelConfig(dp=2, zero_stage=1)
    g = init_parallel(pcfg, cfg)
    engine = ParallelEngine(Llama(cfg), pcfg, g, micro_batch_size=args.global_batch // 2)
    opt = ZeroAdamW(engine.params, engine.param_names, g, 1, comm_stats=engine.comm_stats)
    batch = {"tokens": local["t"], "labels": local["l"]}
    times, comm = [], []
    for i in range(2 + args.engine_steps):
        t0 = time.perf_counter()
        _, grads = engine.forward_backward(batch)  # resets comm_stats
        opt.step(grads, i + 1, 1e-3, weight_decay=0.1)
        if i >= 2:
            times.append(time.perf_counter() - t0)
            comm.append(engine.comm_stats.time_s)
    out["zero1_engine_s"] = statistics.median(times)
    out["zero1_engine_share"] = sum(comm) / sum(times)
    return out


def _sgd_graph(params):
    """SGD over `params` as one compiled graph: the compiled pipeline's update, as the
    trainer pairs `PipelineGraph` with one compiled AdamW graph (`ZeroAdamWGraph`)."""
    import mindspore as ms
    from mindspore import nn

    class SGD(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.params = ms.ParameterTuple(params)
            self.opt = nn.SGD(self.params, learning_rate=0.1)

        @ms.jit
        def construct(self, grads):
            return self.opt(grads)

    sgd = SGD()
    return lambda grads: sgd(ms.mutable(tuple(grads)))  # a plain tuple is a graph constant


def _time_engine(engine, tokens, labels, steps, update=None):
    """An engine's forward_backward plus an SGD update: in place op by op (PyNative, the
    engine's `context.mode: pynative` path), or `update(grads)` (a compiled graph)."""
    from mindspore import ops

    batch = {"tokens": tokens, "labels": labels}

    def one():
        loss, grads = engine.forward_backward(batch)
        if update is not None:
            update(grads)
            return loss
        for p, g in zip(engine.params, grads):
            ops.assign(p, p - 0.1 * g)
        return loss

    one()
    one()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    return (time.perf_counter() - t0) / steps


def tp_arms(args, groups_dp) -> dict:
    """ms/step of tp2 compiled and tp2 through the engine (PyNative), same workers."""
    import mindspore as ms
    from mindloom_model import Llama, get_preset
    from mindloom_parallel import ParallelConfig, ParallelEngine, init_parallel
    from mindspore import Tensor

    # the compiled arm needs GRAPH_MODE back: --zero's engine arm, run first, ends in PyNative
    # (where this step cell ran op by op: 2452 ms/step for tp2 "compiled" with --zero --tp)
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = get_preset(args.preset)
    pcfg = ParallelConfig(tp=2, sequence_parallel=args.tp_sp)
    groups = init_parallel(pcfg, cfg)
    tokens, labels = _batch(cfg, args.global_batch, args.seq)
    step = _tp_step_cell(Llama(cfg), pcfg, groups)
    compiled = [
        _time_steps(step, Tensor(tokens), Tensor(labels), args.steps) for _ in range(args.repeats)
    ]
    ms.set_context(mode=ms.PYNATIVE_MODE)  # the engine's mode (context.mode: pynative)
    engine = ParallelEngine(Llama(cfg), pcfg, groups, micro_batch_size=args.global_batch)
    eng = [_time_engine(engine, tokens, labels, args.engine_steps) for _ in range(args.repeats)]
    return {"tp2_compiled_s": statistics.median(compiled), "tp2_engine_s": statistics.median(eng)}


def pp_arms(args) -> dict:
    """ms/step of pp2 with compiled stage graphs (PipelineGraph) and through the PyNative
    engine, same workers, same batch; each with an in-place SGD update."""
    import mindspore as ms
    from mindloom_model import Llama, get_preset
    from mindloom_parallel import ParallelConfig, ParallelEngine, PipelineGraph, init_parallel

    ms.set_context(mode=ms.PYNATIVE_MODE)  # both: the schedule is Python
    cfg = get_preset(args.preset)
    pcfg = ParallelConfig(pp=2, micro_batch_num=args.pp_micro)
    groups = init_parallel(pcfg, cfg)
    tokens, labels = _batch(cfg, args.global_batch, args.seq)
    mbs = args.global_batch // args.pp_micro
    out = {}
    for key, cls, steps in (("pp2_compiled", PipelineGraph, args.steps),
                            ("pp2_engine", ParallelEngine, args.engine_steps)):  # fmt: skip
        engine = cls(Llama(cfg), pcfg, groups, micro_batch_size=mbs)
        update = _sgd_graph(engine.params) if cls is PipelineGraph else None
        out[key + "_s"] = statistics.median(
            _time_engine(engine, tokens, labels, steps, update) for _ in range(args.repeats)
        )
        out[key + "_share"] = engine.metrics["comm_share"]
    return out


def _time_steps(step, tokens, labels, steps):
    step(tokens, labels).asnumpy()  # compile + warm up
    step(tokens, labels).asnumpy()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(tokens, labels)
    loss.asnumpy()
    return (time.perf_counter() - t0) / steps


def one_process(args) -> float:
    import mindspore as ms
    from mindloom_model import Llama, get_preset
    from mindspore import Tensor

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    cfg = get_preset(args.preset)
    tokens, labels = _batch(cfg, args.global_batch, args.seq)
    step = _step_cell(Llama(cfg), None)
    dt = _time_steps(step, Tensor(tokens), Tensor(labels), args.steps)
    return args.global_batch * args.seq / dt


def worker(args) -> int:
    import mindspore as ms
    from mindloom_model import Llama, get_preset
    from mindloom_parallel import GradReducer, ParallelConfig, dp_slice, init_parallel
    from mindspore import Tensor

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    if args.worker_threads:
        ms.set_context(runtime_num_threads=args.worker_threads)
    cfg = get_preset(args.preset)
    pcfg = ParallelConfig(dp=2)
    groups = init_parallel(pcfg, cfg)
    tokens, labels = _batch(cfg, args.global_batch, args.seq)
    local = dp_slice({"t": tokens, "l": labels}, groups.dp_rank, pcfg.dp)
    t, lab = Tensor(local["t"]), Tensor(local["l"])
    model = Llama(cfg)
    with_comm = _step_cell(model, GradReducer(model.trainable_params(), groups.dp, mean=True))
    model2 = Llama(cfg)
    without = _step_cell(model2, None)
    a, b = [], []
    for _ in range(args.repeats):  # interleaved A/B in the same process
        a.append(_time_steps(with_comm, t, lab, args.steps))
        b.append(_time_steps(without, t, lab, args.steps))
    ta, tb = statistics.median(a), statistics.median(b)
    res = {
        "rank": groups.rank,
        "step_s": ta,
        "step_s_no_comm": tb,
        "tokens_per_s": args.global_batch * args.seq / ta,
        "comm_share": max(0.0, 1.0 - tb / ta),
    }
    if args.zero:  # before --tp: both end in PyNative
        res.update(zero_arms(args, groups))
    if args.tp:
        res.update(tp_arms(args, groups))
    if args.pp:  # last: PyNative from here on
        res.update(pp_arms(args))
    Path(args.result_dir, f"rank{groups.rank}.json").write_text(json.dumps(res))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="shakespeare-char")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", action="store_true", help="also time tp2 compiled and engine")
    ap.add_argument("--tp-sp", action="store_true", help="tp2 arms with sequence parallel")
    ap.add_argument(
        "--zero",
        action="store_true",
        help="also time dp2 + ZeRO-1 compiled and engine, and dp2 AdamW compiled",
    )
    ap.add_argument("--pp", action="store_true", help="also time pp2 compiled and engine")
    ap.add_argument("--pp-micro", type=int, default=4, help="micro-batches of the pp2 arms")
    ap.add_argument("--engine-steps", type=int, default=3, help="steps of the engine arm")
    ap.add_argument(
        "--worker-threads",
        type=int,
        default=0,
        help="MindSpore runtime threads per msrun worker (0: MindSpore's default)",
    )
    ap.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    if args.as_worker:
        return worker(args)
    if args.one_process:
        print(one_process(args))
        return 0

    from mindloom_parallel import launch

    single, dp2, shares, tp_rows, zero_rows, pp_rows = [], [], [], [], [], []
    for _ in range(args.repeats):
        single.append(_subprocess_one(args))
        with tempfile.TemporaryDirectory() as d:
            launch(
                [__file__, "--as-worker", "--result-dir", d, *_fwd(args)],
                nproc=2,
                log_dir=Path(d) / "logs",
                timeout_s=900,
                cluster_timeout_s=120,
            )
            ranks = [json.loads(Path(d, f"rank{i}.json").read_text()) for i in (0, 1)]
        dp2.append(min(x["tokens_per_s"] for x in ranks))
        shares.append(statistics.mean(x["comm_share"] for x in ranks))
        if args.zero:  # the slower rank's step; shares and state per rank
            zero_rows.append({k: max(x[k] for x in ranks) for k in ranks[0] if k.startswith(
                ("zero1_", "dp2_adamw", "dp2_state"))})  # fmt: skip
            zero_rows[-1]["state"] = [x["zero1_state_values"] for x in ranks]
            zero_rows[-1]["share"] = statistics.mean(
                1 - x["zero1_no_comm_s"] / x["zero1_compiled_s"] for x in ranks
            )
            zero_rows[-1]["engine_share"] = statistics.mean(x["zero1_engine_share"] for x in ranks)
        if args.tp:  # the slower rank's step, as for dp2
            tp_rows.append({k: max(x[k] for x in ranks) for k in ("step_s", "tp2_compiled_s",
                                                                  "tp2_engine_s")})  # fmt: skip
        if args.pp:  # the slower rank's step; the communication share of rank 0
            pp_rows.append({k: max(x[k] for x in ranks) for k in ("step_s", "pp2_compiled_s",
                                                                  "pp2_engine_s")})  # fmt: skip
            pp_rows[-1].update({k: ranks[0][k] for k in ("pp2_compiled_share",
                                                         "pp2_engine_share")})  # fmt: skip
    s1, s2 = statistics.median(single), statistics.median(dp2)
    print(
        f"model {args.preset}, global batch {args.global_batch} x {args.seq} tokens, GRAPH_MODE, CPU"
    )
    print(f"one process : {s1:10.0f} tokens/s   (runs: {', '.join(f'{x:.0f}' for x in single)})")
    print(f"dp2 (msrun) : {s2:10.0f} tokens/s   (runs: {', '.join(f'{x:.0f}' for x in dp2)})")
    print(f"ratio dp2 / one process: {s2 / s1:.2f}")
    print(f"communication share of the dp2 step (median): {statistics.median(shares):.1%}")
    if zero_rows:
        print("zero arms per launch (slower rank):", json.dumps(zero_rows))
        med = {k: statistics.median(r[k] for r in zero_rows) for k in zero_rows[0]
               if k != "state"}  # fmt: skip
        base = med["dp2_adamw_s"] * 1e3
        st, total = zero_rows[0]["state"], int(med["dp2_state_values"])
        print(f"dp2 AdamW compiled     : {base:9.1f} ms/step   AdamW state {total} values per rank")
        z = med["zero1_compiled_s"] * 1e3
        print(
            f"dp2 + ZeRO-1 compiled  : {z:9.1f} ms/step   ({z / base:.2f}x dp2 AdamW compiled; "
            f"communication share {med['share']:.1%}; AdamW state per rank {st})"
        )
        e = med["zero1_engine_s"] * 1e3
        print(
            f"dp2 + ZeRO-1 engine    : {e:9.1f} ms/step   ({e / base:.2f}x dp2 AdamW compiled; "
            f"communication share {med['engine_share']:.1%})"
        )
        print(f"ratio ZeRO-1 engine / compiled: {e / z:.1f}")
    if tp_rows:
        med = {k: statistics.median(r[k] for r in tp_rows) for k in tp_rows[0]}
        sp = " + sp" if args.tp_sp else ""
        dp_ms = med["step_s"] * 1e3
        print(f"dp2 compiled      : {dp_ms:9.1f} ms/step")
        for key, label in (("tp2_compiled_s", f"tp2{sp} compiled"), ("tp2_engine_s",
                                                                    f"tp2{sp} engine")):  # fmt: skip
            ms_ = med[key] * 1e3
            print(f"{label:<18}: {ms_:9.1f} ms/step   ({ms_ / dp_ms:.2f}x dp2 compiled)")
        print(f"ratio tp2{sp} engine / compiled: {med['tp2_engine_s'] / med['tp2_compiled_s']:.1f}")
    if pp_rows:
        _print_pp(args, pp_rows, s1)
    return 0


def _print_pp(args, rows, one_tokens_per_s) -> None:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    one_ms = args.global_batch * args.seq / one_tokens_per_s * 1e3
    dp_ms = med["step_s"] * 1e3
    print(f"one process       : {one_ms:9.1f} ms/step")
    print(f"dp2 compiled      : {dp_ms:9.1f} ms/step")
    for key, label in (("pp2_compiled", "pp2 compiled"), ("pp2_engine", "pp2 engine")):
        ms_ = med[key + "_s"] * 1e3
        print(f"{label:<18}: {ms_:9.1f} ms/step   ({ms_ / dp_ms:.2f}x dp2 compiled, "
              f"{ms_ / one_ms:.2f}x one process; communication share "
              f"{med[key + '_share']:.1%}; {args.pp_micro} micro-batches)")  # fmt: skip
    print(f"ratio pp2 engine / compiled: {med['pp2_engine_s'] / med['pp2_compiled_s']:.1f}")


def _fwd(args):
    return [
        "--preset", args.preset, "--global-batch", str(args.global_batch),
        "--seq", str(args.seq), "--steps", str(args.steps), "--repeats", "2",
        "--engine-steps", str(args.engine_steps), "--pp-micro", str(args.pp_micro),
        "--worker-threads", str(args.worker_threads),
    ] + (["--tp"] if args.tp else []) + (["--pp"] if args.pp else []) + (["--tp-sp"] if args.tp_sp else []) + (
        ["--zero"] if args.zero else [])  # fmt: skip


def _subprocess_one(args) -> float:
    # a fresh process each repeat, like the dp2 arm, so both pay the same start-up
    import subprocess

    cmd = [sys.executable, __file__, "--one-process", *_fwd(args)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: one-process run failed: {r.stderr.strip()[-2000:]}")
    return float(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
