"""Training-health monitors on vs off: the compiled train step alone, and with the
log-step statistics (monitor.numerics and monitor.max_logits) at the default interval.

    ./dev bench benchmarks/health_overhead.py [--preset 17m] [--batch 4] [--seq 256]
        [--steps 8] [--threads 2] [--log-interval 10]

The trainer runs the plain compiled step (forward, backward, clip, AdamW) on every step
and, only at log steps, the numerics graph instead (_step.TrainStep(numerics=True,
share=...): the same update, also returning per-tensor grad/param/update norms and AdamW
moment means) plus the MaxLogits forward (_numerics.LogitStats). Each graph is timed on
the same batch, round by round so all see the same load; medians are reported. The host
side of a log step (reading the statistics, reducing them per layer, the health rules on
one record) is timed separately. The overhead at --log-interval N is

    ((N - 1) * plain + numerics step + MaxLogits forward + host) / (N * plain) - 1

and, for comparison, "every step" is the numerics graph on every step (how it ran before).
The machine is shared: read the load averages printed at start and end.
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
    p.add_argument("--preset", default="17m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-interval", type=int, default=10)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    from mindloom_model import Llama, LlamaWithLoss, get_preset
    from mindloom_train._health import HealthMonitor
    from mindloom_train._numerics import NumericsFields, logit_stats
    from mindloom_train._step import TrainStep, decay_flags, hyper_vector
    from mindspore import Tensor

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"{args.threads} threads; {args.preset} batch {args.batch} x {args.seq}")  # fmt: skip
    cfg = get_preset(args.preset)
    rng = np.random.default_rng(0)
    b, s = args.batch, args.seq
    tokens = rng.integers(0, cfg.vocab_size, (b, s + 1)).astype(np.int32)
    ins = [Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]),
           Tensor(np.tile(np.arange(s, dtype=np.int32), (b, 1))),
           Tensor(np.zeros((b, s), np.int32)), Tensor(np.ones((b, s), np.float32))]  # fmt: skip
    hyper = hyper_vector(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                         adam_step=1, clip=1.0, spike=None, loss_scale=1.0)  # fmt: skip

    ms.set_seed(0)
    model = Llama(get_preset(args.preset))
    net = LlamaWithLoss(model)
    weights = ms.ParameterTuple(net.trainable_params())
    flags = decay_flags(weights, False)
    plain = TrainStep(net, weights, flags)
    plain.set_train(True)
    numerics = TrainStep(net, weights, flags, numerics=True, share=plain)
    numerics.set_train(True)
    logits = logit_stats(model, 30.0)
    graphs = {
        "plain": lambda: plain(*ins, hyper),
        "numerics": lambda: numerics(*ins, hyper),
        "maxlogits": lambda: logits(ins[0], ins[2], ins[3], ins[4]),
    }
    last = {}

    def run(kind):
        out = graphs[kind]()
        last[kind] = out
        out[0].asnumpy()  # wait for the graph

    compile_s = {}
    for kind in graphs:
        t = time.perf_counter()
        run(kind)
        compile_s[kind] = time.perf_counter() - t
    for _ in range(args.warmup):
        for kind in graphs:
            run(kind)
    times = {k: [] for k in graphs}
    for _ in range(args.steps):
        for kind in graphs:
            t = time.perf_counter()
            run(kind)
            times[kind].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}

    fields = NumericsFields(weights, args.log_interval)
    host = []
    for _ in range(5):
        fields.rows, fields.logits = last["numerics"][-1], last["maxlogits"]
        t = time.perf_counter()
        rec = {"step": 10, "loss": 3.0, "grad_norm": 1.0, "data_wait_frac": 0.0,
               "comm_share": 0.0, **fields.fields()}  # fmt: skip
        HealthMonitor().observe(rec)
        host.append(time.perf_counter() - t)
    host_s = statistics.median(host)

    print(f"{'graph':10} {'ms/call':>9}  compile")
    for kind in graphs:
        print(f"{kind:10} {med[kind] * 1e3:9.1f}  {compile_s[kind]:.1f} s")
    n = args.log_interval
    every = med["numerics"] / med["plain"] - 1
    log_step = med["numerics"] + med["maxlogits"] + host_s
    at_interval = ((n - 1) * med["plain"] + log_step) / (n * med["plain"]) - 1
    print(f"numerics on every step (before): {every:+.1%} step time")
    print(
        f"host side per log step: {host_s * 1e3:.2f} ms; a log step costs "
        f"{log_step / med['plain']:.2f}x a plain step"
    )
    print(f"overhead at log interval {n} (numerics + MaxLogits at log steps only): "
          f"{at_interval:+.1%}")  # fmt: skip
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
