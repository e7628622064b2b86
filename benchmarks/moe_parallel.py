"""Expert parallel (ep2) against plain data parallel (dp2) of the same DeepSeek-V3 model,
both through `mindloom launch --nproc 2` on this machine, in the same invocation.

    ./dev bench benchmarks/moe_parallel.py [--preset deepseek-v3-debug] [--steps 30]
                                          [--repeats 1] [--gbs 16] [--mbs 8]
                                          [--capacity CF]

Arms alternate (dp2, ep2, dp2, ep2, ...) on one prepared tokenizer and dataset (the bundled
corpus, a character tokenizer); each arm is a real launch (msrun, 2 CPU workers, the
compiled step) whose `metrics.jsonl` gives the step times (median over the steps after
the first 3, which compile), `comm_share` (the step's collectives run in a probe graph at
log steps) and, for ep2, `ep_exchange_share` (the expert exchange alone) and the tokens a
rank would send per step with a token-routed all-to-all. Printed: ms/step per arm, the
ratio ep2 / dp2, and the shares. The peer (dp2) holds every expert on both ranks and
averages all gradients; ep2 holds half the experts per rank and exchanges tokens.

What the CPU can show: the exchange's cost next to compute when two workers share the
cores. What it cannot: the speed-up of the expert matmuls split over devices (a dropless
static buffer holds the worst case, so each rank's expert matmuls are one process's
size), nor a native all-to-all (MCCL has none).

`--capacity CF` runs both arms with `model.moe_capacity_factor = CF` (the same tokens
dropped in both: each rank's own): dp2 runs the one-process capacity layout on each rank,
ep2 its E/2 experts on a fixed [E/2, 2 C, D] buffer instead of the dropless worst case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _prepare(root: Path) -> dict:
    from mindloom_train import from_dict, prepare_dataset, prepare_tokenizer

    cfg = from_dict({
        "tokenizer": {"train_input": "bundled", "model_type": "char", "vocab_size": None,
                      "special_tokens": False, "path": str(root / "tok")},
        "train_dataset": {"text_input": "bundled", "txt_mode": "file", "append_eos": False,
                          "char_range": [0.0, 0.9], "seq_length": 32},
        "run_dir": str(root),
    }, check_model=False)  # fmt: skip
    prepare_tokenizer(cfg, lambda m: None)
    train = prepare_dataset(cfg, cfg.train_dataset, "train", root / "tok", lambda m: None)
    return {"tokenizer": str(root / "tok"), "train": str(train[0])}


def _config(prep: dict, run: Path, args, ep: int) -> dict:
    return {
        "model": {"preset": args.preset, "vocab_size": None,
                  "moe_capacity_factor": args.capacity},
        "tokenizer": {"path": prep["tokenizer"]},
        "train_dataset": {"data_prefix": [prep["train"]], "seq_length": args.seq},
        "training": {"train_iters": args.steps, "global_batch_size": args.gbs,
                     "micro_batch_size": args.mbs},
        "lr_scheduler": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_iters": 2},
        "monitor": {"log_interval": 1, "progress_bar": False},
        "checkpoint": {"save_interval": 0, "save_at_end": False},
        "parallelism": {"dp": 2, "ep": ep},
        "seed": 7,
        "run_dir": str(run),
    }  # fmt: skip


def _arm(prep: dict, root: Path, args, ep: int, rep: int) -> dict:
    run = root / f"ep{ep}_{rep}"
    path = root / f"ep{ep}_{rep}.yaml"
    path.write_text(yaml.safe_dump(_config(prep, run, args, ep)))
    env = {**os.environ, "GLOG_v": "3"}
    proc = subprocess.run(
        [sys.executable, "-m", "mindloom_train", "launch", "--nproc", "2", str(path),
         "--timeout", "1200"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"ep{ep} launch failed: {proc.stderr[-2000:]}")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "event" not in r and r["step"] > 3]
    med = lambda key: statistics.median(r[key] for r in steps if r.get(key) is not None)  # noqa: E731
    out = {"ms_per_step": 1000 * med("step_time_s"), "comm_share": med("comm_share")}
    if ep > 1:
        out["exchange_share"] = med("ep_exchange_share")
        out["tokens_sent"] = med("ep_tokens_sent")
    out["dropped"] = med("moe_dropped_tokens")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="deepseek-v3-debug")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--capacity", type=float, default=None, help="moe_capacity_factor")
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prep = _prepare(root / "prep")
        arms: dict[int, list[dict]] = {1: [], 2: []}
        for rep in range(args.repeats):
            for ep in (1, 2):
                arms[ep].append(_arm(prep, root, args, ep, rep))
                print(f"  rep {rep} {'ep2' if ep > 1 else 'dp2'}: {arms[ep][-1]}", flush=True)
    dp2 = statistics.median(a["ms_per_step"] for a in arms[1])
    ep2 = statistics.median(a["ms_per_step"] for a in arms[2])
    print(f"{args.preset}, global batch {args.gbs} x {args.seq}, micro-batch {args.mbs}, "
          f"{args.steps} steps, 2 workers, capacity factor {args.capacity or 'none (dropless)'}")  # fmt: skip
    print(
        f"dp2: {dp2:.1f} ms/step, comm share {statistics.median(a['comm_share'] for a in arms[1]):.1%}"
    )
    print(f"ep2: {ep2:.1f} ms/step, comm share {statistics.median(a['comm_share'] for a in arms[2]):.1%}, "
          f"exchange share {statistics.median(a['exchange_share'] for a in arms[2]):.1%}, "
          f"tokens sent per rank and step {statistics.median(a['tokens_sent'] for a in arms[2]):.0f}")  # fmt: skip
    if args.capacity:
        print(f"dropped token-slots per step (median): dp2 {statistics.median(a['dropped'] for a in arms[1]):.0f}, "
              f"ep2 {statistics.median(a['dropped'] for a in arms[2]):.0f}")  # fmt: skip
    print(f"ratio ep2 / dp2 step time: {ep2 / dp2:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
