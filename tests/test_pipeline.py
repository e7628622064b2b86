"""The README's main job end to end: `mindloom demo --quick` on the bundled corpus, across
every package (data clean -> tokenizer -> tokenize/pack -> train -> checkpoint -> sample),
and the run directory it leaves opened by mindloom-monitor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_demo_runs_the_whole_pipeline_and_the_monitor_reads_it(tmp_path, capsys):
    run = tmp_path / "demo"
    env = {**os.environ, "GLOG_v": "3"}
    env.pop("MINDLOOM_FAULT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "mindloom_train._cli", "demo", "--quick", "--run-dir", str(run)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    out = proc.stdout
    # every stage ran for real (a skipped stage would say SKIPPED)
    assert "SKIPPED" not in out
    assert "stage 1/5 clean" in out and (run / "cleaned" / "report.json").exists()
    assert (run / "tokenizer" / "tokenizer.model").exists() or (
        run / "tokenizer" / "mindloom_tokenizer.json"
    ).exists()
    for split in ("train", "eval"):
        assert (run / "data" / f"{split}.bin").stat().st_size > 0
        assert (run / "data" / f"{split}.idx").exists()
    assert "----- sample (prompt 'ROMEO:') -----" in out
    sample = out.split("----- sample (prompt 'ROMEO:') -----\n", 1)[1].split("\n---", 1)[0]
    assert sample.startswith("ROMEO:") and len(sample) > len("ROMEO:")
    assert "held-out loss" in out and "perplexity" in out
    # the run directory follows the contract
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r.get("event") for r in records]
    for kind in ("start", "eval", "checkpoint", "end"):
        assert kind in kinds, kind
    assert records[-1]["event"] == "end" and records[-1]["status"] == "completed"
    steps = [r for r in records if "event" not in r]
    assert steps[-1]["step"] == 30 and steps[-1]["loss"] < steps[0]["loss"]
    assert (run / "config.yaml").exists() and (run / "train.log").exists()
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == "30" and (run / "checkpoints" / "step_00000030" / "common.json").exists()
    # mindloom-monitor opens it (plain-text summary mode)
    from mindloom_monitor._cli import main as monitor_main

    capsys.readouterr()
    assert monitor_main(["--once", str(run)]) == 0
    summary = capsys.readouterr().out
    assert Path(run).name in summary or str(run) in summary
    assert "last metrics (step 30): loss " in summary  # the last step's line, not any "30"


def test_demo_refuses_to_replace_a_directory_it_did_not_write(tmp_path, capsys):
    from mindloom_train._cli import main

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a demo run")
    assert main(["demo", "--quick", "--run-dir", str(mine)]) == 2
    assert (mine / "notes.txt").read_text() == "not a demo run"
    assert "is not a previous demo run" in capsys.readouterr().err
