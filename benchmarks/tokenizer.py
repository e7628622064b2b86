"""mindloom-tokenizer (SentencePiece BPE) vs Hugging Face `tokenizers` BPE.

    ./dev bench benchmarks/tokenizer.py [--mb 20] [--vocab-size 32000] [--threads 2]
        [--encode-mb 4] [--repeats 3] [--workdir DIR]

1. Builds a deterministic corpus of about `--mb` MB: the bundled tiny Shakespeare, then
   synthetic English (words drawn by Shakespeare's word frequencies), numbers and
   synthetic Chinese, as text lines.
2. Training: `train_tokenizer(..., model_type="bpe")` (Llama-style defaults) and a
   Hugging Face byte-level BPE (`BpeTrainer`, GPT-2/Llama-3 style pre-tokenizer, digits
   split) with the same vocabulary size, each in its own child process, run in turns
   with the same thread count; wall time and peak RSS (`wait4` ru_maxrss) of each child.
3. Encoding: the same `--encode-mb` MB of documents, one thread each (per core):
   `Tokenizer.encode_batch(docs, num_threads=1)` and the HF tokenizer's `encode_batch`
   with RAYON_NUM_THREADS=1, both returning lists of ids; also HF running mindloom's own
   exported `tokenizer.json`. Interleaved A/B, warm-up first, medians of `--repeats`.
   Then both at `--threads` threads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "packages/data/src/mindloom_data/corpora/tinyshakespeare.txt"
HANZI = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自之着去过家学"
    "对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头"
    "面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向"
    "情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信"
)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=20.0, help="corpus size in MB")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--encode-mb", type=float, default=4.0, help="text encoded per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", help="keep the corpus and tokenizers here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- corpus


def make_corpus(path: Path, mb: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    shakespeare = SHAKESPEARE.read_text(encoding="utf-8")
    words = shakespeare.split()
    freq = Counter(w.strip(".,;:!?'\"-").lower() for w in words)
    vocab = [w for w, _ in freq.most_common(8000) if w]
    cum = list(itertools.accumulate(freq[w] for w in vocab))
    target = int(mb * 1e6)
    out = [shakespeare]
    size = len(shakespeare.encode("utf-8"))
    while size < target:
        batch = []
        for _ in range(2000):
            r = rng.random()
            if r < 0.75:
                n = rng.randint(4, 24)
                line = " ".join(rng.choices(vocab, cum_weights=cum, k=n)).capitalize()
                line += rng.choice(".,;!?") if rng.random() < 0.9 else ""
            elif r < 0.85:
                line = (
                    f"In {rng.randint(1500, 2030)} the sum was {rng.randint(0, 10**6)} "
                    f"and {rng.random() * 100:.2f} per cent."
                )
            else:
                n = rng.randint(6, 40)
                line = "".join(rng.choices(HANZI, k=n)) + rng.choice("。，！？")
            batch.append(line)
        chunk = "\n".join(batch) + "\n"
        out.append(chunk)
        size += len(chunk.encode("utf-8"))
    path.write_text("".join(out), encoding="utf-8")


def documents(corpus: Path, mb: float) -> list[str]:
    """Documents of about 20 lines from the middle of the corpus (mixed content)."""
    lines = corpus.read_text(encoding="utf-8").split("\n")
    start = len(lines) // 3
    docs, size = [], 0
    for i in range(start, len(lines), 20):
        doc = "\n".join(lines[i : i + 20])
        docs.append(doc)
        size += len(doc.encode("utf-8"))
        if size >= mb * 1e6:
            break
    return docs


# --------------------------------------------------------------------------- training


def child_train_mindloom(corpus: str, out: str, vocab_size: int, threads: int) -> dict:
    from mindloom_tokenizer import train_tokenizer

    t0 = time.perf_counter()
    tok = train_tokenizer(corpus, out, vocab_size, "bpe", num_threads=threads)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "vocab_size": tok.vocab_size}


def hf_bpe_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    # GPT-2 / Llama-3 style: split words and single digits, then byte-level.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def child_train_hf(corpus: str, out: str, vocab_size: int, threads: int) -> dict:
    from tokenizers import pre_tokenizers, trainers

    tok = hf_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t0 = time.perf_counter()
    tok.train([corpus], trainer)
    dt = time.perf_counter() - t0
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    return {"seconds": dt, "vocab_size": tok.get_vocab_size()}


def run_child(kind: str, corpus: Path, out: Path, args) -> dict:
    env = dict(os.environ)
    env["RAYON_NUM_THREADS"] = str(args.threads)
    env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [sys.executable, __file__, "--child", kind, "--corpus", str(corpus), "--out", str(out)]
    cmd += ["--vocab-size", str(args.vocab_size), "--threads", str(args.threads)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out_text = proc.stdout.read().decode()
    proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"error: child {kind} failed with exit code {proc.returncode}")
    result = json.loads(out_text.strip().splitlines()[-1])
    result["wall_s"] = wall
    result["peak_rss_mb"] = usage.ru_maxrss / 1024  # Linux: KiB
    return result


# --------------------------------------------------------------------------- encoding


def time_encode(fn, docs, repeats):
    fn(docs[:50])  # warm-up (caches, thread pools)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(docs)
        times.append(time.perf_counter() - t0)
    return times


def child_encode(args, workdir: Path) -> dict:
    """Runs with RAYON_NUM_THREADS set by the parent; A/B interleaved in this process."""
    from mindloom_tokenizer import Tokenizer
    from tokenizers import Tokenizer as HFTokenizer

    threads = args.threads
    docs = documents(workdir / "corpus.txt", args.encode_mb)
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    ml = Tokenizer.load(workdir / "mindloom")
    hf = HFTokenizer.from_file(str(workdir / "hf" / "tokenizer.json"))
    hf_export = HFTokenizer.from_file(str(workdir / "mindloom" / "tokenizer.json"))

    runs = {
        "mindloom": lambda d: ml.encode_batch(d, num_threads=threads),
        "hf_bpe": lambda d: [e.ids for e in hf.encode_batch(d, add_special_tokens=False)],
        "hf_export": lambda d: [e.ids for e in hf_export.encode_batch(d, add_special_tokens=False)],
    }
    for fn in runs.values():
        fn(docs[:50])
    times = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():  # interleaved: A, B, C, A, B, C, ...
            t0 = time.perf_counter()
            ids = fn(docs)
            times[name].append(time.perf_counter() - t0)
            if name == "mindloom":
                n_ml = sum(map(len, ids))
            elif name == "hf_bpe":
                n_hf = sum(map(len, ids))
    # Sanity: the export encodes exactly like mindloom.
    same = runs["hf_export"](docs[:200]) == runs["mindloom"](docs[:200])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "threads": threads,
        "mb": mb,
        "docs": len(docs),
        "tokens_mindloom": n_ml,
        "tokens_hf_bpe": n_hf,
        "export_ids_identical": same,
        "mb_per_s": {k: mb / v for k, v in med.items()},
    }


def run_encode_child(args, workdir: Path, threads: int) -> dict:
    env = dict(os.environ)
    env["RAYON_NUM_THREADS"] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "true"
    cmd = [sys.executable, __file__, "--child", "encode", "--workdir", str(workdir)]
    cmd += ["--threads", str(threads), "--encode-mb", str(args.encode_mb)]
    cmd += ["--repeats", str(args.repeats)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse(argv)
    if args.child in ("mindloom", "hf"):
        fn = child_train_mindloom if args.child == "mindloom" else child_train_hf
        print(json.dumps(fn(args.corpus, args.out, args.vocab_size, args.threads)))
        return 0
    if args.child == "encode":
        print(json.dumps(child_encode(args, Path(args.workdir))))
        return 0

    tmp = None
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench-tokenizer-")
        workdir = Path(tmp.name)
    corpus = workdir / "corpus.txt"
    t0 = time.perf_counter()
    if not corpus.exists() or abs(corpus.stat().st_size - args.mb * 1e6) > 0.05 * args.mb * 1e6:
        make_corpus(corpus, args.mb)
    size_mb = corpus.stat().st_size / 1e6
    print(f"corpus: {size_mb:.1f} MB at {corpus} ({time.perf_counter() - t0:.1f}s to make)")
    print(f"machine: {os.cpu_count()} CPUs visible (shared); threads pinned to {args.threads}")

    # Training, each in a fresh process for a clean peak RSS; mindloom then HF.
    train = {}
    for kind in ("mindloom", "hf"):
        train[kind] = run_child(kind, corpus, workdir / kind, args)
        r = train[kind]
        print(
            f"train {kind:9s} vocab {r['vocab_size']:6d}: {r['seconds']:7.1f} s training, "
            f"{r['wall_s']:7.1f} s process, peak RSS {r['peak_rss_mb']:7.0f} MB"
        )
    from mindloom_tokenizer import export_hf

    export_hf(workdir / "mindloom")

    enc1 = run_encode_child(args, workdir, 1)
    encn = run_encode_child(args, workdir, args.threads) if args.threads > 1 else None
    print(
        f"encode: {enc1['mb']:.1f} MB in {enc1['docs']} documents; tokens: mindloom "
        f"{enc1['tokens_mindloom']:,}, hf bpe {enc1['tokens_hf_bpe']:,}; "
        f"export ids identical to mindloom: {enc1['export_ids_identical']}"
    )
    for enc in [enc1] + ([encn] if encn else []):
        m = enc["mb_per_s"]
        label = "per core (1 thread)" if enc["threads"] == 1 else f"{enc['threads']} threads"
        print(
            f"encode {label:20s}: mindloom {m['mindloom']:6.2f} MB/s, hf bpe "
            f"{m['hf_bpe']:6.2f} MB/s, hf running mindloom's export {m['hf_export']:6.2f} MB/s"
        )
    m = enc1["mb_per_s"]
    ratio = m["mindloom"] / m["hf_bpe"]
    print(f"RATIO encode per core mindloom / hf bpe: {ratio:.2f}x (target >= 2x)")
    tr = train["hf"]["seconds"] / train["mindloom"]["seconds"]
    rss = train["mindloom"]["peak_rss_mb"] / train["hf"]["peak_rss_mb"]
    print(f"RATIO training time hf / mindloom: {tr:.2f}x; peak RSS mindloom / hf: {rss:.2f}x")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
