"""Checkpoint save and load per rank: every rank its own files (issue 16) vs the rank-0
gather it replaces, 2 msrun workers, the 17m preset, in the same run.

    ./dev bench benchmarks/checkpoint_io.py [--layout tp2|pp2] [--repeats 3]

Both workers build the 17m model under the layout (`ParallelEngine` + `ZeroAdamW`, as the
trainer's engine path does; AdamW moments allocated) and then time, interleaved
(gathered, distributed, gathered, ...), on the same state:

- save, gathered (the peer): `ZeroAdamW.gather_shards` (every rank's weights and moments
  all-gathered), rank 0 writes every file (`save_checkpoint`);
- save, distributed: each rank writes its own files (`write_rank_files`), barrier, rank 0
  merges the indexes and commits (`commit_rank_files`);
- load, gathered: every rank reads the whole checkpoint (`Checkpoint.load_tensors`) and
  cuts its part (`ParallelEngine.load_state`, `ZeroAdamW.load_moments`);
- load, distributed: each rank reads only its blocks (`Checkpoint.read_boxes`).

Per-rank time is from the arm's start to the rank's own end; "job" is the slowest rank
(ends with a barrier). Both arms write to the same disk and read through the same page
cache (a file just written is cached: the loads measure reads from memory, not a cold
disk). Bytes read per rank are counted by the reader.
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

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def worker(args) -> int:
    import mindspore as ms
    import numpy as np
    from mindloom_model import Llama, get_preset
    from mindloom_parallel import (
        ParallelConfig,
        ParallelEngine,
        ZeroAdamW,
        chunk_metadata,
        gather_rows,
        init_parallel,
    )
    from mindloom_train import _checkpoint as ck
    from mindloom_train import _ckpt_read
    from mindloom_train._ckpt_own import LayoutState

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    mcfg = get_preset(args.preset, vocab_size=8000)
    pcfg = ParallelConfig(**({"tp": 2} if args.layout == "tp2" else {"pp": 2}))
    groups = init_parallel(pcfg, mcfg)
    engine = ParallelEngine(Llama(mcfg), pcfg, groups, 1)
    opt = ZeroAdamW(engine.params, engine.param_names, groups, 0)
    world, rank = groups.world_size, groups.rank
    moments = [(opt.exp_avg[i], opt.exp_avg_sq[i]) for i in range(len(engine.params))]
    state = LayoutState(mcfg, pcfg, groups, engine.param_names, engine.params, moments)
    root = Path(args.result_dir)
    common = {"consumed_samples": 0}

    def barrier():
        gather_rows([1.0], groups.world)

    def name(kind, r):
        return ck.shard_name(kind, r, world)

    def save_gathered(path):
        shards = opt.gather_shards(mcfg, pcfg, name)
        if rank == 0:
            meta = ck.default_metadata({}, world)
            meta["tensors"], _ = chunk_metadata(mcfg, pcfg, name)
            ck.save_checkpoint(path, 1, shards, common, metadata=meta)

    def save_distributed(path):
        own = state.own_shards(zero=False)
        ck.write_rank_files(path, 1, own.files, own.tensors, rank, world)
        barrier()
        if rank == 0:
            ck.commit_rank_files(path, 1, world, ck.default_metadata({}, world), common)

    def load_gathered(path):
        full = ck.open_checkpoint(path).load_tensors()
        engine.load_state({n: full[n] for n in state.layout})
        opt.load_moments(full, mcfg, pcfg)

    def load_distributed(path):
        state.load(ck.open_checkpoint(path).read_boxes(state.boxes()))

    rows = {k: [] for k in ("save_gathered", "save_distributed", "load_gathered",
                            "load_distributed")}  # fmt: skip
    read = {}
    for rep in range(args.repeats):
        for arm in ("gathered", "distributed"):
            path = root / f"{arm}-{rep}"
            barrier()
            t0 = time.perf_counter()
            (save_gathered if arm == "gathered" else save_distributed)(path)
            mine = time.perf_counter() - t0
            barrier()
            rows[f"save_{arm}"].append((mine, time.perf_counter() - t0))
            barrier()
            _ckpt_read.reset_counters()
            t0 = time.perf_counter()
            (load_gathered if arm == "gathered" else load_distributed)(path)
            mine = time.perf_counter() - t0
            barrier()
            rows[f"load_{arm}"].append((mine, time.perf_counter() - t0))
            read[arm] = _ckpt_read.BYTES_READ["tensor"]
    out = {
        k: {
            "rank_s": statistics.median(a for a, _ in v),
            "job_s": statistics.median(b for _, b in v),
        }
        for k, v in rows.items()
    }
    out["bytes_read"] = read
    out["held_bytes"] = state.held_bytes()
    out["params"] = int(sum(np.prod(p.shape) for p in engine.params))
    (root / f"rank{rank}.json").write_text(json.dumps(out))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="17m")
    ap.add_argument("--layout", choices=["tp2", "pp2"], default="tp2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    if args.as_worker:
        return worker(args)
    from mindloom_parallel import launch

    with tempfile.TemporaryDirectory() as d:
        launch(
            [__file__, "--as-worker", "--result-dir", d, "--preset", args.preset,
             "--layout", args.layout, "--repeats", str(args.repeats)],
            nproc=2, log_dir=Path(d) / "logs", timeout_s=1800, cluster_timeout_s=120,
        )  # fmt: skip
        ranks = [json.loads(Path(d, f"rank{i}.json").read_text()) for i in (0, 1)]
    print(f"model {args.preset} (vocab 8000), layout {args.layout}, 2 msrun workers, CPU; "
          f"median of {args.repeats}, interleaved")  # fmt: skip
    print(f"{'':18}{'rank 0 s':>10}{'rank 1 s':>10}{'job s':>9}")
    for key in ("save_gathered", "save_distributed", "load_gathered", "load_distributed"):
        r0, r1 = ranks[0][key], ranks[1][key]
        job = max(r0["job_s"], r1["job_s"])
        print(f"{key:18}{r0['rank_s']:10.2f}{r1['rank_s']:10.2f}{job:9.2f}")
    for op in ("save", "load"):
        g = max(r[f"{op}_gathered"]["job_s"] for r in ranks)
        s = max(r[f"{op}_distributed"]["job_s"] for r in ranks)
        print(f"{op}: gathered / distributed job time = {g / s:.2f}x")
    for i, r in enumerate(ranks):
        print(f"rank {i}: read {r['bytes_read']['gathered'] / 2**20:.1f} MiB gathered, "
              f"{r['bytes_read']['distributed'] / 2**20:.1f} MiB distributed "
              f"(holds {r['held_bytes'] / 2**20:.1f} MiB)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
