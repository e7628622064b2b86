"""`mindloom launch --nproc 4` with tensor parallel composed with pipeline parallel and with
ZeRO-1, against one process (real msrun, 4 CPU workers each, both launches at once):

- L: tp2 x pp2 + sp (the compiled stages `_pp_step` over `PipelineGraph`, tp's region cells
  inside each stage), 2 micro-batches of 2;
- Z: dp2 x tp2 + sp + ZeRO-1 (the compiled tp step with `ZeroShardUpdate` over each tp
  rank's data-parallel group), 2 micro-batches of 1 per rank;
- R: one process, the global batch of 4; every run 4 steps, saves at steps 2 and 4;
- each launch's step-2 checkpoint (every rank its own files) resumed on one process.
Tied embeddings (pp: the first and last stage sum the embedding's gradient) and a
vocabulary split over tp (66 ids).

In the default suite since session 25 (opt-in, `slow`, from session 16): the default
suite holds L's numerics at the `PipelineGraph` level (`tp2_pp2_sp_compiled` in
mindloom-parallel's 4-worker launch) and the compiled tp step and the compiled ZeRO-1
update each in a 2-worker launch of `test_train_parallel_launch.py`, but only this file
runs them composed through the trainer (the stages' tp shards in per-rank checkpoints,
ZeRO-1 ownership over each tp rank's dp group). ~100 CPU-s here (MINDLOOM_TEST_CPU,
2026-12-04: eight workers starting and compiling, 56 s wall alone).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from train_testutil import (
    events,
    layout_config,
    run_config,
    start_launch,
    step_records,
    stop_launches,
    wait_launches,
)

pytestmark = pytest.mark.msrun

STEPS, SAVE = 4, 2
LAYOUTS = {
    "l": ({"tp": 2, "pp": 2, "sequence_parallel": True, "micro_batch_num": 2},
          {"micro_batch_size": 2}),
    "z": ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 1},
          {"micro_batch_size": 1}),
}  # fmt: skip
STEP_LINE = {"l": "compiled pipeline parallel", "z": "ZeRO-1 in the compiled tensor-parallel step"}


def _config(prepared, run: Path, **sections) -> dict:
    return layout_config(prepared, run, STEPS, SAVE, **sections)


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel_four")
    out = {"ref": root / "ref"}
    procs = {}
    for name, (parallelism, training) in LAYOUTS.items():
        out[name] = root / name
        cfg = _config(prepared, out[name], parallelism=parallelism, training=training)
        procs[name] = start_launch(cfg, root / f"{name}.yaml", nproc=4, timeout_s=700)
        out[name + "_cfg"] = cfg
    try:
        assert run_config(_config(prepared, out["ref"])) == 0  # while the workers start
        wait_launches(procs, timeout_s=760)
    finally:
        stop_launches(procs, {name: out[name] / "msrun_logs" for name in procs})
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_launch_runs_its_compiled_step_and_equals_one_process(runs, name):
    logs = sorted((runs[name] / "msrun_logs").glob("worker_*.log"))
    assert len(logs) == 4
    for log in logs:
        assert STEP_LINE[name] in log.read_text(errors="replace"), log.name
    got, ref = step_records(runs[name]), step_records(runs["ref"])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step]["step_loss"] == pytest.approx(ref[step]["step_loss"], rel=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
        assert got[step]["consumed_samples"] == ref[step]["consumed_samples"]
        assert len(got[step]["comm_s_ranks"]) == 4 and got[step]["comm_s"] > 0
    # (the held-out batches follow each layout's micro-batch size: other samples than R's
    # for Z, whose ranks evaluate micro-batches of 1)
    ev, ref_ev = events(runs[name], "eval")[-1], events(runs["ref"], "eval")[-1]
    assert ev["step"] == ref_ev["step"] == STEPS and 0 < ev["loss"] < 10
    assert events(runs[name], "start")[0]["world_size"] == 4


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_final_weights_and_moments_equal_one_process(runs, name):
    from mindloom_train._checkpoint import open_checkpoint

    a = open_checkpoint(runs[name] / "checkpoints").load_tensors()
    b = open_checkpoint(runs["ref"] / "checkpoints").load_tensors()
    assert set(a) == set(b) and "lm_head.weight" not in a  # tied: one embedding tensor
    # as test_train_parallel_launch.py: an element whose gradient is ~0 may move by up to lr
    tol = {"exp_avg.": (1e-3, 1e-7), "exp_avg_sq.": (1e-3, 1e-10)}
    for name in a:
        rtol, atol = next((v for k, v in tol.items() if name.startswith(k)), (1e-4, 2e-5))
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


def test_zero1_ranks_write_the_moments_they_own(runs):
    """Z's step-2 checkpoint: every moment block written once, by the data-parallel rank
    that owns the tensor (both moments of a tensor by the same one, each tp rank its
    slice), each dp rank owning part of the tensors; the weights by dp rank 0 only."""
    import json

    meta = json.loads((runs["z"] / "checkpoints" / "step_00000002" / "metadata.json").read_text())
    rank_of = lambda chunk: int(chunk["file"].split("-")[1])  # noqa: E731
    tp = 2  # rank = dp_rank * tp + tp_rank
    owner = {}
    for name, spec in meta["tensors"].items():
        ranks = [rank_of(c) for c in spec["chunks"]]
        offsets = [tuple(c["offset"]) for c in spec["chunks"]]
        assert (
            len(set(offsets)) == len(offsets) == (tp if spec["split"]["tp_axis"] is not None else 1)
        ), name
        dp_ranks = {r // tp for r in ranks}
        assert len(dp_ranks) == 1, (name, ranks)  # one owner (or dp rank 0 for weights)
        if name.startswith("exp_avg"):
            owner[name] = dp_ranks.pop()
        else:
            assert dp_ranks == {0}, name
    for name, dp_rank in owner.items():
        if name.startswith("exp_avg."):
            assert owner["exp_avg_sq." + name[len("exp_avg.") :]] == dp_rank, name
    assert set(owner.values()) == {0, 1}  # the state is split over the data-parallel ranks


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_launch_checkpoint_resumes_on_one_process(runs, name, tmp_path):
    step_dir = runs[name] / "checkpoints" / "step_00000002"
    save = tmp_path / "ckpt"
    save.mkdir()
    shutil.copytree(step_dir, save / "step_00000002")
    (save / "latest").write_text(f"{SAVE}\n")
    cfg = {k: v for k, v in runs[name + "_cfg"].items() if k not in ("eval_dataset", "parallelism")}
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
