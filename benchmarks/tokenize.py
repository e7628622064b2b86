"""`mindloom-data tokenize` vs a plain SentencePiece + megatron-core IndexedDatasetBuilder loop.

    ./dev bench benchmarks/tokenize.py [--repeat 4] [--rounds 3] [--vocab 4000]
        [--seq-lengths 256,512,1024]

Corpus: the bundled tiny Shakespeare, one JSON line per paragraph, repeated `--repeat`
times. Tokenizer: a SentencePiece BPE trained here on the same text. Each variant runs
in its own fresh process (so peak RSS is its own), rounds interleave A / B1 / B2, and the
medians are reported:

- A  (peer): one process, `json.loads` + `SentencePieceProcessor.encode` + EOS +
  megatron-core `IndexedDatasetBuilder.add_document`, as in Megatron's
  `tools/preprocess_data.py` with one worker;
- B1 / B2: `mindloom_data.tokenize(..., workers=1 | 2)`: one or two encoding threads
  sharing one SentencePiece model (it releases the GIL) while the main thread reads
  the JSONL (orjson) and writes.

Per core is MB of text per CPU-second (user + system, all threads and child processes),
which does not depend on how busy the shared machine is; the two-worker target is wall
clock against A's wall clock, measured in the same round.

Time is measured inside each process around the work only (imports excluded: importing
megatron-core alone takes ~15 s here). The outputs of A, B1 and B2 are checked to be
byte-identical. Then the padding ratio of best-fit packing on the bundled corpus.
"""

from __future__ import annotations

import os
import sys

# This file is called tokenize.py: keep its folder off sys.path so that the standard
# library's `tokenize` (used by linecache, hence by torch) is not shadowed.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(var, "1")


def run_peer(corpus: str, tok_dir: str, out: str, cpu) -> dict:
    import sentencepiece as spm
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    sp = spm.SentencePieceProcessor(model_file=os.path.join(tok_dir, "tokenizer.model"))
    eos = sp.eos_id()
    dtype = DType.optimal_dtype(sp.get_piece_size())
    c0, t0 = cpu(), time.perf_counter()
    builder = IndexedDatasetBuilder(out + ".bin", dtype=dtype)
    nbytes = 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            nbytes += len(text.encode("utf-8"))
            ids = sp.encode(text, out_type=int)
            ids.append(eos)
            builder.add_document(ids, [len(ids)])  # a list, as preprocess_data.py passes it
    builder.finalize(out + ".idx")
    return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "cpu_seconds": cpu() - c0}


def run_mindloom(corpus: str, tok_dir: str, out: str, workers: int, cpu) -> dict:
    from mindloom_data import tokenize

    c0, t0 = cpu(), time.perf_counter()
    stats = tokenize(corpus, tok_dir, out, workers=workers, force=True)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": stats.text_bytes, "cpu_seconds": cpu() - c0}


def child(argv) -> int:
    import resource

    kind, corpus, tok_dir, out = argv[:4]

    def cpu() -> float:
        a = resource.getrusage(resource.RUSAGE_SELF)
        b = resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    if kind == "A":
        res = run_peer(corpus, tok_dir, out, cpu)
    else:
        res = run_mindloom(corpus, tok_dir, out, int(kind[1:]), cpu)
    # VmHWM: ru_maxrss would keep the parent's RSS across fork + exec
    with open("/proc/self/status") as f:
        self_kb = int([x for x in f if x.startswith("VmHWM")][0].split()[1])
    kids_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    res["peak_rss_mb"] = self_kb / 1024
    res["peak_rss_worker_mb"] = kids_kb / 1024
    print("RESULT " + json.dumps(res))
    return 0


def spawn(kind: str, corpus: str, tok_dir: str, out: str) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, corpus, tok_dir, out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--child":
        return child(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=4, help="copies of the corpus (1.1 MB each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--seq-lengths", default="256,512,1024")
    args = p.parse_args(argv)

    from mindloom_data import IndexedDataset, PackedDataset, bundled_corpus, tokenize
    from mindloom_tokenizer import train_tokenizer

    work = tempfile.mkdtemp(prefix="bench-tokenize-")
    tok_dir = os.path.join(work, "tok")
    train_tokenizer([str(bundled_corpus())], tok_dir, vocab_size=args.vocab, model_type="bpe")
    paragraphs = [x for x in bundled_corpus().read_text().split("\n\n") if x.strip()]
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(args.repeat):
            for para in paragraphs:
                f.write(json.dumps({"text": para}) + "\n")
    size_mb = os.path.getsize(corpus) / 1e6
    print(
        f"corpus {size_mb:.1f} MB ({len(paragraphs) * args.repeat} documents), vocab {args.vocab}"
    )
    print(f"machine: {os.cpu_count()} CPUs (shared), load {os.getloadavg()[0]:.1f}")

    results: dict[str, list[dict]] = {"A": [], "B1": [], "B2": []}
    outs = {k: os.path.join(work, k) for k in results}
    spawn("B1", corpus, tok_dir, outs["B1"])  # warm-up: page cache, tokenizer load
    for r in range(args.rounds):
        for kind in ("A", "B1", "B2"):
            res = spawn(kind, corpus, tok_dir, outs[kind])
            results[kind].append(res)
            print(
                f"  round {r}: {kind:2s} {res['seconds']:.2f} s "
                f"({res['bytes'] / 1e6 / res['seconds']:.2f} MB/s), "
                f"CPU {res['cpu_seconds']:.2f} s ({res['bytes'] / 1e6 / res['cpu_seconds']:.2f} "
                "MB per CPU-second), "
                f"peak RSS {res['peak_rss_mb']:.0f} MB"
            )
    same = all(
        open(outs["A"] + ext, "rb").read() == open(outs[k] + ext, "rb").read()
        for k in ("B1", "B2")
        for ext in (".bin", ".idx")
    )
    med = {k: statistics.median(x["seconds"] for x in v) for k, v in results.items()}
    nbytes = results["A"][0]["bytes"]
    mbps = {k: nbytes / 1e6 / s for k, s in med.items()}
    cpu = {k: statistics.median(x["cpu_seconds"] for x in v) for k, v in results.items()}
    per_cpu = {k: nbytes / 1e6 / c for k, c in cpu.items()}
    rss = {k: max(x["peak_rss_mb"] for x in v) for k, v in results.items()}
    wrss = max(x["peak_rss_worker_mb"] for x in results["B2"])
    print()
    print(f"outputs byte-identical (A == B1 == B2): {same}")
    print(
        f"A  plain loop (sentencepiece + megatron-core builder): {mbps['A']:.2f} MB/s, "
        f"peak RSS {rss['A']:.0f} MB (includes torch + megatron-core imports)"
    )
    workers_rss = f" + {wrss:.0f} MB per worker process" if wrss else " (one process)"
    print(
        f"B1 mindloom-data tokenize --workers 1: {mbps['B1']:.2f} MB/s, "
        f"{per_cpu['B1']:.2f} MB per CPU-second (target >= 5), peak RSS {rss['B1']:.0f} MB"
    )
    print(
        f"B2 mindloom-data tokenize --workers 2: {mbps['B2']:.2f} MB/s, "
        f"{per_cpu['B2']:.2f} MB per CPU-second, peak RSS {rss['B2']:.0f} MB{workers_rss}"
    )
    print(
        f"wall ratio B1 / A = {mbps['B1'] / mbps['A']:.2f}x, "
        f"B2 / A = {mbps['B2'] / mbps['A']:.2f}x (target >= 1.8x); B2 / A per round: "
        + ", ".join(
            f"{a['seconds'] / b['seconds']:.2f}x" for a, b in zip(results["A"], results["B2"])
        )
    )
    print(
        "MB per CPU-second (load-independent per-core throughput): "
        + ", ".join(f"{k} {v:.2f}" for k, v in per_cpu.items())
    )

    # best-fit padding on the bundled corpus, one document per paragraph
    prefix = os.path.join(work, "shakespeare")
    tokenize(str(bundled_corpus()), tok_dir, prefix)
    ds = IndexedDataset(prefix)
    print(
        f"\nbest-fit packing of the bundled corpus ({ds.num_documents} documents, "
        f"{ds.num_tokens} tokens):"
    )
    for seq in [int(s) for s in args.seq_lengths.split(",")]:
        for mode in ("best_fit", "concat"):
            st = PackedDataset(ds, seq, mode=mode, cache_dir=None).stats()
            print(
                f"  seq {seq:5d} {mode:8s}: padding {100 * st['padding_ratio']:.2f}%, "
                f"documents split {100 * st['documents_split_frac']:.1f}%, "
                f"tokens/sample {st['tokens_per_sample']:.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
