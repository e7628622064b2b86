"""dp2 on this machine's cores against the one-process run: tokens/s and communication share.

    ./dev bench benchmarks/parallel.py [--preset shakespeare-char] [--steps 20] [--repeats 3]

The peer is the same model trained by ONE process with the same global batch and the same
compiled (GRAPH_MODE) train step. dp2 runs that step in two msrun workers, each on half of
the batch, with mindloom_parallel's bucketed GradReducer inside the compiled graph.
Communication share: each worker also times the same compiled step WITHOUT the reducer
(interleaved, same process); share = 1 - t_without / t_with. Both arms run in this one
invocation, alternating (one-process, dp2, one-process, dp2, ...), medians reported.

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
    from mindloom_model._llama import causal_lm_loss
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
    from mindloom_model import get_preset
    from mindloom_model._llama import Llama
    from mindspore import Tensor

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    cfg = get_preset(args.preset)
    tokens, labels = _batch(cfg, args.global_batch, args.seq)
    step = _step_cell(Llama(cfg), None)
    dt = _time_steps(step, Tensor(tokens), Tensor(labels), args.steps)
    return args.global_batch * args.seq / dt


def worker(args) -> int:
    import mindspore as ms
    from mindloom_model import get_preset
    from mindloom_model._llama import Llama
    from mindloom_parallel import GradReducer, ParallelConfig, dp_slice, init_parallel
    from mindspore import Tensor

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
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
    Path(args.result_dir, f"rank{groups.rank}.json").write_text(json.dumps(res))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="shakespeare-char")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
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

    single, dp2, shares = [], [], []
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
    s1, s2 = statistics.median(single), statistics.median(dp2)
    print(
        f"model {args.preset}, global batch {args.global_batch} x {args.seq} tokens, GRAPH_MODE, CPU"
    )
    print(f"one process : {s1:10.0f} tokens/s   (runs: {', '.join(f'{x:.0f}' for x in single)})")
    print(f"dp2 (msrun) : {s2:10.0f} tokens/s   (runs: {', '.join(f'{x:.0f}' for x in dp2)})")
    print(f"ratio dp2 / one process: {s2 / s1:.2f}")
    print(f"communication share of the dp2 step (median): {statistics.median(shares):.1%}")
    return 0


def _fwd(args):
    return [
        "--preset", args.preset, "--global-batch", str(args.global_batch),
        "--seq", str(args.seq), "--steps", str(args.steps), "--repeats", "2",
    ]  # fmt: skip


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
