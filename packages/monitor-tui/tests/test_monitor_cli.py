import json
import os
import shutil
import subprocess
import sys

import pytest
from mindloom_monitor._cli import main
from monitor_helpers import metric, write_run


def test_once_prints_a_summary_and_exits_zero(run_dir, capsys):
    assert main(["--once", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "run: tiny" in out
    assert "step 300/1000 (30.0%)" in out
    assert "last checkpoint: step 300 checkpoints/step_00000300" in out
    assert "tokens seen: 1.23M" in out
    assert f"loss {metric(300)['loss']:.4g}" in out
    assert "last eval (step 300): loss 2.4  ppl 11" in out
    assert "checkpoint: saved checkpoints/step_00000300" in out
    assert "skipped lines: 0" in out
    plot = out.split("loss (smoothed):\n", 1)[1].splitlines()
    assert len(plot) == 10 and "*" in "".join(plot)
    assert plot[-1].strip().startswith("step 1") and plot[-1].rstrip().endswith("step 300")


def test_once_counts_bad_lines_and_a_partial_last_line(tmp_path, capsys):
    run = write_run(tmp_path / "run", 50, extra=["garbage", '{"step": 51, "loss": NaN}', "[1]"])
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 52, "lo')  # the writer was killed mid-line
    assert main(["--once", str(run)]) == 0
    out = capsys.readouterr().out
    assert "skipped lines: 3" in out  # garbage, [1], the partial line
    assert "nan: non-finite loss (NaN)" in out
    assert "last metrics (step 51)" in out


def test_once_on_a_directory_without_metrics(tmp_path, capsys):
    assert main(["--once", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "status: waiting; no metrics yet (metrics.jsonl not found)" in out


def test_missing_directory_is_one_line_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["--once", str(missing)]) == 2
    assert main([str(missing)]) == 2  # also without --once: no app is started
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: run directory '{missing}': no such directory"] * 2
    (tmp_path / "file").write_text("x")
    assert main([str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_unknown_option_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--bogus", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments: --bogus" in err[0]


def test_console_script_once(run_dir, tmp_path):
    exe = shutil.which("mindloom-monitor", path=os.path.dirname(sys.executable))
    assert exe, "the console script is installed with the package"
    # unknown fields and an unknown event are accepted
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(metric(301, brand_new=1.5, note="x")) + "\n")
        fh.write(json.dumps({"event": "profile", "time": 1.0, "step": 301}) + "\n")
    res = subprocess.run([exe, "--once", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (
        "last metrics (step 301)" in res.stdout
        and "profile: (an event this monitor does not know)" in res.stdout
    )
    res = subprocess.run(
        [exe, str(tmp_path / "missing")], capture_output=True, text=True, timeout=60
    )
    assert (
        res.returncode == 2
        and res.stderr.startswith("error: run directory")
        and "Traceback" not in res.stderr
    )


def test_once_refuses_a_fifo_as_metrics_in_one_line(tmp_path):
    """issue 23 item 10: a FIFO as metrics.jsonl hung `--once` in its open(); now one line.
    Run in a subprocess with a timeout, so the old behaviour fails the test, not the suite."""
    os.mkfifo(tmp_path / "metrics.jsonl")
    cmd = [sys.executable, "-m", "mindloom_monitor", "--once", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'metrics.jsonl'}: not a regular file; refusing to read it"
    ]


def test_tail_readers_treat_a_fifo_as_absent(tmp_path):
    """The TUI's readers (after start-up, a FIFO may appear in place of the log) never
    block on one: read_initial and read_last_lines report it absent, a follower does not attach."""
    import threading

    from mindloom_monitor._tail import Follower, read_initial, read_last_lines

    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    results = []

    def read_all():
        results.append(read_initial(fifo).exists)
        results.append(read_last_lines(fifo, 5).exists)
        results.append(Follower(fifo).attach(0))

    t = threading.Thread(target=read_all, daemon=True)
    t.start()
    t.join(timeout=30)
    if t.is_alive():  # unblock the reader so the test process can end
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        pytest.fail("a reader blocked on the FIFO")
    assert results == [False, False, False]
