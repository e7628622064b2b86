"""Golden outputs of a small clean run (filters, exact and MinHash dedup, the audit trail),
recorded with the code before the issue-21 restructuring of the clean stage into steps
(commit badc230), so a refactor that changes any output byte or count fails here.

Parquet shards are compared by their rows (their bytes carry the pyarrow version), the
report without its wall-clock `seconds`, the summary without its first (timed) line;
JSON Lines shards and `removed/<step>/` files byte for byte. `clean.done.json` is left out:
it holds a hash of each Parquet file's bytes.
"""

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mindloom_data import clean

DATA = Path(__file__).parent / "data" / "filter_eval.jsonl"

GOLDEN = {
    "removed/boilerplate/shard-00000.jsonl": "dc00396377bdecdb",
    "removed/exact_dedup/shard-00001.jsonl": "992c434a1ab1291f",
    "removed/garbled/shard-00000.jsonl": "38dc72e6cc2b226f",
    "removed/length/shard-00000.jsonl": "24a81a192f2eb146",
    "removed/minhash_dedup/shard-00000.jsonl": "55ee27aa2a4970e8",
    "removed/minhash_dedup/shard-00001.jsonl": "c7800646093c7903",
    "removed/repeated_chars/shard-00000.jsonl": "bbff8064a8275af0",
    "removed/repetition/shard-00000.jsonl": "f00ad17e5e37cb6d",
    "removed/symbols/shard-00000.jsonl": "20da3546c1ceb7cf",
    "report.json": "9a378899e883f5d2",  # + config language.candidates (web); rest unchanged
    "shard-00000.jsonl": "0984cc379c82b727",
    "shard-00000.parquet": "23091ae5aa791f44",
    "shard-00001.jsonl": "e3b0c44298fc1c14",
    "shard-00001.parquet": "4f53cda18c2baa0c",
    "summary.txt": "025a215ca805a9a7",
}


def _corpus(root: Path) -> None:
    """The labeled filter set, then a file of its first 40 records again (exact
    duplicates), one-word edits of every 4th of its first 80 (near duplicates) and a
    malformed line."""
    (root / "in").mkdir()
    lines = DATA.read_text(encoding="utf-8").splitlines()
    (root / "in" / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    near = []
    for line in lines[:80:4]:
        rec = json.loads(line)
        words = rec["text"].split(" ")
        if len(words) > 20:
            words[len(words) // 2] = "zzz"
            rec["text"], rec["id"] = " ".join(words), rec["id"] + "-near"
            near.append(json.dumps(rec, ensure_ascii=False))
    body = "\n".join(lines[:40] + near + ["{broken"]) + "\n"
    (root / "in" / "b.jsonl").write_text(body, encoding="utf-8")


def _digests(out: Path) -> dict:
    got = {}
    for p in sorted(out.rglob("*")):
        rel = str(p.relative_to(out))
        if not p.is_file() or ".work" in p.parts or rel == "clean.done.json":
            continue
        if p.suffix == ".parquet":
            data = json.dumps(pq.read_table(p).to_pylist(), ensure_ascii=False).encode()
        elif rel == "report.json":
            report = json.loads(p.read_text())
            report.pop("seconds")
            data = json.dumps(report, sort_keys=True).encode()
        elif rel == "summary.txt":
            data = "\n".join(p.read_text().splitlines()[1:]).encode()
        else:
            data = p.read_bytes()
        got[rel] = hashlib.sha256(data).hexdigest()[:16]
    return got


@pytest.mark.parametrize("workers", [1, 2])
def test_clean_outputs_match_the_golden_digests(tmp_path, monkeypatch, workers):
    _corpus(tmp_path)
    monkeypatch.chdir(tmp_path)  # relative inputs: sources in the outputs are "in/a.jsonl"
    cfg = {"filters": {"length": {"min_units": 5}}, "output": {"jsonl": True}}
    clean(["in"], "out", config=cfg, workers=workers, progress=False)
    assert _digests(tmp_path / "out") == GOLDEN
