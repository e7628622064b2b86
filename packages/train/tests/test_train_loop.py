"""The training loop on the real MindSpore CPU backend: resume modes, guards, metrics.

None of these claims is about evaluation. The runs with run A's config up to graph-free
keys (B and its resumed process, the weights-only start C) keep its held-out set, so that
their graphs' compile-cache key is run A's and they load its compiled graphs; every other
run leaves the held-out set out (its graph would be a second compile per run). The skip
guards and the stop on consecutive non-finite steps share one run (`guarded`)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from mindloom_train._checkpoint import Checkpoint, read_tracker
from mindloom_train._trainer import EXIT_ANOMALY
from train_testutil import (
    SCHED,
    base_config,
    events,
    one_layer_config,
    read_metrics,
    run_cli,
    run_config,
    step_records,
)

_run = run_config


def _weights(step_dir: Path) -> dict[str, np.ndarray]:
    ck = Checkpoint(step_dir)
    return ck.load_tensors([n for n in ck.metadata["tensors"] if not n.startswith("exp_avg")])


def test_metrics_and_run_dir_follow_the_contract(run_a):
    recs = read_metrics(run_a)
    start = events(run_a, "start")[0]
    for key in ("run_name", "total_steps", "seed", "config_hash", "versions", "world_size"):
        assert key in start
    assert start["total_steps"] == 8 and start["seed"] == 7 and "mindspore" in start["versions"]
    steps = step_records(run_a)
    assert sorted(steps) == list(range(1, 9))
    for r in steps.values():
        for key in ("step", "time", "loss", "loss_smoothed", "lr", "grad_norm", "tokens_per_s", "mfu",
                    "step_time_s", "tokens", "consumed_samples", "data_wait_frac", "mem_rss_mb",
                    "skipped_steps"):  # fmt: skip
            assert key in r, key
    assert steps[8]["consumed_samples"] == 32 and steps[8]["tokens"] == 32 * 32
    assert steps[8]["loss"] < steps[1]["loss"]  # it learns
    assert [e["step"] for e in events(run_a, "eval")] == [8]
    assert math.isclose(events(run_a, "eval")[0]["ppl"], math.exp(events(run_a, "eval")[0]["loss"]))
    assert [e["step"] for e in events(run_a, "checkpoint")] == [8]
    end = recs[-1]
    assert end["event"] == "end" and end["status"] == "completed"
    cfg = yaml.safe_load((run_a / "config.yaml").read_text())
    assert cfg["training"]["train_iters"] == 8
    assert "eval: step 8" in (run_a / "train.log").read_text()
    assert read_tracker(run_a / "checkpoints") == 8
    meta = json.loads((run_a / "checkpoints" / "step_00000008" / "metadata.json").read_text())
    assert meta["tensors"]["embed.weight"]["global_shape"] == [65, 64]


def test_resume_is_bit_exact_in_a_new_process(prepared, run_a, tmp_path):
    """Run B: 4 steps, SIGTERM (saves, exits 0); a new process resumes to 8 = run A."""
    # run A's config to the key (held-out set included): B and its resumed process load run
    # A's compiled graphs from the compile cache instead of compiling their own
    cfg = base_config(prepared, tmp_path / "b", lr_scheduler=SCHED)
    assert _run(cfg, fault="sigterm@4") == 0
    end = events(tmp_path / "b", "end")[-1]
    assert end["status"] == "stopped" and end["step"] == 4
    assert read_tracker(tmp_path / "b" / "checkpoints") == 4
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli("train", str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from" in proc.stderr
    a, b = step_records(run_a), step_records(tmp_path / "b")
    for step in range(1, 9):
        for key in ("step_loss", "grad_norm", "lr", "consumed_samples"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    wa = _weights(run_a / "checkpoints" / "step_00000008")
    wb = _weights(tmp_path / "b" / "checkpoints" / "step_00000008")
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name])


def test_weights_only_start_has_fresh_optimizer_and_schedule(prepared, run_a, tmp_path):
    src = run_a / "checkpoints"
    # run A's graphs (init_from and train_iters are graph-free keys): cache hits
    cfg = base_config(prepared, tmp_path / "c", lr_scheduler=SCHED,
                      checkpoint={"init_from": str(src)}, training={"train_iters": 2})  # fmt: skip
    assert _run(cfg) == 0
    c, a = step_records(tmp_path / "c"), step_records(run_a)
    assert sorted(c) == [1, 2]
    assert c[1]["lr"] == a[1]["lr"]  # the warmup starts again
    assert c[1]["step_loss"] < a[1]["step_loss"] - 0.2  # trained weights, same first batch
    common = Checkpoint(tmp_path / "c" / "checkpoints" / "step_00000002").common
    assert common["adam_step"] == 2 and common["consumed_samples"] == 8
    assert "weights from" in (tmp_path / "c" / "train.log").read_text()


def test_resume_with_another_global_batch_keeps_consumed_samples(prepared, run_a, tmp_path):
    run = tmp_path / "d"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_a / "checkpoints" / "step_00000008", run / "checkpoints" / "step_00000008")
    (run / "checkpoints" / "latest").write_text("8\n")
    # one micro-batch of 8 (accumulation is test_pynative_and_accumulation's): one graph
    cfg = base_config(prepared, run, lr_scheduler=SCHED, eval_dataset=None,
                      training={"global_batch_size": 8, "micro_batch_size": 8, "train_iters": 6})  # fmt: skip
    assert _run(cfg) == 0
    recs = step_records(run)
    assert sorted(recs) == [5, 6]  # 32 consumed samples / 8 = step 4
    assert recs[5]["consumed_samples"] == 40 and recs[6]["consumed_samples"] == 48
    assert "consumed_samples 32 kept, step 8 -> 4" in (run / "train.log").read_text()


def test_start_from_hugging_face_weights(prepared, run_a, tmp_path):
    from mindloom_train._cli import main

    hf = tmp_path / "hf"
    assert main(["export-hf", "--checkpoint", str(run_a / "checkpoints"), "--out", str(hf)]) == 0
    assert (hf / "config.json").exists() and (hf / "model.safetensors").exists()
    cfg = base_config(prepared, tmp_path / "e", lr_scheduler=SCHED, eval_dataset=None,
                      training={"train_iters": 1})  # fmt: skip
    cfg["model"] = {"init_from_hf": str(hf)}
    assert _run(cfg) == 0
    e, a = step_records(tmp_path / "e"), step_records(run_a)
    assert e[1]["step_loss"] < a[1]["step_loss"] - 0.2


@pytest.fixture(scope="module")
def guarded(prepared, tmp_path_factory) -> tuple[Path, int]:
    """One run for both guard tests: a NaN loss, an Inf gradient and a gradient spike, each
    skipped alone (steps 2, 4, 6; step 7 saved), then NaN losses at 8 and 9, two in a row,
    which stop the run at step 9 (max_consecutive_skips 2). One layer: nothing here is
    compared with another run, and the guards do not depend on the size. -> (run dir, exit
    code)."""
    run = tmp_path_factory.mktemp("guarded") / "g"
    # grad_spike_threshold 1000 and max_consecutive_skips 2 are one_layer_config's own
    cfg = one_layer_config(
        prepared, run, training={"train_iters": 10}, checkpoint={"save_interval": 7}
    )
    return run, _run(cfg, fault="nan_loss@2,inf_grad@4,grad_spike@6,nan_loss@8-9")


def test_guards_skip_count_and_report(guarded):
    run, _ = guarded
    anomalies = [(e["step"], e["kind"], e["action"]) for e in events(run, "anomaly")]
    assert anomalies[:3] == [(2, "nonfinite_loss", "skipped"), (4, "nonfinite_grad", "skipped"),
                             (6, "grad_spike", "skipped")]  # fmt: skip
    recs = step_records(run)
    assert [recs[s]["skipped_steps"] for s in range(1, 8)] == [0, 1, 1, 2, 2, 3, 3]
    assert recs[2]["loss"] is None  # non-finite is written as null
    common = Checkpoint(run / "checkpoints" / "step_00000007").common
    assert common["adam_step"] == 4 and common["skipped_steps"] == 3


def test_consecutive_nonfinite_stops_with_last_good_weights(guarded):
    run, code = guarded
    assert code == EXIT_ANOMALY
    end = events(run, "end")[-1]
    assert end["status"] == "stopped" and "step 9 rank 0" in end["reason"]
    anomalies = [(e["step"], e["kind"], e["action"]) for e in events(run, "anomaly")]
    assert anomalies[3:] == [(8, "nonfinite_loss", "skipped"), (9, "nonfinite_loss", "stopped")]
    w7 = _weights(run / "checkpoints" / "step_00000007")
    w9 = _weights(run / "checkpoints" / "step_00000009")
    for name in w7:
        np.testing.assert_array_equal(w7[name], w9[name])
    assert read_tracker(run / "checkpoints") == 9


def test_pynative_and_accumulation_match_the_compiled_step(prepared, run_a, tmp_path):
    a = step_records(run_a)
    cfg = base_config(prepared, tmp_path / "p", lr_scheduler=SCHED, training={"train_iters": 2},
                      context={"mode": "pynative"}, eval_dataset=None)  # fmt: skip
    assert _run(cfg) == 0
    p = step_records(tmp_path / "p")
    cfg = base_config(prepared, tmp_path / "acc", lr_scheduler=SCHED, eval_dataset=None,
                      training={"train_iters": 2, "micro_batch_size": 2})  # fmt: skip
    assert _run(cfg) == 0
    acc = step_records(tmp_path / "acc")
    for step in (1, 2):
        assert p[step]["step_loss"] == pytest.approx(a[step]["step_loss"], rel=1e-5)
        assert acc[step]["step_loss"] == pytest.approx(a[step]["step_loss"], rel=1e-5)
        assert acc[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4)


def test_resume_problems_are_explicit(prepared, run_a, tmp_path, capsys):
    # resume=required with nothing to resume: non-zero
    cfg = base_config(prepared, tmp_path / "r1", checkpoint={"resume": "required"})
    assert _run(cfg) == 1
    assert "resume=required" in events(tmp_path / "r1", "end")[-1]["reason"]
    # a bad tracker: non-zero, names the file
    run = tmp_path / "r2"
    shutil.copytree(run_a / "checkpoints", run / "checkpoints")
    (run / "checkpoints" / "latest").write_text("abc")
    assert _run(base_config(prepared, run, lr_scheduler=SCHED)) == 1
    assert "latest: holds 'abc'" in events(run, "end")[-1]["reason"]
    # a changed schedule is refused unless overridden
    (run / "checkpoints" / "latest").write_text("8\n")
    sched = {**SCHED, "lr": 1.0e-2}
    assert _run(base_config(prepared, run, lr_scheduler=sched, training={"train_iters": 9})) == 1
    assert "LR schedule differs" in events(run, "end")[-1]["reason"]
    # a tensor missing from the checkpoint is an error, never a partial load
    meta_path = run / "checkpoints" / "step_00000008" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    del meta["tensors"]["norm.weight"]
    meta_path.write_text(json.dumps(meta))
    assert _run(base_config(prepared, run, lr_scheduler=SCHED)) == 1
    assert "missing tensor 'norm.weight'" in events(run, "end")[-1]["reason"]
