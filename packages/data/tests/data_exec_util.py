"""Shared by the executor tests: a seeded corpus with planted duplicates and the outcome
of a run in a form that can be compared across executors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq

_rng = random.Random(0)
_VOCAB = [
    "".join(_rng.choice("abcdefghijklmnopqrst") for _ in range(_rng.randint(2, 9)))
    for _ in range(6000)
]


def make_doc(rng: random.Random, n: int) -> str:
    words = [rng.choice(_VOCAB) for _ in range(n)]
    sents = [" ".join(words[i : i + 10]).capitalize() + "." for i in range(0, n, 10)]
    half = len(sents) // 2
    return " ".join(sents[:half]) + "\n\n" + " ".join(sents[half:])


def make_corpus(
    root: Path,
    files: int = 6,
    docs: int = 400,
    seed: int = 0,
    words: tuple[int, int] = (40, 120),
    with_ids: bool = False,
) -> Path:
    """`files * docs` documents of `words` words: ~5% exact and ~7% near duplicates (also
    across files), some too short, one malformed line per file. `with_ids`: records carry
    their own `id` (every 9th has none) and metadata fields, one a nested object."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    seen: list[str] = []
    for f in range(files):
        lines = []
        for _ in range(docs):
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
                text = make_doc(rng, rng.randint(*words))
            seen.append(text)
            rec = {"text": text}
            if with_ids:
                k = len(lines)
                rec = {"url": f"https://example.org/{f}/{k}", "text": text, "n": k}
                if k % 9:
                    rec["id"] = f"doc-{f}-{k}"
                if k % 5 == 0:
                    rec["metadata"] = {"lang": "en", "score": k / 10}
            lines.append(json.dumps(rec))
        lines.insert(docs // 2, "{broken json")
        (root / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def outcome(out: Path) -> dict:
    """Kept ids in output order, removed (id, step, reason, duplicate_of) as a set, and
    the aggregated counts of the report."""
    kept = []
    for p in sorted(out.glob("shard-*.parquet")):
        kept.extend((r["id"], r["text"], r.get("metadata")) for r in pq.read_table(p).to_pylist())
    removed = set()
    for p in sorted((out / "removed").rglob("*.jsonl")):
        for line in p.read_text().splitlines():
            r = json.loads(line)
            meta = json.dumps(r.get("metadata"), sort_keys=True)
            removed.add((r["id"], p.parent.name, r["reason"], r.get("duplicate_of"), meta))
    report = json.loads((out / "report.json").read_text())
    return {
        "kept": kept,
        "removed": removed,
        "steps": report["steps"],
        "read": report["read"],
        "output": report["output"],
        "clusters": report.get("clusters"),
    }


def removed_reasons(o: dict) -> dict:
    counts: dict = {}
    for _, step, reason, *_ in o["removed"]:
        counts[(step, reason)] = counts.get((step, reason), 0) + 1
    return counts


def file_bytes(prefix) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def shared_reference(tmp_path_factory) -> dict:
    """The single-process reference, computed once per pytest session: the clean output
    of `make_corpus()` and one `tokenize` of all its shards."""
    from mindloom_data import bundled_corpus, clean, tokenize
    from mindloom_tokenizer import train_tokenizer

    root = tmp_path_factory.getbasetemp() / "exec_reference"
    ok = root / "complete"
    if not ok.exists():
        src = make_corpus(root / "in", with_ids=True)
        clean(src, root / "clean", workers=1, progress=False)
        train_tokenizer([str(bundled_corpus())], root / "tok", vocab_size=1000, model_type="bpe")
        shards = sorted(str(p) for p in (root / "clean").glob("shard-*.parquet"))
        tokenize(shards, root / "tok", str(root / "tokens"), workers=1)
        ok.write_text("")
    return {
        "src": root / "in",
        "outcome": outcome(root / "clean"),
        "tok": str(root / "tok"),
        "shards": sorted(str(p) for p in (root / "clean").glob("shard-*.parquet")),
        "tokens": file_bytes(root / "tokens"),
    }
