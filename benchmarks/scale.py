"""Clean + dedup at scale: the local executor (1 and 2 workers) vs Ray (2 CPUs).

    ./dev hatch run data:python benchmarks/scale.py [--docs 100000] [--files 16] [--rounds 1]

One seeded corpus of `--docs` JSON Lines documents in `--files` files (synthetic text,
about 5% exact and 7% near duplicates, some too short), run through the full default
`mindloom_data.clean` pipeline (normalize, every default filter, exact, MinHash and
paragraph dedup) by three executors, interleaved per round, each into a fresh output:

- local-1: `LocalExecutor(workers=1)`, ranks in this process (the reference);
- local-2: `LocalExecutor(workers=2)`, a pool of 2 forked processes;
- ray-2:   `RayExecutor` on a local Ray instance with 2 CPUs, one task per rank.

The Ray instance is started once before timing (its start-up is printed separately) and
warmed up with a small run, as a long-lived cluster would be. Printed: docs/s (documents
read / wall seconds, medians over rounds) and Ray's overhead over local-2 at equal CPUs
(target: under 25%). The three outputs must give the same report counts.
"""

from __future__ import annotations

import os
import sys

# benchmarks/tokenize.py would shadow the standard library's tokenize module
sys.path[:] = [
    p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))
]

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def build_corpus(root: Path, docs: int, files: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(20000)
    ]
    root.mkdir(parents=True, exist_ok=True)
    seen: list[str] = []
    per_file = -(-docs // files)
    made = 0
    for f in range(files):
        with open(root / f"part{f:03d}.jsonl", "w", encoding="utf-8") as out:
            for _ in range(min(per_file, docs - made)):
                r = rng.random()
                if seen and r < 0.05:
                    text = rng.choice(seen)
                elif seen and r < 0.12:
                    w = rng.choice(seen).split(" ")
                    w[rng.randrange(len(w))] = "changed"
                    text = " ".join(w)
                elif r < 0.14:
                    text = "too short"
                else:
                    n = rng.randint(40, 160)
                    words = [rng.choice(vocab) for _ in range(n)]
                    sents = [
                        " ".join(words[i : i + 12]).capitalize() + "." for i in range(0, n, 12)
                    ]
                    half = len(sents) // 2
                    text = " ".join(sents[:half]) + "\n\n" + " ".join(sents[half:])
                if len(seen) < 20000:
                    seen.append(text)
                else:
                    seen[rng.randrange(len(seen))] = text
                out.write(json.dumps({"text": text}) + "\n")
                made += 1
    return root


def counts(report: dict) -> dict:
    return {k: report[k] for k in ("steps", "output")} | {"read": report["read"]["documents"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args(argv)

    from mindloom_data import LocalExecutor, RayExecutor, clean

    tmp = Path(tempfile.mkdtemp(prefix="mindloom-scale-"))
    try:
        t = time.perf_counter()
        src = build_corpus(tmp / "in", args.docs, args.files)
        mb = sum(p.stat().st_size for p in src.iterdir()) / 1e6
        print(
            f"corpus: {args.docs} docs, {args.files} files, {mb:.1f} MB "
            f"(built in {time.perf_counter() - t:.1f} s); load {os.getloadavg()[0]:.1f}"
        )
        executors = {"local-1": LocalExecutor(1), "local-2": LocalExecutor(2)}
        if not args.no_ray:
            t = time.perf_counter()
            ray_ex = RayExecutor(num_cpus=2)
            ray_ex._connect()
            small = build_corpus(tmp / "warm", 2000, 4, seed=1)
            clean(small, tmp / "warm-out", executor=ray_ex, progress=False)
            print(
                f"ray: local instance with 2 CPUs started and warmed up in "
                f"{time.perf_counter() - t:.1f} s (not timed below)"
            )
            executors["ray-2"] = ray_ex
        times: dict[str, list[float]] = {k: [] for k in executors}
        ref = None
        for rnd in range(args.rounds):
            for name, ex in executors.items():
                out = tmp / f"out-{name}-{rnd}"
                t = time.perf_counter()
                report = clean(src, out, executor=ex, progress=False)
                dt = time.perf_counter() - t
                times[name].append(dt)
                c = counts(report)
                if ref is None:
                    ref = c
                elif c != ref:
                    print(f"error: {name} gave other counts than local-1", file=sys.stderr)
                    return 1
                print(
                    f"round {rnd + 1} {name:8s} {dt:8.1f} s  {report['read']['documents'] / dt:8.0f} docs/s"
                    f"  (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
                shutil.rmtree(out)
        for ex in executors.values():
            ex.close()
        docs = ref["read"]
        kept = ref["output"]["documents"]
        print(f"\n{docs} documents read, {kept} kept (identical counts from every executor)")
        print(f"{'executor':10s} {'median s':>9s} {'docs/s':>9s}")
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"{k:10s} {v:9.1f} {docs / v:9.0f}")
        print(f"local-2 speed-up over local-1: {med['local-1'] / med['local-2']:.2f}x")
        if "ray-2" in med:
            over = med["ray-2"] / med["local-2"] - 1
            print(f"ray-2 overhead over local-2 (equal CPUs): {100 * over:+.1f}% (target < 25%)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
