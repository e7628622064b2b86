"""Training-health monitors on vs off: the compiled train step with and without the
in-graph numerics (monitor.numerics), plus the host side of a log step.

    ./dev bench benchmarks/health_overhead.py [--preset 17m] [--batch 4] [--seq 256]
        [--steps 8] [--threads 2] [--log-interval 10]

One compiled TrainStep (forward, backward, clip, AdamW: the step `mindloom train` runs) per
variant on the same batch: "off" is the default step; "on" also returns the per-tensor
grad/param/update norms and AdamW moment means (_step.TrainStep(numerics=True)). Steps are
interleaved round by round so both see the same load; medians are reported. The host
side, paid once per log step: reading the numerics and reducing them per layer
(NumericsFields.fields) and the health rules on one record (HealthMonitor.observe), is
timed separately and spread over --log-interval steps for the overhead at that interval.
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
    from mindloom_train._step import NumericsFields, TrainStep, decay_flags, hyper_vector
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

    def make(numerics: bool):
        ms.set_seed(0)
        net = LlamaWithLoss(Llama(get_preset(args.preset)))
        weights = ms.ParameterTuple(net.trainable_params())
        step = TrainStep(net, weights, decay_flags(weights, False), numerics=numerics)
        step.set_train(True)
        return step, weights

    steps = {"off": make(False), "on": make(True)}
    last = {}

    def run(kind):
        out = steps[kind][0](*ins, hyper)
        last[kind] = out
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

    fields = NumericsFields(steps["on"][1])
    fields.rows = last["on"][-1]
    host = []
    for _ in range(5):
        t = time.perf_counter()
        rec = {"step": 10, "loss": 3.0, "grad_norm": 1.0, "data_wait_frac": 0.0,
               "comm_share": 0.0, **fields.fields()}  # fmt: skip
        HealthMonitor().observe(rec)
        host.append(time.perf_counter() - t)
    host_s = statistics.median(host)

    print(f"{'monitors':8} {'ms/step':>9} {'tok/s':>9}  compile")
    for kind in steps:
        print(f"{kind:8} {med[kind] * 1e3:9.1f} {b * s / med[kind]:9.0f}  {compile_s[kind]:.1f} s")
    step_extra = med["on"] / med["off"] - 1
    at_interval = (med["on"] + host_s / args.log_interval) / med["off"] - 1
    print(f"in-graph numerics: on/off step time {med['on'] / med['off']:.3f}x ({step_extra:+.1%})")
    print(f"host side per log step: {host_s * 1e3:.2f} ms; overhead at log interval "
          f"{args.log_interval}: {at_interval:+.1%}")  # fmt: skip
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
