"""Training-health monitors, each alone and all together, against all off: the cost per log
step on the trainer's own runner at the default log interval, in one process.

    ./dev bench benchmarks/health_overhead.py [--preset 17m] [--batch 4] [--seq 256]
        [--rounds 3] [--host-rounds 200] [--threads 2] [--log-interval 10] [--arms A,B]

One `CompiledRunner` (the one `mindloom train` builds: the plain compiled step on every
step; at log steps a stats step instead, the same update also returning what the monitors
read) over a 17m model trains on the same packed batch. The monitors that live in the
compiled log step each get a stats step of their own, built on the runner's weights and
moments like the real one:

- MaxLogits: the loss net also takes each layer's largest attention logit (the top-logit
  fraction left out);
- top-logit fraction: the fraction of tokens whose top output logit passes the bound (the
  MaxLogits left out);
- local norms: per-tensor gradient and parameter squared norms;
- update ratio: per-tensor parameter and update squared norms;
- AdamW moments: per-tensor mean |m| and mean sqrt(v);
- all on: the runner's own stats step (`monitor.numerics` and `monitor.max_logits`),
  with the health rules and the per-rank memory fields in the record.

(`monitor.numerics` switches the three numerics parts on together and `monitor.max_logits`
both logit parts; the split is this benchmark's, to say what each part costs. The
numerics variants keep the weight copies TrainStep makes whenever numerics is on, which
only the update ratio needs.)

Each round runs, for every arm in turn, a block of that arm and a block with everything
off, in the order A/B, then B/A, ... so machine load falls on both alike. A block is a log
step (its stats step, the step record built and written to a metrics.jsonl as the trainer
does) followed by one plain step (whatever switching graphs costs the next step is in
it); the off block runs the plain step there and writes a record without the monitors.
The other log-interval - 1 steps of an interval are the same plain step either way, so
the overhead at interval N is (arm block - off block) / (N x plain step), each a median
over rounds; the first round compiles and is not counted.

The per-rank memory fields and the health rules run on the host only: their cost is
measured by building and writing the log step's record with and without each, A/B,
`--host-rounds` times, on the stats of one stats step.

The machine is shared: read the load averages printed with each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

# benchmarks/ holds scripts (e.g. tokenize.py) that would shadow standard modules
sys.path[:] = [
    p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))
]

import numpy as np  # noqa: E402

GRAPH_ARMS = ("MaxLogits", "top-logit fraction", "local norms", "update ratio",
              "AdamW moments", "all on")  # fmt: skip


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="17m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of A/B block pairs")
    p.add_argument("--host-rounds", type=int, default=200, help="A/B rounds of the host arms")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-interval", type=int, default=None,
                   help="default: the config's (monitor.log_interval)")  # fmt: skip
    p.add_argument(
        "--arms", default=None, help="comma-separated graph arms to time (default: all of them)"
    )
    return p.parse_args(argv)


def packed_batch(vocab: int, b: int, s: int) -> dict[str, np.ndarray]:
    """Three documents per row (positions restart, segment ids), as the loader packs."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (b, s + 1)).astype(np.int32)
    seg = np.zeros((b, s), np.int32)
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    for r in range(b):
        for c in np.sort(rng.choice(np.arange(1, s), 2, replace=False)):
            seg[r, c:] += 1
            pos[r, c:] = np.arange(s - c)
    return {"tokens": tokens[:, :-1].copy(), "labels": tokens[:, 1:].copy(),
            "position_ids": pos, "segment_ids": seg,
            "loss_mask": np.ones((b, s), np.float32)}  # fmt: skip


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def variant_cells():
    """The part-monitor cells: stats steps computing one numerics part, loss nets taking
    one of the two logit statistics. Unused columns are zeros (constants), so the host side
    reads the same five columns for every arm."""
    import mindspore as ms
    from mindloom_train import TrainStep
    from mindloom_train._numerics import _logit_stats_cells
    from mindloom_train._step_maps import sum_all
    from mindspore import ops

    def zero():
        return ops.zeros((), ms.float32)

    # the same reductions as TrainStep._numerics (sum_all over each tensor's r x c view)
    class LocalNorms(TrainStep):
        def _numerics(self, loss, sq, inv, before):
            rows = ()
            for i in range(len(before)):
                r, c = self.views[i]
                rows = rows + (ops.stack((sq[i] * inv * inv,
                                          sum_all(before[i] * before[i], r, c),
                                          zero(), zero(), zero())),)  # fmt: skip
            return ops.stack(rows)

    class UpdateRatio(TrainStep):
        def _numerics(self, loss, sq, inv, before):
            rows = ()
            for i in range(len(before)):
                after = ops.depend(self.weights[i], loss)  # read after the update
                d = after - before[i]
                r, c = self.views[i]
                rows = rows + (ops.stack((zero(), sum_all(before[i] * before[i], r, c),
                                          sum_all(d * d, r, c), zero(), zero())),)  # fmt: skip
            return ops.stack(rows)

    class AdamMoments(TrainStep):
        def _numerics(self, loss, sq, inv, before):
            rows = ()
            for i in range(len(before)):
                m = ops.abs(ops.depend(self.exp_avg[i], loss))
                v = ops.sqrt(ops.depend(self.exp_avg_sq[i], loss))
                r, c = self.views[i]
                rows = rows + (ops.stack((zero(), zero(), zero(), sum_all(m, r, c) / (r * c),
                                          sum_all(v, r, c) / (r * c))),)  # fmt: skip
            return ops.stack(rows)

    base = _logit_stats_cells()[0]  # LossWithLogitStats

    class MaxLogitsOnly(base):
        def _frac_of(self, logits, loss_mask):
            return zero()

    class FractionOnly(base):
        def _max_logit(self, attn, h, cos, sin, mask):
            return zero()

    return {"local norms": LocalNorms, "update ratio": UpdateRatio,
            "AdamW moments": AdamMoments, "MaxLogits": MaxLogitsOnly,
            "top-logit fraction": FractionOnly}  # fmt: skip


def main(argv=None) -> int:
    args = parse(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("GLOG_v", "3")
    from mindloom_train import from_dict, hyper_vector
    from mindloom_train._build import build_model
    from mindloom_train._health import HealthMonitor
    from mindloom_train._metrics import MetricsWriter
    from mindloom_train._runner import CompiledRunner, StepInputs
    from mindloom_train._runtime import Runtime
    from mindloom_train._throughput import FlopsBudget, ThroughputWindow, metrics_record

    run_dir = Path(tempfile.mkdtemp(prefix="health_overhead_"))
    monitor = {"numerics": True, "max_logits": True, "progress_bar": False}
    if args.log_interval is not None:
        monitor["log_interval"] = args.log_interval
    cfg = from_dict({
        "model": {"preset": args.preset}, "tokenizer": {"path": str(run_dir / "unused")},
        "train_dataset": {"data_prefix": [str(run_dir / "unused")], "seq_length": args.seq},
        "training": {"train_iters": 10**6, "global_batch_size": args.batch,
                     "micro_batch_size": args.batch},
        # the part-monitor cells share the stats step's role name: no stored graphs
        "context": {"num_threads": args.threads, "compile_cache": "off"},
        "monitor": monitor, "run_dir": str(run_dir),
    })  # fmt: skip
    n = cfg.monitor.log_interval
    print(f"load average (1/5/15 min) at start: {load()} on {os.cpu_count()} CPUs; "
          f"{args.threads} threads; {args.preset} micro-batch {args.batch} x {args.seq}; "
          f"log interval {n}", flush=True)  # fmt: skip
    rt = Runtime(cfg)
    rt.setup_context()
    built = build_model(cfg, rt, built_vocab(args.preset), lambda m: print(m, flush=True))
    built.model.set_train(True)
    runner = CompiledRunner(built, cfg, rt, lambda m: print(m, flush=True))
    stats = runner.numerics
    stats.log_interval = 1  # the blocks decide which step is a log step
    plain_step = runner.train_step
    cells = variant_cells()
    # arm -> (stats step, MaxLogits buffer or None, numerics rows read, host fields on)
    arms = {"all on": (runner.stats_step, runner.logit_buffer, True, True)}
    weights, flags = plain_step.weights, plain_step.flags
    for name in ("local norms", "update ratio", "AdamW moments"):
        step = cells[name](built.loss_net, weights, flags, runner.accum, numerics=True,
                           share=plain_step)  # fmt: skip
        arms[name] = (step, None, True, False)
    for name in ("MaxLogits", "top-logit fraction"):
        net = cells[name](built.loss_net, cfg.monitor.output_logit_bound)
        step = type(plain_step)(net, weights, flags, runner.accum, share=plain_step)
        arms[name] = (step, net.stats, False, False)

    all_on = arms["all on"]  # the host arms read its stats
    if args.arms:
        keep = [a.strip() for a in args.arms.split(",")]
        unknown = [a for a in keep if a not in arms]
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; known: {list(arms)}")
        arms = {a: arms[a] for a in keep}
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    health = HealthMonitor(cfg.monitor.health)
    batch = packed_batch(built.mcfg.vocab_size, args.batch, args.seq)
    state = SimpleNamespace(loss_smoothed=None, consumed=0, skipped_total=0)
    flops = FlopsBudget(built.mcfg.flops_per_token(args.seq), 0.0)
    step_no = [0]
    no_comm = {"comm_s": 0.0, "comm_share": 0.0, "comm_s_ranks": [0.0],
               "comm_share_ranks": [0.0]}  # fmt: skip

    def batches():
        while True:
            yield batch

    def one_step(step: int):
        def hyper(**kw):
            return hyper_vector(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                adam_step=step, clip=1.0, spike=None, loss_scale=1.0, **kw)  # fmt: skip

        return runner.step(StepInputs(step, batches(), hyper, lambda: (False, False)))

    def record(res, window, *, numerics: bool, memory: bool, rules: bool) -> None:
        writer.numerics = stats if numerics else None
        writer.health = health if rules else None
        rec = metrics_record(window, step=step_no[0], loss=res.loss, lr=1e-4, gnorm=res.gnorm,
                             state=state, seq_length=args.seq, data_wait_s=0.0, flops=flops)  # fmt: skip
        rec.update(runner.comm_fields(window, True) if memory else no_comm)
        writer.write(rec)

    def block(arm: str | None) -> tuple[float, float]:
        """A log step under `arm` (None: all off) with its record, then one plain step:
        (block seconds, the plain step's seconds)."""
        if arm is None:
            runner.numerics = None
        else:
            step, buf, rows, host = arms[arm]
            runner.numerics, runner.stats_step, runner.logit_buffer = stats, step, buf
            cfg.monitor.numerics = rows
        window = ThroughputWindow(data_wait0=0.0)
        t0 = time.perf_counter()
        step_no[0] += 1
        res = one_step(step_no[0])
        window.add(args.batch * args.seq, time.perf_counter() - t0, res.comm_s, res.rank_step_s)
        on = arm is not None
        host = on and arms[arm][3]
        record(res, window, numerics=on, memory=host, rules=host)
        runner.numerics = None  # the next step is a plain one whatever the schedule says
        t1 = time.perf_counter()
        step_no[0] += 1
        one_step(step_no[0])
        t2 = time.perf_counter()
        state.consumed += 2 * args.batch
        return t2 - t0, t2 - t1

    diffs: dict[str, list[float]] = {a: [] for a in arms}
    on_s: dict[str, list[float]] = {a: [] for a in arms}
    off_s: dict[str, list[float]] = {a: [] for a in arms}
    plain: list[float] = []
    for r in range(args.rounds + 1):
        t = time.perf_counter()
        for i, arm in enumerate(arms):
            order = (arm, None) if (r + i) % 2 == 0 else (None, arm)
            got = {}
            for a in order:
                got[a], p = block(a)
                plain.append(p)
            if r > 0:  # round 0 compiles every graph
                diffs[arm].append(got[arm] - got[None])
                on_s[arm].append(got[arm])
                off_s[arm].append(got[None])
        if r == 0:
            del plain[:]
        what = "compiles every graph, not counted" if r == 0 else "timed"
        print(f"round {r} ({what}): {time.perf_counter() - t:.0f} s; load {load()}", flush=True)
        if r > 0:  # a run stopped early still leaves its rounds
            print("  arm - off, ms: " + ", ".join(f"{a} {diffs[a][-1] * 1e3:+.0f}" for a in arms)
                  + f"; plain step {statistics.median(plain) * 1e3:.0f} ms", flush=True)  # fmt: skip

    # the host arms, A/B on the stats of one stats step: the record with and without each
    runner.numerics, runner.stats_step, runner.logit_buffer = stats, *all_on[:2]
    cfg.monitor.numerics = True
    step_no[0] += 1
    res = one_step(step_no[0])
    host = {"per-rank memory": dict(memory=True), "health rules": dict(rules=True),
            "numerics and MaxLogits fields": dict(numerics=True)}  # fmt: skip
    host_t: dict[str, list[float]] = {k: [] for k in host}
    for i in range(args.host_rounds):
        for name, on in host.items():
            both = {}
            for arm_on in (True, False) if i % 2 == 0 else (False, True):
                kw = {"numerics": False, "memory": False, "rules": False}
                if arm_on:
                    kw.update(on)
                window = ThroughputWindow(data_wait0=0.0)
                window.add(args.batch * args.seq, 1.0, 0.0, 0.0)
                t = time.perf_counter()
                record(res, window, **kw)
                both[arm_on] = time.perf_counter() - t
            host_t[name].append(both[True] - both[False])
    writer.close()

    p = statistics.median(plain)
    print(f"\nplain step: {p * 1e3:.0f} ms (median of {len(plain)}); log interval {n}; "
          f"{args.rounds} timed rounds")  # fmt: skip
    print(f"{'monitor (alone)':30} {'block on':>9} {'block off':>9} {'on - off':>9} "
          f"{'overhead':>9}   per round")  # fmt: skip
    for arm in arms:
        d = statistics.median(diffs[arm])
        per = ", ".join(f"{x / (n * p):+.1%}" for x in diffs[arm])
        print(f"{arm:30} {statistics.median(on_s[arm]):8.2f}s {statistics.median(off_s[arm]):8.2f}s "
              f"{d * 1e3:+8.0f}ms {d / (n * p):+9.1%}   {per}")  # fmt: skip
    print(f"\nhost only, the log step's record with minus without, median of {args.host_rounds}:")
    for name, vals in host_t.items():
        d = statistics.median(vals)
        print(f"{name:30} {d * 1e3:+8.3f} ms  {d / (n * p):+9.3%} at interval {n}")
    print(f"load average at end: {load()}")
    return 0


def built_vocab(preset: str) -> int:
    from mindloom_model import get_preset

    return get_preset(preset).vocab_size


if __name__ == "__main__":
    sys.exit(main())
