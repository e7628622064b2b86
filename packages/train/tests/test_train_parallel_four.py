"""`mindloom launch --nproc 4` with tensor, sequence and pipeline parallel together (tp2 +
sp inside each of two compiled pipeline stages: `_pp_step` over `PipelineGraph`), against
one process (real msrun, 4 CPU workers).

Opt-in (`slow`, ~110 CPU-s for the four workers' start and compiles): the default suite
holds the same numerics at the `PipelineGraph` level (`tp2_pp2_sp_compiled` in
mindloom-parallel's 4-worker launch, losses and weights against one process) and the
trainer's glue around `PipelineGraph` (guards, per-rank checkpoints, evaluation, resume) in
the 2-worker pp2 launch of `test_train_parallel_launch.py`; what only this file runs is the
two together through the trainer. docs/testing.md lists it.

- R: one process, 4 steps, the global batch of 4, saves at steps 2 and 4;
- L: tp2 x pp2 + sp, 2 micro-batches of 2, the same saves;
- O: L's step-2 checkpoint (8 files: every rank its tp slice of its stage) resumed on one
  process for steps 3-4.
Tied embeddings (the first and last stage sum the embedding's gradient) and a vocabulary
split over tp (66 ids).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from train_testutil import (
    SCHED,
    base_config,
    events,
    run_config,
    start_launch,
    step_records,
    stop_launches,
    wait_launches,
)

pytestmark = [pytest.mark.msrun, pytest.mark.slow]

STEPS, SAVE = 4, 2
LAYOUT = {"tp": 2, "pp": 2, "sequence_parallel": True, "micro_batch_num": 2}


def _config(prepared, run: Path, **sections) -> dict:
    cfg = base_config(prepared, run, lr_scheduler=SCHED,
                      model={"preset": "debug", "vocab_size": 66, "tie_embeddings": True},
                      checkpoint={"save_interval": SAVE, "keep_last": 2})  # fmt: skip
    cfg["training"]["train_iters"] = STEPS
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel_four")
    out = {"ref": root / "ref", "l": root / "l"}
    cfg = _config(prepared, out["l"], parallelism=LAYOUT, training={"micro_batch_size": 2})
    procs = {"l": start_launch(cfg, root / "l.yaml", nproc=4, timeout_s=500)}
    try:
        assert run_config(_config(prepared, out["ref"])) == 0  # while the workers start
        wait_launches(procs, timeout_s=560)
    finally:
        stop_launches(procs, {"l": out["l"] / "msrun_logs"})
    out["l_cfg"] = cfg
    return out


def test_tp2_pp2_sp_runs_the_compiled_stages_and_equals_one_process(runs):
    logs = sorted((runs["l"] / "msrun_logs").glob("worker_*.log"))
    assert len(logs) == 4
    for log in logs:
        assert "compiled pipeline parallel" in log.read_text(errors="replace"), log.name
    got, ref = step_records(runs["l"]), step_records(runs["ref"])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step]["step_loss"] == pytest.approx(ref[step]["step_loss"], rel=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
        assert got[step]["consumed_samples"] == ref[step]["consumed_samples"]
        assert len(got[step]["comm_s_ranks"]) == 4 and got[step]["comm_s"] > 0
    ev, ref_ev = events(runs["l"], "eval")[-1], events(runs["ref"], "eval")[-1]
    assert ev["step"] == ref_ev["step"] == STEPS and 0 < ev["loss"] < 10
    assert events(runs["l"], "start")[0]["world_size"] == 4


def test_tp2_pp2_sp_final_weights_and_moments_equal_one_process(runs):
    from mindloom_train._checkpoint import open_checkpoint

    a = open_checkpoint(runs["l"] / "checkpoints").load_tensors()
    b = open_checkpoint(runs["ref"] / "checkpoints").load_tensors()
    assert set(a) == set(b) and "lm_head.weight" not in a  # tied: one embedding tensor
    # as test_train_parallel_launch.py: an element whose gradient is ~0 may move by up to lr
    tol = {"exp_avg.": (1e-3, 1e-7), "exp_avg_sq.": (1e-3, 1e-10)}
    for name in a:
        rtol, atol = next((v for k, v in tol.items() if name.startswith(k)), (1e-4, 2e-5))
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


def test_tp2_pp2_sp_checkpoint_resumes_on_one_process(runs, tmp_path):
    step_dir = runs["l"] / "checkpoints" / "step_00000002"
    # every rank wrote its own files: its tp slice of its stage
    assert len(list(step_dir.glob("model-*.safetensors"))) == 4
    save = tmp_path / "ckpt"
    save.mkdir()
    shutil.copytree(step_dir, save / "step_00000002")
    (save / "latest").write_text(f"{SAVE}\n")
    cfg = {k: v for k, v in runs["l_cfg"].items() if k not in ("eval_dataset", "parallelism")}
    cfg["training"] = {**cfg["training"], "micro_batch_size": 4}
    cfg["run_dir"] = str(tmp_path / "resumed")
    cfg["checkpoint"] = {**cfg["checkpoint"], "save_path": str(save), "resume": "required"}
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(cfg))
    from mindloom_train._cli import main

    assert main(["train", str(path)]) == 0
    got, ref = step_records(tmp_path / "resumed"), step_records(runs["ref"])
    assert sorted(got) == [3, 4]
    for step in got:
        assert got[step]["step_loss"] == pytest.approx(ref[step]["step_loss"], rel=1e-5), step
    assert events(tmp_path / "resumed", "start")[0]["resumed_from"].endswith("step_00000002")
