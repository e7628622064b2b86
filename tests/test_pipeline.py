"""The README's main job end to end: `mindloom demo --quick` on the bundled corpus, across
every package (data clean -> tokenizer -> tokenize/pack -> train -> checkpoint -> sample),
and the run directory it leaves opened by mindloom-monitor.

One demo run (a subprocess, as a user starts it) is shared by every test here: held-out
loss falls at every evaluation, the run records the data's BOS/EOS contract, `generate`
feeds the model prompts made as the training documents were, and `--checkpoint best` picks
the checkpoint with the lowest recorded held-out loss (these were test_train_demo.py in the
train suite, which ran the same demo a second time)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
from mindloom_train import main


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("demo") / "run"
    env = {**os.environ, "GLOG_v": "3"}
    env.pop("MINDLOOM_FAULT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "mindloom_train", "demo", "--quick", "--run-dir", str(run)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    (run / "demo-stdout.txt").write_text(proc.stdout)
    return run


def test_demo_runs_the_whole_pipeline_and_the_monitor_reads_it(demo, capsys):
    run = demo
    out = (run / "demo-stdout.txt").read_text()
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
    from mindloom_monitor import main as monitor_main

    capsys.readouterr()
    assert monitor_main(["--once", str(run)]) == 0
    summary = capsys.readouterr().out
    assert Path(run).name in summary or str(run) in summary
    assert "last metrics (step 30): loss " in summary  # the last step's line, not any "30"


def test_demo_refuses_to_replace_a_directory_it_did_not_write(tmp_path, capsys):
    from mindloom_train import main

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a demo run")
    assert main(["demo", "--quick", "--run-dir", str(mine)]) == 2
    assert (mine / "notes.txt").read_text() == "not a demo run"
    assert "is not a previous demo run" in capsys.readouterr().err


def _events(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == kind]


def _common(step_dir: Path) -> dict:
    return json.loads((step_dir / "common.json").read_text())


def _set_common(step_dir: Path, **changes) -> None:
    c = _common(step_dir)
    c.update(changes)
    (step_dir / "common.json").write_text(json.dumps(c))


def test_quick_demo_held_out_loss_falls_at_every_evaluation(demo):
    evals = _events(demo, "eval")
    assert [e["step"] for e in evals] == [10, 20, 30]  # step-bounded: the same every time
    losses = [e["loss"] for e in evals]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_run_records_the_bos_contract_of_its_data(demo):
    sp = spm.SentencePieceProcessor(model_file=str(demo / "tokenizer" / "tokenizer.model"))
    data = json.loads((demo / "data" / "train.dataset.json").read_text())
    assert data["append_bos"] is True and data["bos_id"] == sp.bos_id()
    want = {"append_bos": True, "append_eos": True, "bos_id": sp.bos_id(), "eos_id": sp.eos_id()}
    start = _events(demo, "start")[0]
    assert {k: start["data_contract"][k] for k in want} == want
    common = _common(demo / "checkpoints" / "step_00000030")
    assert {k: common["data_contract"][k] for k in want} == want
    # the training data really starts every document with BOS (megatron-free check: the .bin)
    from mindloom_data import IndexedDataset

    ds = IndexedDataset(str(demo / "data" / "train"))
    assert all(ds[i][0] == sp.bos_id() for i in range(len(ds)))
    assert "documents start with BOS" in (demo / "train.log").read_text()
    assert "prompt starts with BOS" in (demo / "demo-stdout.txt").read_text()


def _generate(capsys, ckpt, *extra) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["generate", "--checkpoint", str(ckpt), "--prompt", "ROMEO:",
               "--max-new-tokens", "4", *extra])  # fmt: skip
    out = capsys.readouterr()
    return rc, out.out, out.err


def _fed_ids(err: str) -> list[int]:
    line = next(x for x in err.splitlines() if "prompt ids" in x)
    return json.loads(line.split("prompt ids ", 1)[1])


def test_generate_feeds_the_prompt_as_the_training_data_began(demo, tmp_path, capsys):
    sp = spm.SentencePieceProcessor(model_file=str(demo / "tokenizer" / "tokenizer.model"))
    prompt = sp.encode("ROMEO:")
    rc, _, err = _generate(capsys, demo / "checkpoints")
    assert rc == 0, err
    assert _fed_ids(err) == [sp.bos_id(), *prompt] and "as the training documents did" in err
    # the same weights trained on documents without BOS: no BOS in front of the prompt
    copy = tmp_path / "step_00000030"
    shutil.copytree(demo / "checkpoints" / "step_00000030", copy)
    contract = _common(copy)["data_contract"]
    _set_common(copy, data_contract={**contract, "append_bos": False})
    rc, _, err = _generate(capsys, copy)
    assert rc == 0, err
    assert _fed_ids(err) == prompt and "prompt without BOS" in err


def test_generate_reports_a_tokenizer_without_the_datas_bos(demo, tmp_path, capsys):
    from mindloom_tokenizer import train_tokenizer

    tok = tmp_path / "nobos"
    train_tokenizer([str(demo / "data" / "train.jsonl")], tok, vocab_size=512, bos_id=-1)
    rc, _, err = _generate(capsys, demo / "checkpoints", "--tokenizer", str(tok))
    assert rc == 1 and "started documents with BOS" in err and len(err.strip().splitlines()) == 1


def test_held_out_data_made_otherwise_is_reported(demo, tmp_path):
    from mindloom_data import tokenize
    from mindloom_tokenizer import Tokenizer
    from mindloom_train import ConfigError, data_contract

    tok = Tokenizer.load(demo / "tokenizer")
    tokenize(demo / "data" / "eval.jsonl", demo / "tokenizer", tmp_path / "nobos", append_bos=False)
    train = str(demo / "data" / "train")
    assert data_contract([train], [str(demo / "data" / "eval")], tok)["append_bos"] is True
    with pytest.raises(ConfigError, match="eval_dataset.append_bos"):
        data_contract([train], [str(tmp_path / "nobos")], tok)
    with pytest.raises(ConfigError, match="train_dataset.data_prefix"):
        data_contract([train, str(tmp_path / "nobos")], None, tok)


def test_each_checkpoint_records_the_held_out_loss_of_its_step(demo):
    by_step = {e["step"]: e["loss"] for e in _events(demo, "eval")}
    dirs = sorted((demo / "checkpoints").glob("step_*"))
    assert [int(d.name[5:]) for d in dirs] == [10, 20, 30]  # all kept for `best`
    for d in dirs:
        ev = _common(d)["eval"]
        assert ev == {"step": int(d.name[5:]), "loss": by_step[ev["step"]]}


def test_checkpoint_best(demo, tmp_path, capsys):
    save = tmp_path / "checkpoints"
    shutil.copytree(demo / "checkpoints", save)
    # make step 20 the best on record: best is what was recorded, not the newest
    _set_common(save / "step_00000020", eval={"step": 20, "loss": 0.5})
    rc, out, err = _generate(capsys, save / "best")
    assert rc == 0, err
    assert "step_00000020" in err and "generate: step 20;" in err and out.strip()
    # a run directory stands for its checkpoints
    (tmp_path / "checkpoints" / "step_00000030").rename(tmp_path / "moved")
    rc, _, err = _generate(capsys, tmp_path / "best")
    assert rc == 0 and "generate: step 20;" in err
    # export-hf writes exactly step 20's weights
    capsys.readouterr()
    assert (
        main(["export-hf", "--checkpoint", str(save / "best"), "--out", str(tmp_path / "hf")]) == 0
    )
    assert "step 20" in capsys.readouterr().out
    from mindloom_train import open_checkpoint
    from safetensors.numpy import load_file

    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    ours = open_checkpoint(save / "step_00000020").load_tensors()
    emb = next(k for k in ours if "embed" in k)
    assert (hf["model.embed_tokens.weight"] == ours[emb]).all()


def test_checkpoint_best_without_recorded_losses_is_one_line(demo, tmp_path, capsys):
    save = tmp_path / "checkpoints"
    shutil.copytree(demo / "checkpoints", save)
    for d in save.glob("step_*"):
        _set_common(d, eval=None)
    rc, _, err = _generate(capsys, save / "best")
    assert rc == 1 and "no checkpoint records a held-out loss" in err
    assert len(err.strip().splitlines()) == 1
