"""Counter-based dropout (mindloom_model.CounterDropout) vs MindSpore's nn.Dropout kernel.

    ./dev bench benchmarks/dropout.py [--presets debug,17m] [--steps 8] [--threads 2]
        [--batch-debug 16] [--batch-17m 4] [--p 0.1]

For each preset, one compiled train step (mindloom_train's TrainStep: forward, backward,
clipping, AdamW; the step `mindloom train` runs) in three variants on the same batch:
no dropout, dropout p with the counter-based masks (a key fed each step, what the
trainer does: bit-exact across a resume), and dropout p through MindSpore's stateful
dropout kernel (the same cells called without a key, what the model did before).
Steps are interleaved round by round so all three see the same load; medians are
reported with the extra cost of each dropout over no dropout. The machine is shared:
read the load averages printed at start and end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# benchmarks/ holds scripts (e.g. tokenize.py) that would shadow standard modules
sys.path[:] = [
    p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))
]

import numpy as np  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="debug,17m")
    p.add_argument("--steps", type=int, default=8, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-debug", type=int, default=16)
    p.add_argument("--batch-17m", type=int, default=4)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: preset max)")
    p.add_argument("--p", type=float, default=0.1)
    return p.parse_args(argv)


def bench_preset(name, batch, args):
    import mindspore as ms
    from mindloom_model import Llama, LlamaWithLoss, dropout_key, get_preset
    from mindloom_train import TrainStep, decay_flags, hyper_vector
    from mindspore import Tensor

    seq = args.seq or get_preset(name).max_seq_len
    rng = np.random.default_rng(0)
    cfg0 = get_preset(name)
    tokens = rng.integers(0, cfg0.vocab_size, (batch, seq + 1)).astype(np.int32)
    ins = [
        Tensor(tokens[:, :-1]),
        Tensor(tokens[:, 1:]),
        Tensor(np.tile(np.arange(seq, dtype=np.int32), (batch, 1))),
        Tensor(np.zeros((batch, seq), np.int32)),
        Tensor(np.ones((batch, seq), np.float32)),
    ]
    hyper = hyper_vector(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                         adam_step=1, clip=1.0, spike=None, loss_scale=1.0)  # fmt: skip

    def make(p):
        net = LlamaWithLoss(Llama(get_preset(name, dropout=p)))
        weights = ms.ParameterTuple(net.trainable_params())
        step = TrainStep(net, weights, decay_flags(weights, decay_embeddings=False))
        step.set_train(True)
        return step

    steps = {"none": make(0.0), "counter": make(args.p), "mindspore": make(args.p)}
    counter = [0]

    def run(kind):
        counter[0] += 1
        if kind == "counter":  # a fresh key each step, as the trainer feeds it
            out = steps[kind](*ins, hyper, dropout_key(1234, counter[0], 0))
        else:
            out = steps[kind](*ins, hyper)
        return float(out[0].asnumpy())

    compile_s = {}
    for kind in steps:
        t = time.perf_counter()
        run(kind)
        compile_s[kind] = time.perf_counter() - t
    for _ in range(args.warmup):
        for kind in steps:
            run(kind)
    times = {k: [] for k in steps}
    for _ in range(args.steps):
        for kind in steps:
            t = time.perf_counter()
            run(kind)
            times[kind].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    ntok = batch * seq
    for kind in steps:
        extra = med[kind] - med["none"]
        print(
            f"{name:6} {batch:>5} {seq:>5} {kind:10} {med[kind] * 1e3:9.1f} {ntok / med[kind]:9.0f}"
            f" {extra * 1e3:+9.1f} ms ({extra / med['none']:+.1%}); compile {compile_s[kind]:.1f} s"
        )
    over_ms = med["mindspore"] - med["none"]
    # under load the stateful kernel's overhead can fall below the noise (even negative)
    ratio = f"{(med['counter'] - med['none']) / over_ms:.2f}x" if over_ms > 0 else "n/a (noise)"
    print(
        f"{name:6} counter/mindspore step time: {med['counter'] / med['mindspore']:.3f}x;"
        f" dropout overhead counter/mindspore: {ratio}"
    )
    sys.stdout.flush()


def main(argv=None) -> int:
    args = parse(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs;"
          f" {args.threads} threads; dropout p={args.p}")  # fmt: skip
    print(f"{'preset':6} {'batch':>5} {'seq':>5} {'dropout':10} {'ms/step':>9} {'tok/s':>9}"
          f" {'vs none':>12}")  # fmt: skip
    for name in args.presets.split(","):
        bench_preset(name, getattr(args, "batch_" + name.replace("-", "_")), args)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
