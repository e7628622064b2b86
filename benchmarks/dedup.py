"""MinHash near-duplicate removal: mindloom vs datatrove vs a naive datasketch loop.

    ./dev bench benchmarks/dedup.py [--docs 50000] [--rounds 2] [--no-datatrove]
        [--methods mindloom,naive,datatrove] [--no-verify] [--skip-clean | --only-clean]
        [--probe-bands 7,28]

One corpus, generated plus real: the paragraphs of tiny Shakespeare (bundled with
mindloom-data) and synthetic documents drawn from Shakespeare's word stream, with planted
near-duplicates (a copy of a document with 1-15% of its words replaced, so their Jaccard
similarity spreads around the LSH threshold) and some exact copies. Every method uses the
same shingles (word 5-grams of the lowercased text split on whitespace), 112 permutations
in 14 bands of 8, keep-first, one process:

- mindloom: `mindloom_data.clean` with only MinHash dedup on (reads JSONL, writes Parquet),
  default config (14 bands of 8 plus its probe bands, which regroup the same 112 values);
  and again as `mindloom (probe_bands=0)`, the 14 bands of 8 alone (`--probe-bands` adds
  rows for other counts);
- datatrove: its four-stage MinHash pipeline (signature, buckets, cluster, filter; JSONL in
  and out), word tokenizer replaced by a whitespace split and punctuation kept so the
  shingles match (its NLTK tokenizer needs a download, too);
- naive: datasketch `MinHash.update_batch` over sha1-hashed shingles plus `MinHashLSH`,
  query-then-insert per document.

Rounds run the methods interleaved; the median is reported. Throughput is docs per CPU
second of the process (= per core; the runs are single-process) and docs per wall second.
Quality, the same definitions and the same exact shingle sets for every method:
precision is the share of all its (removed, kept) pairs whose exact Jaccard similarity is
at least 0.7; recall the share of all planted pairs with exact J >= 0.7 of which either
document was removed. For reference, the expected recall of plain 14x8 LSH on those
pairs (its S-curve, without transitive finds) is printed too, and how many of them share
a band under mindloom's own signatures, primary bands alone and with the probe bands.

Last, cleaning alone (normalize + every default filter, no dedup) in MB/s per core.
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

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

TAU = 0.7


def shingles(text: str) -> set:
    w = text.lower().split()
    if len(w) < 5:
        return {" ".join(w)} if w else set()
    return {" ".join(w[i : i + 5]) for i in range(len(w) - 4)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / max(1, len(a | b))


def build_corpus(root: Path, n_docs: int, seed: int = 0):
    from mindloom_data import bundled_corpus

    rng = random.Random(seed)
    text = bundled_corpus().read_text(encoding="utf-8")
    real = [p.strip() for p in text.split("\n\n") if len(p.split()) >= 20]
    stream = text.split()
    docs = list(real)
    planted = []  # (index of original, index of copy)
    while len(docs) < n_docs:
        r = rng.random()
        if r < 0.10 and len(docs) > 100:
            i = rng.randrange(len(docs))
            w = docs[i].split(" ")
            for _ in range(max(1, int(len(w) * rng.uniform(0.01, 0.15)))):
                w[rng.randrange(len(w))] = rng.choice(stream)
            planted.append((i, len(docs)))
            docs.append(" ".join(w))
        elif r < 0.12 and len(docs) > 100:
            i = rng.randrange(len(docs))
            planted.append((i, len(docs)))
            docs.append(docs[i])
        else:
            n = rng.randint(50, 400)
            words = [rng.choice(stream) for _ in range(n)]
            docs.append(" ".join(words))
    order = list(range(len(docs)))
    rng.shuffle(order)
    pos = {d: k for k, d in enumerate(order)}
    docs = [docs[d] for d in order]
    planted = [(pos[a], pos[b]) for a, b in planted]
    root.mkdir(parents=True, exist_ok=True)
    files = 4
    per = (len(docs) + files - 1) // files
    where = {}  # (file name, 1-based line) -> doc index
    for f in range(files):
        name = f"part-{f}.jsonl"
        with open(root / name, "w", encoding="utf-8") as fh:
            for j, k in enumerate(range(f * per, min(len(docs), (f + 1) * per)), 1):
                fh.write(json.dumps({"id": str(k), "text": docs[k]}) + "\n")
                where[(name, j)] = k
    return docs, planted, where, len(real)


THRESHOLD = 0.7
VERIFY = True


def run_mindloom(corpus: Path, out: Path, where, probe_bands=None) -> list[tuple[int, int]]:
    from mindloom_data import clean

    minhash = {"threshold": THRESHOLD, "verify": VERIFY}
    if probe_bands is not None:  # else the config default
        minhash["probe_bands"] = probe_bands
    cfg = {
        "normalize": {"enabled": False},
        "filters": {
            k: False for k in ("length", "repeated_chars", "garbled", "symbols", "repetition")
        },
        "dedup": {
            "exact": False,
            "paragraph": False,
            "minhash": minhash,
        },
        "output": {"removed": True},
    }
    clean(corpus, out, config=cfg, workers=1, progress=False)
    pairs = []
    for f in sorted((out / "removed/minhash_dedup").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            src, kept_line = r["duplicate_of"].rsplit(":", 1)
            pairs.append(
                (
                    where[(Path(r["source"]).name, r["line"])],
                    where[(Path(src).name, int(kept_line))],
                )
            )
    return pairs


def run_naive(corpus: Path, out: Path, where) -> list[tuple[int, int]]:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(num_perm=112, params=(14, 8))
    pairs = []
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kept.jsonl", "w", encoding="utf-8") as fo:
        for f in sorted(corpus.glob("*.jsonl")):
            with open(f, encoding="utf-8") as fh:
                for line in fh:
                    rec = json.loads(line)
                    m = MinHash(num_perm=112, seed=1)
                    m.update_batch([s.encode("utf-8") for s in shingles(rec["text"])])
                    cands = lsh.query(m)
                    if cands:
                        pairs.append((int(rec["id"]), min(int(c) for c in cands)))
                    else:
                        lsh.insert(rec["id"], m)
                        fo.write(line)
    return pairs


def run_datatrove(corpus: Path, out: Path, where) -> list[tuple[int, int]]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.text import TextNormConfig
    from loguru import logger

    logger.remove()
    cfg = MinhashConfig(
        n_grams=5,
        num_buckets=14,
        hashes_per_bucket=8,
        hash_config=HashConfig(precision=32, hash_fc="sha1"),
        norm_config=TextNormConfig(
            lowercase=True,
            norm_whitespace=False,
            remove_punctuation=False,
            norm_unicode_diacritics=False,
            norm_numbers=False,
        ),
    )

    class _Split:
        def word_tokenize(self, text):
            return text.split()

    from datatrove.utils import word_tokenizers
    from datatrove.utils.typeshelper import Languages

    # its English tokenizer is NLTK's, which needs a download; whitespace split = our shingles
    word_tokenizers.WORD_TOKENIZER_CACHE[Languages.english] = _Split()
    sig = MinhashDedupSignature(output_folder=str(out / "sigs"), config=cfg)
    logs = str(out / "logs")

    def ex(pipeline, name, tasks=1):
        # Each task adds a loguru sink on the sys.stderr of the moment; its per-stage stats
        # tables would bury the results. They still go to the log files under `logs`.
        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
            LocalPipelineExecutor(
                pipeline=pipeline,
                tasks=tasks,
                workers=1,
                logging_dir=f"{logs}/{name}",
                skip_completed=False,
            ).run()

    ex([JsonlReader(str(corpus)), sig], "sig")
    ex([MinhashDedupBuckets(str(out / "sigs"), str(out / "buckets"), config=cfg)], "buckets", 14)
    ex(
        [
            MinhashDedupCluster(
                str(out / "buckets"), str(out / "remove_ids"), config=cfg, save_cluster_id=True
            )
        ],
        "cluster",
    )
    ex(
        [
            JsonlReader(str(corpus)),
            MinhashDedupFilter(
                str(out / "remove_ids"),
                exclusion_writer=JsonlWriter(str(out / "removed"), compression=None),
                load_cluster_ids=True,
            ),
            JsonlWriter(str(out / "kept"), compression=None),
        ],
        "filter",
    )
    cluster_kept = {}
    for f in (out / "kept").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            cid = r.get("metadata", {}).get("minhash_cluster")
            if cid is not None:
                cluster_kept[cid] = int(r["id"])
    pairs = []
    for f in (out / "removed").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            cid = r.get("metadata", {}).get("minhash_cluster")
            pairs.append((int(r["id"]), cluster_kept.get(cid, -1)))
    return pairs


class Truth:
    """Exact shingle sets (cached) and the planted pairs that are true near-duplicates."""

    def __init__(self, docs, planted):
        self.docs = docs
        self._sh = {}
        self.true = [(a, b) for a, b in planted if self.jaccard(a, b) >= TAU]

    def jaccard(self, a: int, b: int) -> float:
        for i in (a, b):
            if i not in self._sh:
                self._sh[i] = shingles(self.docs[i])
        return jaccard(self._sh[a], self._sh[b])

    def lsh_bound(self, bands=14, rows=8) -> float:
        """Expected recall of plain bands x rows LSH on the true pairs, no transitivity."""
        p = [1 - (1 - self.jaccard(a, b) ** rows) ** bands for a, b in self.true]
        return sum(p) / len(p) if p else float("nan")


def quality(pairs, truth: Truth):
    """Precision over every (removed, kept) pair of the method; recall over every true pair.

    Both use the same exact shingle sets and the same true pairs for every method.
    """
    good = sum(1 for a, b in pairs if b >= 0 and truth.jaccard(a, b) >= TAU)
    precision = good / len(pairs) if pairs else float("nan")
    removed = {a for a, _ in pairs}
    found = sum(1 for a, b in truth.true if a in removed or b in removed)
    return precision, found / len(truth.true) if truth.true else float("nan")


def timed(fn, *args):
    c0, w0 = time.process_time(), time.perf_counter()
    result = fn(*args)
    return result, time.process_time() - c0, time.perf_counter() - w0


def run_clean_only(corpus: Path, out: Path):
    from mindloom_data import clean

    cfg = {"dedup": {"exact": False, "minhash": False, "paragraph": False}}
    report = clean(corpus, out, config=cfg, workers=1, progress=False)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-datatrove", action="store_true")
    ap.add_argument("--workdir", default="/tmp/mindloom-bench-dedup")
    ap.add_argument("--threshold", type=float, default=0.7, help="mindloom's signature check")
    ap.add_argument(
        "--no-verify", action="store_true", help="mindloom without the exact check (estimate only)"
    )
    ap.add_argument("--methods", default="mindloom,naive,datatrove", help="comma-separated")
    ap.add_argument(
        "--probe-bands", default="", help="extra mindloom rows with these probe_bands, e.g. 7,28"
    )
    ap.add_argument("--skip-clean", action="store_true")
    ap.add_argument("--only-clean", action="store_true", help="just the cleaning figures")
    args = ap.parse_args(argv)
    global THRESHOLD
    THRESHOLD = args.threshold
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    docs, planted, where, n_real = build_corpus(work / "corpus", args.docs)
    size = sum(p.stat().st_size for p in (work / "corpus").glob("*.jsonl"))
    print(
        f"corpus: {len(docs)} docs ({n_real} real Shakespeare paragraphs), {size / 1e6:.1f} MB, "
        f"{len(planted)} planted duplicates; os.cpu_count()={os.cpu_count()}, single process"
    )
    global VERIFY
    VERIFY = not args.no_verify
    wanted = set(args.methods.split(","))
    methods = {
        "mindloom": run_mindloom,
        "mindloom (probe_bands=0)": functools.partial(run_mindloom, probe_bands=0),
        **{
            f"mindloom (probe_bands={k})": functools.partial(run_mindloom, probe_bands=int(k))
            for k in args.probe_bands.split(",")
            if k
        },
        "naive datasketch": run_naive,
    }
    if not args.no_datatrove:
        methods["datatrove"] = run_datatrove
    methods = {k: v for k, v in methods.items() if k.split()[0] in wanted}
    if args.only_clean:
        methods = {}
    cpu = {m: [] for m in methods}
    wall = {m: [] for m in methods}
    pairs = {}
    # warm-up (imports, numpy buffers), not timed
    if methods:
        run_mindloom(work / "corpus", work / "warm", where)
    for r in range(args.rounds):
        for name, fn in methods.items():
            out = work / f"out-{name.replace(' ', '_')}-{r}"
            res, c, w = timed(fn, work / "corpus", out, where)
            pairs[name] = res
            cpu[name].append(c)
            wall[name].append(w)
            print(
                f"  round {r + 1} {name:<24} cpu {c:7.2f}s wall {w:7.2f}s removed {len(res)}",
                flush=True,
            )
            shutil.rmtree(out, ignore_errors=True)
    truth = Truth(docs, planted)
    if methods:
        print(
            f"\n{len(truth.true)} planted pairs have exact Jaccard >= {TAU}; plain 14x8 LSH "
            f"finds each with its S-curve probability, {truth.lsh_bound():.3f} of them on average"
        )
    if methods:
        print(f"\n{'method':<24} {'docs/cpu-s':>11} {'docs/wall-s':>12} {'removed':>8} "
              f"{'precision':>10} {'recall':>8}")  # fmt: skip
    rate = {}
    for name in methods:
        c = statistics.median(cpu[name])
        w = statistics.median(wall[name])
        rate[name] = len(docs) / c
        p, rc = quality(pairs[name], truth)
        print(
            f"{name:<24} {len(docs) / c:>11.0f} {len(docs) / w:>12.0f} {len(pairs[name]):>8} "
            f"{p:>10.3f} {rc:>8.3f}"
        )
    ours = [m for m in rate if m.startswith("mindloom")]
    for m in ours:
        for name in methods:
            if not name.startswith("mindloom"):
                print(f"{m} / {name}: {rate[m] / rate[name]:.1f}x docs per cpu-second")
    if ours:
        # Where mindloom's misses come from: a true pair that shares no band with
        # mindloom's own signatures is beyond any verification of candidates.
        from mindloom_data import CLEAN_DEFAULTS as DEFAULTS
        from mindloom_data import MinHasher

        probes = DEFAULTS["dedup"]["minhash"]["probe_bands"]
        ta = [a for a, _ in truth.true]
        tb = [b for _, b in truth.true]
        sig = MinHasher().signatures([docs[i] for i in ta + tb])

        def shares_band(k):
            bands = MinHasher(probe_bands=k).band_hashes(sig)
            return (bands[: len(ta)] == bands[len(ta) :]).any(axis=1)

        print(
            f"true pairs sharing a band under mindloom's signatures: {shares_band(0).mean():.3f} "
            f"in the 14 primary bands, {shares_band(probes).mean():.3f} with the {probes} "
            f"probe bands of the default config"
        )
        for m in ours:
            k = int(m.split("=")[1].rstrip(")")) if "=" in m else probes
            removed = {a for a, _ in pairs[m]}
            missed = [
                i for i, (a, b) in enumerate(truth.true) if a not in removed and b not in removed
            ]
            print(
                f"{m} missed {len(missed)} of {len(truth.true)} true pairs; "
                f"{int(shares_band(k)[missed].sum())} of those share one of its bands "
                f"(the rest none of its candidates can find)"
            )

    if args.skip_clean:
        return 0
    # The corpus above has short documents (~1.2 KB of JSON per line), where per-document
    # overhead dominates; the same text joined six at a time (~7 KB) shows the per-byte rate.
    big = work / "corpus-5k"
    big.mkdir()
    with open(big / "joined.jsonl", "w", encoding="utf-8") as fh:
        for i in range(0, len(docs), 6):
            fh.write(json.dumps({"text": "\n\n".join(docs[i : i + 6])}) + "\n")
    for label, corpus in (("short docs", work / "corpus"), ("joined docs", big)):
        c_times, w_times = [], []
        for r in range(args.rounds):
            out = work / f"clean-{r}"
            report, c, w = timed(run_clean_only, corpus, out)
            c_times.append(c)
            w_times.append(w)
            shutil.rmtree(out, ignore_errors=True)
        mb = report["read"]["bytes"] / 1e6
        n = report["read"]["documents"]
        print(
            f"cleaning only, {label} (normalize + every default filter, JSONL -> Parquet): "
            f"{mb:.1f} MB in {n} docs of {mb * 1e3 / max(1, n):.1f} KB on average, "
            f"{mb / statistics.median(c_times):.1f} MB per cpu-second, "
            f"{mb / statistics.median(w_times):.1f} MB per wall-second; "
            f"kept {report['output']['documents']} of {report['read']['documents']} docs"
        )
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
