import os

from mindloom_monitor._records import parse_lines
from mindloom_monitor._source import RunSource
from mindloom_monitor._tail import Follower, read_initial, read_last_lines


def test_follower_waits_for_the_file_then_returns_complete_lines_only(tmp_path):
    path = tmp_path / "m.jsonl"
    f = Follower(path)
    assert f.poll().lines == [] and not f.is_open
    path.write_bytes(b'{"step": 1}\n{"step": 2')
    chunk = f.poll()
    assert chunk.notes == ["appeared"]
    assert chunk.lines == [b'{"step": 1}']
    assert f.poll().lines == []  # the partial line waits
    with open(path, "ab") as fh:
        fh.write(b', "loss": 1.0}\n')
    assert f.poll().lines == [b'{"step": 2, "loss": 1.0}']
    f.close()


def test_follower_detects_truncation(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"a\nb\nc\n")
    f = Follower(path)
    assert f.poll().lines == [b"a", b"b", b"c"]
    path.write_bytes(b"x\n")  # shorter than what was read: truncated and rewritten
    chunk = f.poll()
    assert chunk.notes == ["truncated"]
    assert chunk.lines == [b"x"]
    f.close()


def test_follower_detects_a_rewrite_that_outgrew_the_old_content(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n')
    f = Follower(path)
    assert len(f.poll().lines) == 2
    # truncated and rewritten, same inode, longer than before, between two polls
    path.write_bytes(b'{"step": 100, "loss": 1.0}\n{"step": 101, "loss": 1.0}\n')
    chunk = f.poll()
    assert chunk.notes == ["truncated"]
    assert chunk.lines == [b'{"step": 100, "loss": 1.0}', b'{"step": 101, "loss": 1.0}']
    with open(path, "ab") as fh:  # a plain append is still just an append
        fh.write(b'{"step": 102}\n')
    chunk = f.poll()
    assert chunk.notes == [] and chunk.lines == [b'{"step": 102}']
    f.close()


def test_follower_detects_replacement_and_drains_the_old_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"a\n")
    f = Follower(path)
    assert f.poll().lines == [b"a"]
    with open(path, "ab") as fh:
        fh.write(b"b\n")  # written just before rotation
    os.rename(path, tmp_path / "m.jsonl.1")
    assert f.poll().lines == [b"b"]  # file gone: the open handle is drained
    path.write_bytes(b"new1\nnew2\nnew3\n")  # a new file, bigger than the old one
    chunk = f.poll()
    assert chunk.notes == ["replaced"]
    assert chunk.lines == [b"new1", b"new2", b"new3"]
    f.close()


def test_follower_drops_over_long_garbage(tmp_path, monkeypatch):
    import mindloom_monitor._tail as tail

    monkeypatch.setattr(tail, "MAX_LINE", 100)
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"x" * 500 + b"\nok\n" + b"y" * 300)
    f = Follower(path)
    chunk = f.poll()
    assert chunk.lines == [b"ok"] and chunk.dropped == 2
    f.close()


def test_read_initial_small_file_reads_everything(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"1\n2\n3\npart")
    init = read_initial(path)
    assert init.tail == [b"1", b"2", b"3"] and init.partial == b"part"
    assert init.end_pos == len(b"1\n2\n3\n")


def test_million_line_file_is_opened_from_the_tail_and_sampled(million_run):
    path = million_run / "metrics.jsonl"
    init = read_initial(path, tail_bytes=1 << 20, samples=500)
    n_lines = len(init.head) + len(init.sampled) + len(init.tail)
    # bounded by the budgets, not by the file: 64 KiB head + 500 samples + 1 MiB tail
    assert n_lines < 60_000
    res = parse_lines(init.tail)
    assert res.skipped == 0
    assert res.records[-1].step == 1_000_000
    steps = [r.step for r in parse_lines(init.sampled).records]
    assert len(steps) >= 450 and steps == sorted(steps)
    # the samples cover the middle of the file evenly
    assert steps[0] < 10_000 and steps[-1] > 900_000
    head = parse_lines(init.head).records
    assert head[0].kind == "start"
    assert head[-1].step < steps[0] and steps[-1] < res.records[0].step


def test_run_source_batches(tmp_path):
    (tmp_path / "train.log").write_text("".join(f"line {i}\n" for i in range(1000)) + "partial")
    src = RunSource(str(tmp_path))
    first = src.initial()
    assert first.initial and not first.metrics_exists and first.records == []
    assert len(first.log_lines) == 500 and first.log_lines[-1] == "line 999"
    assert src.poll() is None  # nothing changed: no message
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\ngarbage\n')
    with open(tmp_path / "train.log", "a") as fh:
        fh.write(" done\n")
    batch = src.poll()
    assert batch.metrics_exists and [r.step for r in batch.records] == [1]
    assert batch.skipped == 1 and batch.log_lines == ["partial done"]
    src.close()


def test_read_last_lines(tmp_path):
    path = tmp_path / "train.log"
    path.write_text("".join(f"l{i}\n" for i in range(100_000)))
    init = read_last_lines(path, 10, max_bytes=4096)
    assert init.tail == [f"l{i}".encode() for i in range(99_990, 100_000)]


def test_attach_rereads_a_file_replaced_after_the_initial_read(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"old1\nold2\n")
    init = read_initial(path)
    tmp = tmp_path / "new"
    tmp.write_bytes(b"new1\nnew2\nnew3\n")
    os.rename(tmp, path)  # replaced between the read and following
    f = Follower(path)
    assert f.attach(init.end_pos, ident=init.ident)
    assert f.poll().lines == [b"new1", b"new2", b"new3"]
    f.close()
