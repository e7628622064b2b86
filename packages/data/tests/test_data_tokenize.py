"""`mindloom-data tokenize`: round trip, order, idempotence, kill -9, huge documents.

Reliability tests 18 (huge document, bounded memory), 19 (round trip, EOS once per
document, merge = concatenation) and 20 (SIGKILL halfway, rerun byte-identical).
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zstandard
from mindloom_data import IndexedDataset, bundled_corpus
from mindloom_data._cli import main
from mindloom_data._encode import _texts, chunk_text, chunking_mode
from mindloom_data._indexed import merge_datasets
from mindloom_data._readers import ReadStats, iter_documents
from mindloom_data._tokenize import tokenize
from mindloom_tokenizer import Tokenizer, train_tokenizer

TRICKY = [
    "  leading spaces and trailing  ",
    "tabs\tand\nnewlines\n\nand  double  spaces",
    "unicode: café, naïve, 東京, emoji 🙂",
    "x",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([str(bundled_corpus())], out, vocab_size=1000, model_type="bpe")
    return str(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL of the bundled corpus' paragraphs plus tricky texts and bad records."""
    paragraphs = [p for p in bundled_corpus().read_text().split("\n\n") if p.strip()]
    path = tmp_path_factory.mktemp("in") / "docs.jsonl"
    texts = paragraphs[:1500] + TRICKY
    with open(path, "w", encoding="utf-8") as f:
        for k, t in enumerate(texts):
            f.write(json.dumps({"text": t}) + "\n")
            if k == 3:
                f.write("{not json\n")  # counted by the reader, not fatal
    return str(path), texts


def _bytes(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def test_round_trip_and_eos_once_per_document(tmp_path, tok_dir, corpus, capsys):
    path, texts = corpus
    out = str(tmp_path / "out")
    assert main(["tokenize", "--tokenizer", tok_dir, "--input", path, "--output-prefix", out]) == 0
    msg = capsys.readouterr().out
    assert f"{len(texts)} documents" in msg and "bad records 1" in msg
    tok = Tokenizer.load(tok_dir)
    ds = IndexedDataset(out, vocab_size=tok.vocab_size)
    assert ds.dtype == np.uint16 and len(ds) == len(texts)
    for i, text in enumerate(texts):
        ids = ds[i]
        assert int(ids[-1]) == tok.eos_id and int((ids == tok.eos_id).sum()) == 1
        assert tok.decode(ids) == text
        assert ids[:-1].tolist() == tok.encode(text)
    assert main(["inspect", out, "--tokenizer", tok_dir, "--show", "2"]) == 0
    shown = capsys.readouterr().out
    assert f"documents {len(texts)}" in shown and repr(texts[0][:300]) in shown


def test_no_eos_writes_plain_tokens(tmp_path, tok_dir, corpus):
    path, texts = corpus
    out = str(tmp_path / "noeos")
    tokenize(path, tok_dir, out, append_eos=False)
    tok = Tokenizer.load(tok_dir)
    ds = IndexedDataset(out)
    assert ds[0].tolist() == tok.encode(texts[0])
    assert not any(int((ds[i] == tok.eos_id).sum()) for i in range(20))


# Lines where orjson and json.loads could disagree, and every bad-record category.
ODD_LINES = [
    b"\n",  # blank before the first record
    b'{"text": "first"}\n',
    b"  \t\n",  # blank between records
    b'{"text": "after a blank"}\n',
    b'{"text": "broken\n',
    b'{"text": "bad \xff\xfe bytes"}\n',
    b'{"text": "utf-8 surrogate \xed\xa0\x80"}\n',
    b'{"text": "lone surrogate \\ud800 escape"}\n',  # json.loads keeps it, orjson refuses
    b'{"text": "pair \\ud83d\\ude00 escape"}\n',
    b'{"text": "nan", "x": NaN}\n',  # json.loads accepts NaN, orjson refuses
    b'{"text": "big int", "x": 123456789012345678901234567890}\n',
    b'{"text": "dup", "text": "last wins"}\n',
    b'\xef\xbb\xbf{"text": "bom"}\n',
    b'{"text": "two"} {"text": "objects"}\n',
    b'{"body": "no text key"}\n',
    b"[]\n",
    b"42\n",
    b'{"text": ""}\n',
    b'{"text": " \\u2028\\n "}\n',  # whitespace only to str.strip
    b'{"text": null}\n',
    b'{"text": 7}\n',
    b'{"text": "crlf"}\r\n',
    b'{"text": "no newline at the end"}',
]


def test_fast_jsonl_path_reads_what_the_reader_reads(tmp_path):
    """`_texts` (orjson) yields exactly `iter_documents`' texts and the same bad counts."""
    data = b"".join(ODD_LINES)
    trailing = data + b"\n\n"  # blank lines after the last record
    (tmp_path / "a.jsonl").write_bytes(trailing)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    whole = gzip.compress(data * 20)
    (tmp_path / "d.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # truncated
    (tmp_path / "e.jsonl").write_bytes(b"")
    (tmp_path / "f.jsonl").write_bytes(b" \n\n")
    (tmp_path / "g.txt").write_text("a paragraph\n\nanother one\n", encoding="utf-8")
    want_stats, got_stats = ReadStats(), ReadStats()
    want = [d.text for d in iter_documents(tmp_path, stats=want_stats)]
    got = list(_texts(tmp_path, "text", got_stats, "paragraph"))
    assert got == want
    assert "lone surrogate \ud800 escape" in got and "last wins" in got and "nan" in got
    assert got_stats.to_dict() == want_stats.to_dict()
    assert want_stats.counts["blank_line"] >= 4 and want_stats.counts["truncated_file"] == 1


def test_workers_and_reruns_are_byte_identical(tmp_path, tok_dir, corpus):
    path, _ = corpus
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tokenize(path, tok_dir, a, workers=1, task_bytes=20_000)
    tokenize(path, tok_dir, b, workers=2, task_bytes=20_000)
    assert _bytes(a) == _bytes(b)
    first = _bytes(a)
    again = tokenize(path, tok_dir, a)  # the completion marker matches: skipped
    assert again.skipped and _bytes(a) == first
    forced = tokenize(path, tok_dir, a, force=True)
    assert not forced.skipped and _bytes(a) == first


@pytest.mark.parametrize("model_type", ["bpe", "char"])
def test_chunks_across_tasks_threads_and_processes(tmp_path, model_type):
    """Long documents cut into chunks that span tasks, mixed with whole ones: the same
    bytes from 1 and 3 workers (threads for SentencePiece, processes for `char`), and
    each document equals its whole-text encoding plus one EOS."""
    tok_dir = tmp_path / "tok"
    vocab = 500 if model_type == "bpe" else None
    train_tokenizer([str(bundled_corpus())], tok_dir, vocab_size=vocab, model_type=model_type)
    base = bundled_corpus().read_text()
    texts = [base[k * 997 : k * 997 + n] for k, n in enumerate([50, 9000, 120, 30, 25_000, 70])]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    outs = []
    for workers in (1, 3):
        out = str(tmp_path / f"w{workers}")
        st = tokenize(str(path), tok_dir, out, workers=workers, chunk_chars=2000, task_bytes=3000)
        assert st.documents == len(texts) and st.chunked_documents == 2
        outs.append(_bytes(out))
    assert outs[0] == outs[1]
    tok = Tokenizer.load(tok_dir)
    ds = IndexedDataset(str(tmp_path / "w3"))
    assert len(ds) == len(texts)
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tok.encode(text) + [tok.eos_id]


def test_merging_shards_equals_tokenizing_everything(tmp_path, tok_dir, corpus):
    path, texts = corpus
    whole = str(tmp_path / "whole")
    tokenize(path, tok_dir, whole)
    parts = []
    for k, chunk in enumerate((texts[:700], texts[700:])):
        p = tmp_path / f"part{k}.jsonl"
        p.write_text("".join(json.dumps({"text": t}) + "\n" for t in chunk), encoding="utf-8")
        tokenize(str(p), tok_dir, str(tmp_path / f"part{k}"))
        parts.append(str(tmp_path / f"part{k}"))
    merge_datasets(parts, tmp_path / "merged")
    assert _bytes(whole) == _bytes(str(tmp_path / "merged"))


def test_chunked_encoding_equals_whole_encoding(tok_dir):
    tok = Tokenizer.load(tok_dir)
    text = bundled_corpus().read_text()[:60_000]
    drop = chunking_mode(tok)
    assert drop is True  # SentencePiece with a dummy prefix: the space is re-added
    parts = chunk_text(text, 3000, drop)
    assert len(parts) > 20
    assert [t for p in parts for t in tok.encode(p)] == tok.encode(text)


def test_sigkill_halfway_then_rerun_is_byte_identical(tmp_path, tok_dir):
    big = tmp_path / "big.txt"
    # 3 MB: enough work (~0.5 s) to be caught halfway now that tokenizing is faster
    big.write_text(bundled_corpus().read_text() * 3, encoding="utf-8")
    ref = str(tmp_path / "ref")
    tokenize(str(big), tok_dir, ref)
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "mindloom_data", "tokenize", "--tokenizer", tok_dir]
    cmd += ["--input", str(big), "--output-prefix", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = out + ".bin.partial"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(partial) and os.path.getsize(partial) > 0:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # nothing that looks complete at the final paths
    assert not os.path.exists(out + ".idx") and not os.path.exists(out + ".bin")
    assert not os.path.exists(out + ".done.json")
    assert (
        main(["tokenize", "--tokenizer", tok_dir, "--input", str(big), "--output-prefix", out]) == 0
    )
    assert _bytes(out) == _bytes(ref)
    assert not os.path.exists(partial)


def test_fifty_megabyte_document_with_bounded_memory(tmp_path):
    """A single 50 MB line: chunked encoding keeps peak RSS far below a whole-text encode."""
    tok = tmp_path / "char"
    train_tokenizer([str(bundled_corpus())], tok, model_type="char")
    line = tmp_path / "huge.jsonl"
    base = bundled_corpus().read_text()
    text = (base * (50_000_000 // len(base) + 1))[:50_000_000]
    line.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    del text
    code = (
        # VmHWM, not ru_maxrss: the latter keeps the forking pytest's RSS across exec
        "import sys\nfrom mindloom_data._cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM')][0]\n"
        "print('MAXRSS_KB', hwm.split()[1])\n"
        "sys.exit(rc)\n"
    )
    out = str(tmp_path / "huge")
    args = ["tokenize", "--tokenizer", str(tok), "--input", str(line), "--output-prefix", out]
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "chunked 1" in res.stdout
    rss_mb = int(res.stdout.split("MAXRSS_KB")[1]) / 1024
    # ~70 MB of imports, the reader's line/str/dict copies and the chunks are ~320 MB;
    # a whole-text encode would add a 50M-id list and array (~800 MB)
    assert rss_mb < 500, f"peak RSS {rss_mb:.0f} MB"
    ds = IndexedDataset(out)
    assert len(ds) == 1 and ds.num_tokens == 50_000_001
    t = Tokenizer.load(tok)
    assert t.decode(ds[0][:2000]) == base[:2000]


def test_cli_errors_are_one_line(tmp_path, tok_dir, corpus, capsys):
    path, _ = corpus
    out = str(tmp_path / "o")
    assert (
        main(
            [
                "tokenize",
                "--tokenizer",
                str(tmp_path / "nope"),
                "--input",
                path,
                "--output-prefix",
                out,
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "nope" in err
    assert (
        main(
            [
                "tokenize",
                "--tokenizer",
                tok_dir,
                "--input",
                str(tmp_path / "*.jsonl"),
                "--output-prefix",
                out,
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no input files matched" in err
    assert not os.path.exists(out + ".bin") and not os.path.exists(out + ".bin.partial")
