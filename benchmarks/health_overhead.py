"""Training-health monitors on vs off: the trainer's step loop with `monitor.numerics`,
`monitor.max_logits` and the health rules all on, against all off, at the default log
interval, in one process.

    ./dev bench benchmarks/health_overhead.py [--preset 17m] [--batch 4] [--seq 256]
        [--pairs 5] [--threads 2] [--log-interval 10]

One `CompiledRunner` (the one `mindloom train` builds: the plain compiled step on every
step; at log steps the stats step instead: the same update also returning the per-tensor
numerics, its loss net also taking the MaxLogits from the step's own forward) over a 17m
model trains on the same packed batch. Blocks of `--log-interval` steps, each ending with its
log step (the step record built and written to a metrics.jsonl as the trainer does:
metrics_record, the per-rank fields, the numerics fields, the health rules), alternate
"on" and "off" (the runner's statistics and the writer's numerics and health detached:
what a run with the three switched off executes), in the order on/off, off/on, ... so
both see the same load; the first pair compiles and is not counted. The overhead is the
median over pairs of (on block / off block) - 1, and, from the same steps, (median log
step on - median log step off) / (N x median plain step): on a loaded machine the second
keeps the noise of the N - 1 identical steps out.

Then the breakdown on the same batch, round by round: the plain step and the stats step
(ms per call; for DeepSeek-V3 also its MaxLogits forward), and the host side of a log
step with the monitors (reading and reducing the statistics, the health rules) minus
without.
The machine is shared: read the load averages it prints with each pair.
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


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="17m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--pairs", type=int, default=5, help="timed on/off block pairs")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the per-graph breakdown")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-interval", type=int, default=None,
                   help="default: the config's (monitor.log_interval)")  # fmt: skip
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


def main(argv=None) -> int:
    args = parse(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("GLOG_v", "3")
    from mindloom_train import from_dict
    from mindloom_train._build import build_model
    from mindloom_train._health import HealthMonitor
    from mindloom_train._metrics import MetricsWriter
    from mindloom_train._runner import CompiledRunner, StepInputs, tensors
    from mindloom_train._runtime import Runtime
    from mindloom_train._step import hyper_vector
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
        "context": {"num_threads": args.threads}, "monitor": monitor, "run_dir": str(run_dir),
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
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    health = HealthMonitor(cfg.monitor.health)
    batch = packed_batch(built.mcfg.vocab_size, args.batch, args.seq)
    state = SimpleNamespace(loss_smoothed=None, consumed=0, skipped_total=0)
    flops = FlopsBudget(built.mcfg.flops_per_token(args.seq), 0.0)
    step_no = [0]

    def batches():
        while True:
            yield batch

    def one_step(step: int):
        def hyper(**kw):
            return hyper_vector(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                adam_step=step, clip=1.0, spike=None, loss_scale=1.0, **kw)  # fmt: skip

        return runner.step(StepInputs(step, batches(), hyper, lambda: (False, False)))

    def block(on: bool) -> float:
        """`n` steps, the last a log step with its record, as the trainer's loop runs them."""
        runner.numerics = stats if on else None
        writer.numerics = stats if on else None
        writer.health = health if on else None
        window = ThroughputWindow(data_wait0=0.0)
        t0 = time.perf_counter()
        for i in range(n):
            step_no[0] += 1
            step = step_no[0]
            t = time.perf_counter()
            res = one_step(step)
            step_s = time.perf_counter() - t
            window.add(args.batch * args.seq, step_s, res.comm_s, res.rank_step_s)
            if res.ok:
                window.add_loss(res.loss)
            state.consumed += args.batch
            if i < n - 1:
                plain_steps.append(step_s)  # the same plain step either way
        rec = metrics_record(window, step=step, loss=res.loss, lr=1e-4, gnorm=res.gnorm,
                             state=state, seq_length=args.seq, data_wait_s=0.0, flops=flops)  # fmt: skip
        rec.update(runner.extra_fields())
        rec.update(runner.comm_fields(window, True))
        writer.write(rec)
        (log_on if on else log_off).append(time.perf_counter() - t)  # the log step + record
        return time.perf_counter() - t0

    plain_steps: list[float] = []
    log_on: list[float] = []
    log_off: list[float] = []
    t = time.perf_counter()
    block(True)
    block(False)
    del plain_steps[:], log_on[:], log_off[:]
    print(f"first pair (compiles the plain and the stats step): "
          f"{time.perf_counter() - t:.0f} s; load {load()}", flush=True)  # fmt: skip
    on_s, off_s, ratios = [], [], []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {on: block(on) for on in order}
        on_s.append(got[True])
        off_s.append(got[False])
        ratios.append(got[True] / got[False] - 1)
        print(f"pair {i + 1}: on {got[True]:.2f} s, off {got[False]:.2f} s "
              f"({ratios[-1]:+.1%}); load {load()}", flush=True)  # fmt: skip

    # the breakdown: each graph on the same batch, round by round
    t5 = tensors(batch)
    hyper = hyper_vector(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                         adam_step=step_no[0] + 1, clip=1.0, spike=None, loss_scale=1.0)  # fmt: skip
    # the arguments exactly as the runner passes them (no dropout key: None), so every
    # call reuses the graph the blocks compiled
    graphs = {"plain step": lambda: runner.train_step(*t5, hyper, None)}
    if runner.stats_step is not None:  # numerics, and for Llama MaxLogits, in the step
        graphs["stats step"] = lambda: runner.stats_step(*t5, hyper, None)
    if runner.logit_stats is not None:  # DeepSeek-V3: MaxLogits in a forward of its own
        graphs["MaxLogits forward"] = lambda: runner.logit_stats(t5[0], t5[2], t5[3], t5[4],
                                                                 None)  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in graphs}
    last = {}
    for _ in range(args.rounds):
        for kind, call in graphs.items():
            t = time.perf_counter()
            last[kind] = call()
            last[kind][0].asnumpy()
            times[kind].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    host_on, host_off = [], []
    for _ in range(args.rounds):
        for on in (True, False):
            stats.rows = last["stats step"][-1] if "stats step" in last else None
            stats.logits = last.get("MaxLogits forward", runner.logit_buffer)
            writer.numerics = stats if on else None
            writer.health = health if on else None
            window = ThroughputWindow(data_wait0=0.0)
            window.add(args.batch * args.seq, 1.0, 0.0, 0.0)
            t = time.perf_counter()
            rec = metrics_record(window, step=step_no[0], loss=3.0, lr=1e-4, gnorm=1.0,
                                 state=state, seq_length=args.seq, data_wait_s=0.0, flops=flops)  # fmt: skip
            rec.update(runner.comm_fields(window, True))
            writer.write(rec)
            (host_on if on else host_off).append(time.perf_counter() - t)
    host = statistics.median(host_on) - statistics.median(host_off)
    writer.close()

    overhead = statistics.median(ratios)
    print(f"\nblocks of {n} steps (the last a log step), medians of {args.pairs} pairs: "
          f"on {statistics.median(on_s):.2f} s, off {statistics.median(off_s):.2f} s")  # fmt: skip
    print(f"per-pair overhead: {', '.join(f'{r:+.1%}' for r in ratios)}")
    print(f"overhead, all monitors on vs off at log interval {n}: {overhead:+.1%} "
          f"(median of the per-pair ratios)")  # fmt: skip
    # the same quantity from the steps themselves: only the log step differs between the
    # blocks, so (log step on - log step off) / (n x plain step), each a median, keeps
    # the other n - 1 steps' load noise out
    plain = statistics.median(plain_steps)
    per_step = (statistics.median(log_on) - statistics.median(log_off)) / (n * plain)
    print(f"log step with its record: on {statistics.median(log_on):.2f} s, off "
          f"{statistics.median(log_off):.2f} s; plain step {plain:.2f} s (median of "
          f"{len(plain_steps)}): overhead {per_step:+.1%} at log interval {n}")  # fmt: skip
    print(f"\nbreakdown, medians of {args.rounds} rounds on the same batch:")
    print(f"{'graph':20} {'ms/call':>9}  {'x plain':>7}")
    for kind in graphs:
        print(f"{kind:20} {med[kind] * 1e3:9.1f}  {med[kind] / med['plain step']:7.2f}")
    print(f"host side of a log step: {statistics.median(host_on) * 1e3:.2f} ms with the monitors, "
          f"{statistics.median(host_off) * 1e3:.2f} ms without ({host * 1e3:+.2f} ms)")  # fmt: skip
    extra = sum(med[k] for k in graphs if k != "plain step") - (
        med["plain step"] if "stats step" in med else 0.0
    )
    model = extra / (n * med["plain step"])
    print(f"expected from the breakdown: (stats step - plain [+ MaxLogits forward] + host) / "
          f"({n} x plain) = {(extra + host) / (n * med['plain step']):+.1%} "
          f"(graphs alone {model:+.1%})")  # fmt: skip
    print(f"load average at end: {load()}")
    return 0


def built_vocab(preset: str) -> int:
    from mindloom_model import get_preset

    return get_preset(preset).vocab_size


if __name__ == "__main__":
    sys.exit(main())
