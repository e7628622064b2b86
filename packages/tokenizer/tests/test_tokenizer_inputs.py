"""`mindloom_tokenizer.inputs`: the one input-discovery rule (issue 23).

A directory laid out as mindloom-data's `clean` writes it (kept shards, `--jsonl` copies,
`removed/<step>/`, reports, `clean.done.json`) must be read as its kept shards only, by
the reader and by `mindloom-tokenizer train --input DIR`.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mindloom_tokenizer._cli import main
from mindloom_tokenizer._readers import ReadStats, iter_texts
from mindloom_tokenizer.inputs import (
    CLEAN_FORMAT,
    CLEAN_MARKER,
    NoInputError,
    describe_file,
    discover_inputs,
)

KEPT = [f"kept document {i} about tokenizers" for i in range(40)]
REMOVED = [f"removed document {i} never to be trained on" for i in range(30)]


def _clean_output(root):
    out = root / "cleaned"
    (out / "removed" / "length").mkdir(parents=True)
    pq.write_table(pa.table({"text": KEPT}), out / "shard-00000.parquet")
    (out / "shard-00000.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in KEPT))
    (out / "removed" / "length" / "shard-00000.jsonl").write_text(
        "".join(json.dumps({"text": t, "reason": "too_short"}) + "\n" for t in REMOVED)
    )
    (out / "summary.txt").write_text("read 70 documents\nkept 40 documents\n")
    (out / "report.json").write_text("{}\n")
    entry = {**describe_file(out / "shard-00000.parquet"), "documents": len(KEPT)}
    marker = {
        "format": CLEAN_FORMAT,
        "version": 1,
        "documents": len(KEPT),
        "shards": [entry],
        "extra": [describe_file(out / "shard-00000.jsonl")],
    }
    (out / CLEAN_MARKER).write_text(json.dumps(marker))
    return out


def test_a_clean_output_contributes_only_its_kept_shards(tmp_path):
    out = _clean_output(tmp_path)
    for given in (out, tmp_path, str(out / "*"), str(tmp_path / "**")):
        found = discover_inputs(given)
        assert [p.rsplit("/", 1)[1] for p in found.files] == ["shard-00000.parquet"], given
        assert found.unsupported == [], given
    stats = ReadStats()
    assert list(iter_texts(out, stats=stats)) == KEPT and not stats.bad


def test_tokenizer_train_on_a_clean_output_reads_the_kept_documents_once(tmp_path, capsys):
    out = _clean_output(tmp_path)
    rc = main(["train", "--input", str(out), "--model-type", "char", "--out", str(tmp_path / "t")])
    assert rc == 0, capsys.readouterr().err
    meta = json.loads((tmp_path / "t" / "mindloom_tokenizer.json").read_text())
    assert meta["trained_on"] == [str(out / "shard-00000.parquet")]
    assert meta["stats"]["read"]["documents"] == len(KEPT)


def test_a_changed_or_unfinished_clean_output_is_one_line(tmp_path, capsys):
    out = _clean_output(tmp_path)
    with open(out / "shard-00000.parquet", "ab") as f:
        f.write(b"\0")
    with pytest.raises(NoInputError, match="shard-00000.parquet has"):
        discover_inputs(out)
    rc = main(["train", "--input", str(out), "--model-type", "char", "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "shard-00000.parquet" in err and "\n" not in err
    (out / CLEAN_MARKER).unlink()
    (out / ".work").mkdir()
    (out / ".work" / "run.json").write_text("{}")
    with pytest.raises(NoInputError, match="unfinished mindloom-data clean output"):
        discover_inputs(out)
