"""Training input: JSONL (plain, gzip, zstd), Parquet, text; files, directories, globs."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from mindloom_tokenizer import train_tokenizer
from mindloom_tokenizer._readers import NoInputError, ReadStats, iter_texts, resolve_inputs


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def test_every_format_is_read(tmp_path):
    rows = [{"text": f"document {i} 文档"} for i in range(6)]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_bytes(_jsonl(rows[:2]))
    (tmp_path / "d" / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(rows[2:4])))
    (tmp_path / "d" / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(_jsonl(rows[4:]))
    )
    pq.write_table(
        pa.table({"text": ["parquet one", "parquet two"], "id": ["x", "y"]}),
        tmp_path / "d" / "e.parquet",
    )
    (tmp_path / "d" / "f.txt").write_text("line one\nline two\n", encoding="utf-8")
    (tmp_path / "d" / "ignored.csv").write_text("not,read\n", encoding="utf-8")
    stats = ReadStats()
    texts = list(iter_texts(tmp_path / "d", stats=stats))
    assert texts[:6] == [r["text"] for r in rows]
    assert texts[6:] == ["parquet one", "parquet two", "line one\nline two\n"]
    assert stats.files == 5
    # a file of no known format is not read, but counted and named (issue 23)
    assert dict(stats.bad) == {"unsupported_file": 1}
    assert stats.examples["unsupported_file"] == [str(tmp_path / "d" / "ignored.csv")]
    # A glob and an explicit file give the same files, sorted and de-duplicated.
    files = resolve_inputs([str(tmp_path / "d" / "*.jsonl*"), tmp_path / "d" / "a.jsonl"])
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]


def test_custom_text_key_and_parquet_column(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(_jsonl([{"content": "from content"}, {"text": "no"}]))
    pq.write_table(pa.table({"content": ["pq content"]}), tmp_path / "b.parquet")
    stats = ReadStats()
    assert list(iter_texts(tmp_path, text_key="content", stats=stats)) == [
        "from content",
        "pq content",
    ]
    assert stats.bad["missing_text_key"] == 1


def test_bad_records_are_counted_not_fatal(tmp_path):
    good = _jsonl([{"text": "good one"}])
    lines = [
        good,
        b"{not json\n",
        b"\xff\xfe invalid utf8\n",
        b"[1, 2]\n",
        b'{"text": 42}\n',
        b'{"text": ""}\n',
        b"\n",
        _jsonl([{"text": "good two"}]),
    ]
    (tmp_path / "a.jsonl").write_bytes(b"".join(lines))
    full = gzip.compress(_jsonl([{"text": f"gz {i}"} for i in range(2000)]))
    (tmp_path / "b.jsonl.gz").write_bytes(full[: len(full) // 2])  # truncated mid-stream
    (tmp_path / "c.txt").write_text("", encoding="utf-8")
    (tmp_path / "d.parquet").write_bytes(b"PAR1 this is not parquet")
    stats = ReadStats()
    texts = list(iter_texts(tmp_path, stats=stats))
    assert texts[:2] == ["good one", "good two"]
    assert len(texts) > 2 and texts[2] == "gz 0"  # records before the break are kept
    assert stats.bad["malformed_json"] == 1
    assert stats.bad["invalid_utf8"] == 1
    assert stats.bad["non_object_json"] == 1
    assert stats.bad["non_string_text"] == 1
    assert stats.bad["empty_text"] == 1
    assert stats.bad["truncated_file"] == 1
    assert stats.bad["empty_file"] == 1
    assert stats.bad["unreadable_file"] == 1
    assert stats.to_dict()["examples"]["malformed_json"] == [f"{tmp_path / 'a.jsonl'}:2"]


def test_missing_inputs_are_errors(tmp_path):
    with pytest.raises(NoInputError, match="input not found"):
        resolve_inputs(tmp_path / "nope.jsonl")
    with pytest.raises(NoInputError, match="no input files matched"):
        resolve_inputs(str(tmp_path / "*.jsonl"))
    with pytest.raises(NoInputError, match="no input files matched"):
        resolve_inputs(tmp_path)
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(NoInputError, match="unsupported input file"):
        resolve_inputs(tmp_path / "x.csv")


def test_training_reads_parquet_and_reports_bad_records(tmp_path):
    texts = [f"parquet sentence number {i} with some words" for i in range(300)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_bytes(b"{broken\n" + _jsonl([{"text": "one more line"}]))
    messages: list[str] = []
    tok = train_tokenizer(tmp_path, tmp_path / "t", 300, progress=messages.append)
    read = tok.metadata["stats"]["read"]
    assert read["documents"] == 301 and read["bad"] == {"malformed_json": 1}
    assert any("malformed_json=1" in m for m in messages)
    assert tok.decode(tok.encode(texts[7])) == texts[7]
