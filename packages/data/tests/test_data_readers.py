import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from mindloom_data._readers import NoInputError, ReadStats, iter_documents, resolve_inputs


def _write_bad_jsonl(path, n=10_000):
    """10k lines with every bad category planted at known line numbers (test 16)."""
    planted = {}
    lines = []
    for i in range(1, n + 1):
        if i % 100 == 7:
            lines.append(b'{"text": "broken' + b"\n")
            planted.setdefault("malformed_json", []).append(i)
        elif i == 5000:
            lines.append(b'{"text": "bad \xff\xfe bytes"}\n')
            planted.setdefault("invalid_utf8", []).append(i)
        elif i == 5001:
            lines.append(b"\n")
            planted.setdefault("blank_line", []).append(i)
        elif i == 5002:
            lines.append(b'{"body": "no text key"}\n')
            planted.setdefault("missing_text_key", []).append(i)
        elif i == 5003:
            lines.append(b"[]\n")
            planted.setdefault("non_object_json", []).append(i)
        elif i == 5004:
            lines.append(b"42\n")
            planted.setdefault("non_object_json", []).append(i)
        elif i == 5005:
            lines.append(b'{"text": ""}\n')
            planted.setdefault("empty_text", []).append(i)
        elif i == 5006:
            lines.append(b'{"text": null}\n')
            planted.setdefault("null_text", []).append(i)
        else:
            lines.append(json.dumps({"text": f"document {i} ok"}).encode() + b"\n")
    path.write_bytes(b"".join(lines))
    return planted


def test_every_bad_jsonl_category_is_counted_and_every_valid_record_kept(tmp_path):
    path = tmp_path / "bad.jsonl"
    planted = _write_bad_jsonl(path)
    stats = ReadStats()
    docs = list(iter_documents(path, stats=stats))
    bad_lines = {ln for v in planted.values() for ln in v}
    assert [d.line for d in docs] == [i for i in range(1, 10_001) if i not in bad_lines]
    # records after the invalid UTF-8 line are all kept
    assert any(d.line > 5000 for d in docs)
    for cat, lines in planted.items():
        assert stats.counts[cat] == len(lines), cat
        assert stats.examples[cat][0] == f"{path}:{lines[0]}"
    assert stats.counts["malformed_json"] == 100
    assert stats.documents == len(docs)
    assert docs[0].text == "document 1 ok" and docs[0].id == f"{path}:1"
    d = stats.to_dict()
    assert d["bad"]["invalid_utf8"] == 1 and len(d["examples"]["malformed_json"]) == 5


def test_degenerate_files(tmp_path):
    (tmp_path / "zero.jsonl").write_bytes(b"")
    (tmp_path / "spaces.jsonl").write_bytes(b"  \n\n \t\n")
    (tmp_path / "spaces.txt").write_text("\n   \n")
    good = [json.dumps({"text": f"doc {i}"}) for i in range(50)]
    data = gzip.compress(("\n".join(good) + "\n").encode())
    (tmp_path / "trunc.jsonl.gz").write_bytes(data[: len(data) * 2 // 3])
    stats = ReadStats()
    docs = list(iter_documents(tmp_path, stats=stats))
    assert stats.counts["empty_file"] == 1
    assert stats.counts["whitespace_only_file"] == 2
    assert stats.counts["truncated_file"] == 1
    assert "blank_line" not in stats.counts
    # records before the break are kept, in order
    texts = [d.text for d in docs]
    assert 0 < len(texts) < 50
    assert texts == [f"doc {i}" for i in range(len(texts))]


def test_zstd_gzip_parquet_and_globs(tmp_path):
    recs = [{"text": f"zstd {i}", "x": i} for i in range(3)]
    blob = "".join(json.dumps(r) + "\n" for r in recs).encode()
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(blob))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(blob.replace(b"zstd", b"gz")))
    table = pa.table({"content": ["p1", None, "", "p4"], "n": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "c.parquet")
    (tmp_path / "ignored.csv").write_text("x")
    stats = ReadStats()
    docs = list(iter_documents(str(tmp_path / "*"), text_key="content", stats=stats))
    # jsonl files have no "content" key -> counted, parquet rows read
    assert [d.text for d in docs] == ["p1", "p4"]
    assert [d.line for d in docs] == [1, 4]
    assert stats.counts["missing_text_key"] == 6
    assert stats.counts["null_text"] == 1 and stats.counts["empty_text"] == 1
    docs = list(iter_documents([tmp_path / "a.jsonl.zst", tmp_path / "b.jsonl.gz"]))
    assert [d.text for d in docs] == ["zstd 0", "zstd 1", "zstd 2", "gz 0", "gz 1", "gz 2"]


def test_parquet_without_text_column_counts_rows(tmp_path):
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "x.parquet")
    stats = ReadStats()
    assert list(iter_documents(tmp_path / "x.parquet", stats=stats)) == []
    assert stats.counts["missing_text_key"] == 2


def test_plain_text_modes(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("\ufeffFirst para\nstill first.\n\n\nSecond para.\n\n第三段。\n")
    docs = list(iter_documents(p))
    assert [(d.text, d.line) for d in docs] == [
        ("First para\nstill first.", 1),
        ("Second para.", 5),
        ("第三段。", 7),
    ]
    whole = list(iter_documents(p, txt_mode="file"))
    assert len(whole) == 1 and whole[0].text.startswith("First") and "第三段" in whole[0].text
    lines = list(iter_documents(p, txt_mode="line"))
    assert [d.line for d in lines] == [1, 2, 5, 7]


def test_ids_are_stable_and_unique(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text('{"text": "same"}\n{"text": "same"}\n')
    one = [d.id for d in iter_documents(tmp_path)]
    two = [d.id for d in iter_documents(tmp_path)]
    assert one == two and len(set(one)) == 4


def test_no_inputs_is_one_clear_error(tmp_path):
    with pytest.raises(NoInputError, match="no input files matched"):
        resolve_inputs(str(tmp_path / "*.jsonl"))
    with pytest.raises(NoInputError, match="input not found"):
        resolve_inputs(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(NoInputError, match="unsupported input file"):
        resolve_inputs(tmp_path / "x.csv")
    with pytest.raises(NoInputError):
        resolve_inputs(tmp_path)  # a directory with no supported files
