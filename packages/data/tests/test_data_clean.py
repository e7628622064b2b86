import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mindloom_data import CleanError, clean
from mindloom_data._cli import main

sys.path.insert(0, str(Path(__file__).parent))
from data_exec_util import make_corpus, make_doc  # noqa: E402


def _corpus(root: Path, files=4, docs=150, seed=0):
    """Seeded corpus with planted exact and near duplicates and some bad lines."""
    return make_corpus(root, files=files, docs=docs, seed=seed, words=(60, 150))


def _outputs(out: Path):
    shards = {p.name: pq.read_table(p).to_pylist() for p in sorted(out.glob("shard-*.parquet"))}
    removed = {}
    for p in sorted((out / "removed").rglob("*.jsonl")):
        removed[str(p.relative_to(out))] = p.read_text()
    return shards, removed


def test_one_and_two_workers_give_identical_output(tmp_path):
    src = _corpus(tmp_path / "in")
    r1 = clean(src, tmp_path / "w1", workers=1)
    r2 = clean(src, tmp_path / "w2", workers=2)
    s1, rem1 = _outputs(tmp_path / "w1")
    s2, rem2 = _outputs(tmp_path / "w2")
    assert s1 == s2 and rem1 == rem2
    assert len(s1) == 4 and sum(map(len, s1.values())) == r1["output"]["documents"]
    for k in ("steps", "read", "output", "clusters"):
        assert r1[k] == r2[k]
    steps = r1["steps"]
    assert steps["exact_dedup"]["removed"]["exact_duplicate"] > 0
    assert steps["minhash_dedup"]["removed"]["near_duplicate"] > 0
    assert steps["length"]["removed"]["too_short"] > 0
    assert r1["read"]["bad"] == {"malformed_json": 4}
    # provenance is kept and ids are stable
    row = s1["shard-00000.parquet"][0]
    assert row["id"] == f"{row['source']}:{row['line']}" and row["source"].endswith("part0.jsonl")
    # byte accounting: every step's output is the next step's input
    names = list(steps)
    for a, b in zip(names, names[1:]):
        assert steps[a]["docs_out"] == steps[b]["docs_in"]
        assert steps[a]["bytes_out"] == steps[b]["bytes_in"]
    assert (tmp_path / "w1/summary.txt").read_text().startswith("read ")


def test_rerun_resumes_and_changes_nothing(tmp_path):
    src = _corpus(tmp_path / "in", files=2, docs=60)
    out = tmp_path / "out"
    clean(src, out)
    before = _outputs(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}
    clean(src, out)
    assert _outputs(out) == before
    assert {p: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")} == mtimes
    # a different config on the same output directory is refused, not mixed in
    with pytest.raises(CleanError, match="other inputs or config"):
        clean(src, out, config={"dedup": {"exact": False}})


def test_killed_run_leaves_no_complete_looking_shard_and_resumes(tmp_path):
    src = _corpus(tmp_path / "in", files=4, docs=200, seed=1)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "mindloom_data", "clean", str(src), "--output", str(out), "-q"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    marker = out / ".work/done/scan/00001.json"
    deadline = time.time() + 60
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (out / "report.json").exists()
    for p in out.glob("shard-*.parquet"):  # any shard present must be whole
        pq.read_table(p)
    assert not list(out.glob("shard-*.parquet"))  # shards are only written after all scans
    rc = subprocess.run(cmd, capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    assert not list(out.rglob("*.tmp-*"))
    clean(src, tmp_path / "whole")
    assert _outputs(out)[0] == _outputs(tmp_path / "whole")[0]


def test_cli_bad_records_are_counted_and_exit_zero(tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    rng = random.Random(5)
    good = [json.dumps({"text": make_doc(rng, 80)}).encode() for _ in range(200)]
    bad = [b"{not json", b'{"text": "bad \xff utf8"}', b"", b'{"body": "x"}', b"[]", b"42"]
    bad += [b'{"text": ""}', b'{"text": null}']
    lines = good[:100] + bad + good[100:]
    (src / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (src / "empty.jsonl").write_bytes(b"")
    (src / "blank.jsonl").write_bytes(b"\n  \n")
    other = [json.dumps({"text": make_doc(rng, 80)}).encode() for _ in range(50)]
    data = gzip.compress(b"\n".join(other) + b"\n")
    (src / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    assert main(["clean", str(src), "--output", str(tmp_path / "out"), "--jsonl"]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "out/report.json").read_text())
    bad_counts = report["read"]["bad"]
    assert bad_counts == {
        "malformed_json": 1,
        "invalid_utf8": 1,
        "missing_text_key": 1,
        "non_object_json": 2,
        "null_text": 1,
        "empty_text": 1,
        "blank_line": 1,
        "empty_file": 1,
        "whitespace_only_file": 1,
        "truncated_file": 1,
    }
    assert report["read"]["examples"]["invalid_utf8"] == [f"{src / 'mixed.jsonl'}:102"]
    assert "invalid_utf8" in out and "truncated_file" in out
    # all 200 good records of mixed.jsonl survive, including those after the bad bytes
    rows = pq.read_table(tmp_path / "out/shard-00003.parquet").to_pylist()
    assert len(rows) == 200 and rows[-1]["line"] == 208
    jl = (tmp_path / "out/shard-00003.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in jl] == [r["id"] for r in rows]
    # and a threshold on the bad fraction turns it into a failure
    code = main(
        ["clean", str(src), "-o", str(tmp_path / "strict"), "-q", "--max-bad-fraction", "0.01"]
    )
    assert code == 1
    assert "max-bad-fraction" in capsys.readouterr().err


def test_chinese_and_punctuation_survive_end_to_end(tmp_path):
    rng = random.Random(6)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 2500)]
    zh = []
    for _ in range(5):
        sents = ["".join(rng.choice(chars) for _ in range(15)) + "。" for _ in range(6)]
        zh.append("".join(sents[:3]) + "\n\n" + "".join(sents[3:]))
    en = make_doc(rng, 80).replace(".", "?", 1) + ' "Quoted," she said; (and) that: was it!'
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in zh + [en]))
    clean(src, tmp_path / "out")
    rows = pq.read_table(tmp_path / "out/shard-00000.parquet").column("text").to_pylist()
    assert rows == zh + [en]


def test_cli_errors_are_one_line(tmp_path, capsys):
    def err(argv):
        code = main(argv)
        e = capsys.readouterr().err
        assert code != 0 and e.startswith("error: ") and e.count("\n") == 1, e
        return e

    assert "no input files matched" in err(
        ["clean", str(tmp_path / "*.jsonl"), "-o", str(tmp_path / "o")]
    )
    src = _corpus(tmp_path / "in", files=1, docs=5)
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if not os.access(locked, os.W_OK):  # root can write anywhere
            assert "not writable" in err(["clean", str(src), "-o", str(locked / "out")])
    finally:
        os.chmod(locked, 0o700)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "not writable" in err(["clean", str(src), "-o", str(blocker / "out")])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dedup:\n  minhash:\n    bandz: 3\n")
    assert "dedup.minhash.bandz" in err(
        ["clean", str(src), "-o", str(tmp_path / "o2"), "-c", str(cfg)]
    )
    cfg.write_text("filters: {length: {min_units: 3}}\ndedup:\n  minhash: {bands: 20, rows: 8}\n")
    assert "exceeds minhash.num_perm" in err(
        ["clean", str(src), "-o", str(tmp_path / "o3"), "-c", str(cfg)]
    )
    cfg.write_text("a: [1, 2\n")
    assert "invalid YAML" in err(["clean", str(src), "-o", str(tmp_path / "o4"), "-c", str(cfg)])
    cfg.write_text("!!python/object/apply:os.system ['touch x']\n")
    assert "invalid YAML" in err(["clean", str(src), "-o", str(tmp_path / "o5"), "-c", str(cfg)])


def test_yaml_config_switches_steps(tmp_path):
    src = _corpus(tmp_path / "in", files=1, docs=80)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "normalize: {nfkc: false}\n"
        "filters: {length: {min_units: 1}, repetition: false}\n"
        "dedup: {minhash: false, paragraph: false}\n"
    )
    assert main(["clean", str(src), "-o", str(tmp_path / "out"), "-c", str(cfg), "-q"]) == 0
    report = json.loads((tmp_path / "out/report.json").read_text())
    assert "repetition" not in report["steps"] and "minhash_dedup" not in report["steps"]
    assert "too_short" not in report["steps"]["length"]["removed"]
    assert report["steps"]["exact_dedup"]["removed"]["exact_duplicate"] > 0


def test_a_50_mb_document_is_counted_not_fatal(tmp_path):
    src = tmp_path / "in.jsonl"
    rng = random.Random(7)
    with open(src, "w") as f:
        f.write(json.dumps({"text": make_doc(rng, 80)}) + "\n")
        f.write(json.dumps({"text": "lorem ipsum " * (50 * 1024 * 1024 // 12)}) + "\n")
        f.write(json.dumps({"text": make_doc(rng, 80)}) + "\n")
    out = tmp_path / "out"
    assert main(["clean", str(src), "-o", str(out), "-q"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps"]["length"]["removed"] == {"too_long": 1}
    assert report["steps"]["length"]["examples"]["too_long"][0]["id"] == f"{src}:2"
    rows = pq.read_table(out / "shard-00000.parquet").column("line").to_pylist()
    assert rows == [1, 3]
