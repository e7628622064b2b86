"""`mindloom launch` under tensor and pipeline parallel layouts (real msrun, 2 CPU workers).

One reference run on one process, one tp=2 launch with sequence parallelism (the compiled
step, `_tp_step`, since issue 16: context.mode graph is the default), one pp=2
launch (2 micro-batches, compiled stage graphs: `_pp_step`) and one dp=2 ZeRO-1 launch (the compiled step, `_zero_step`), all with tied embeddings (so pp2 sums
the embedding's gradient over its first and last stage); every assertion below reuses
them: losses, final weights and AdamW moments against the one-process run, comm fields in
metrics.jsonl, checkpoint metadata, and resume of each layout's checkpoint on one process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from mindloom_train._faults import BALLAST_MB
from train_testutil import (
    base_config,
    events,
    layout_config,
    run_config,
    step_records,
    stop_launches,
    wait_launches,
)
from train_testutil import start_launch as _launch

STEPS = 4
SAVE = 2  # the launches save at steps 2 and 4; the resume tests start from step 2


def _config(prepared, run: Path, **sections) -> dict:
    return layout_config(prepared, run, STEPS, SAVE, **sections)


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel_launch")
    out = {"root": root}
    layouts = {
        # its step-2 save runs in the background (issue 16: every rank its own files, the
        # commit at the first step every rank has finished writing by)
        "tp2_sp": {"parallelism": {"tp": 2, "sequence_parallel": True},
                   "checkpoint": {"async_save": True}},
        "pp2": {"parallelism": {"pp": 2, "micro_batch_num": 2}, "training": {"micro_batch_size": 2}},
        "zero1": {"parallelism": {"dp": 2, "zero_stage": 1}, "training": {"micro_batch_size": 2}},
    }  # fmt: skip
    # ZeRO-1 run: rank 1 alone sees an infinite gradient and a SIGTERM at step 3, and holds
    # a 64 MiB ballast from step 1 (whose the per-rank memory entries are)
    faults = {"zero1": "inf_grad@3:1,sigterm@3:1,ballast@1:1"}
    procs = {}
    # the launches at once (each picks its own free port): their start-up overlaps
    for name, sections in layouts.items():
        cfg = _config(prepared, root / name, **sections)
        procs[name] = _launch(cfg, root / f"{name}.yaml", faults.get(name))
        out[name] = root / name
        out[name + "_cfg"] = cfg
    try:
        # the reference, meanwhile: one process, compiled step, the whole global batch of 4
        assert run_config(_config(prepared, root / "ref")) == 0
        out["ref"] = root / "ref"
        wait_launches(procs, timeout_s=460)
        _distributed_resumes(prepared, root, out, procs, layouts)
    finally:
        logs = {name: root / name / "msrun_logs" for name in procs}
        logs["tp2_b2"] = root / "tp2_b" / "msrun_logs"  # the relaunch writes where tp2_b did
        stop_launches(procs, logs)
    return out


def _from_step2(prepared, root: Path, name: str, sections: dict) -> dict:
    """A run of `sections`' layout whose save path starts with tp2_sp's step-2 checkpoint
    (written per rank), without a held-out set (evaluation is no resume-drift setting)."""
    cfg = _config(prepared, root / name, **sections)
    cfg.pop("eval_dataset")
    save = root / name / "checkpoints"
    shutil.copytree(root / "tp2_sp" / "checkpoints" / "step_00000002", save / "step_00000002")
    (save / "latest").write_text(f"{SAVE}\n")
    return cfg


def _distributed_resumes(prepared, root: Path, out: dict, procs: dict, layouts: dict) -> None:
    """Issue 16's resumes, after the launches above, from tp2_sp's step-2 checkpoint:
    - tp2_b (the same layout) is stopped by SIGTERM at step 3 (each rank writes its own
      files), then relaunched: it resumes from that step 3 and finishes step 4;
    - pp2_tp2 reshards tp2 -> pp2 and trains steps 3-4; its end save at step 4 loses rank 1
      mid-write (SIGKILL after its first file): `latest` must stay on step 2, which the
      one-process resume below (`test_layout_checkpoint_resumes_on_one_process`) reads."""
    for name, sections, fault in (("tp2_b", layouts["tp2_sp"], "sigterm@3"),
                                  ("pp2_tp2", layouts["pp2"], "kill_save@4:1")):  # fmt: skip
        # (msrun ends the job as soon as a worker dies: rank 0 does not wait at the barrier)
        out[name + "_cfg"] = cfg = _from_step2(prepared, root, name, sections)
        procs[name] = _launch(cfg, root / f"{name}.yaml", fault)
        out[name] = root / name
    wait_launches({"tp2_b": procs["tp2_b"]}, timeout_s=460)
    out["tp2_b_stopped"] = (root / "tp2_b" / "metrics.jsonl").read_text()
    procs["tp2_b2"] = _launch(out["tp2_b_cfg"], root / "tp2_b.yaml")
    _, err = procs["pp2_tp2"].communicate(timeout=460)
    out["pp2_tp2_code"], out["pp2_tp2_err"] = procs["pp2_tp2"].returncode, err
    out["pp2_tp2_logs"] = {
        int(p.stem.split("_")[1]): p.read_text(errors="replace")
        for p in (root / "pp2_tp2" / "msrun_logs").glob("worker_*.log")
    }
    wait_launches({"tp2_b2": procs["tp2_b2"]}, timeout_s=460)


@pytest.mark.msrun
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_launch_layout_losses_equal_one_process(runs, layout):
    got, ref = step_records(runs[layout]), step_records(runs["ref"])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step]["step_loss"] == pytest.approx(ref[step]["step_loss"], rel=1e-5)
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4)
        assert got[step]["consumed_samples"] == ref[step]["consumed_samples"]
    start = events(runs[layout], "start")[0]
    assert start["world_size"] == 2
    if layout == "pp2":  # graph mode: compiled stage graphs (_pp_step), not the engine
        for log in (runs["pp2"] / "msrun_logs").glob("worker_*.log"):
            assert "compiled pipeline parallel" in log.read_text(errors="replace")
    end = events(runs[layout], "end")[-1]
    assert end["status"] == "completed" and end["step"] == STEPS
    # the held-out evaluation at the end runs through the split model too (pp2 evaluates
    # eval_iters batches of its own micro-batch size: other samples than the reference's)
    ev, ref_ev = events(runs[layout], "eval")[-1], events(runs["ref"], "eval")[-1]
    if layout == "tp2_sp":
        assert ev["loss"] == pytest.approx(ref_ev["loss"], rel=1e-4)
    assert 0 < ev["loss"] < 10


@pytest.mark.msrun
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_launch_metrics_carry_communication_time_per_rank(runs, layout):
    recs = step_records(runs[layout])
    for rec in recs.values():
        assert rec["comm_s"] > 0 and 0 < rec["comm_share"] < 1
        assert len(rec["comm_share_ranks"]) == 2 and len(rec["comm_s_ranks"]) == 2
        assert rec["comm_share_ranks"][0] == pytest.approx(rec["comm_share"])
        assert all(0 < s < 1 for s in rec["comm_share_ranks"])
    # one process: no communication, said as zeros
    ref = step_records(runs["ref"])[1]
    assert ref["comm_s"] == 0.0 and ref["comm_share_ranks"] == [0.0]


@pytest.mark.msrun
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_launch_final_weights_and_moments_equal_one_process(runs, layout):
    """Losses alone miss update bugs that AdamW's normalisation hides (a sequence-parallel
    norm gradient left as a per-rank partial sum moves the loss < 1e-5 in 10 steps): the
    final checkpoint's weights AND moments must equal the one-process run's."""
    from mindloom_train._checkpoint import open_checkpoint, read_tracker

    assert read_tracker(runs[layout] / "checkpoints") == STEPS
    a = open_checkpoint(runs[layout] / "checkpoints").load_tensors()
    b = open_checkpoint(runs["ref"] / "checkpoints").load_tensors()
    assert set(a) == set(b) and "lm_head.weight" not in a  # tied: one embedding tensor
    moments = [n for n in a if n.startswith("exp_avg")]
    assert len(moments) == 2 * (len(a) - len(moments))  # both moments of every weight
    # weights: an element whose gradient is ~0 may round to the other sign of m/sqrt(v)
    # and move by up to lr (3e-3) in one of the runs (seen: 1 of 8192 elements, 4.4e-6);
    # the moments are linear in the gradients and agree to rounding
    tol = {"exp_avg.": (1e-3, 1e-7), "exp_avg_sq.": (1e-3, 1e-10)}
    for name in a:
        rtol, atol = next((v for k, v in tol.items() if name.startswith(k)), (1e-4, 2e-5))
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.msrun
def test_tp2_checkpoint_has_global_shapes_and_splits(runs):
    step_dir = runs["tp2_sp"] / "checkpoints" / "step_00000002"
    meta = json.loads((step_dir / "metadata.json").read_text())
    assert meta["layout"]["parallel"] == {"dp": 1, "tp": 2, "pp": 1}
    wq = meta["tensors"]["layers.0.attn.wq.weight"]
    assert wq["global_shape"] == [64, 64] and wq["split"]["tp_axis"] == 0
    assert [c["offset"] for c in wq["chunks"]] == [[0, 0], [32, 0]]
    assert len({c["file"] for c in wq["chunks"]}) == 2  # one file per tensor-parallel rank
    wo = meta["tensors"]["layers.0.attn.wo.weight"]
    assert wo["split"]["tp_axis"] == 1 and [c["offset"] for c in wo["chunks"]] == [[0, 0], [0, 32]]
    norm = meta["tensors"]["norm.weight"]
    assert norm["split"]["tp_axis"] is None and len(norm["chunks"]) == 1
    m = meta["tensors"]["exp_avg.layers.1.mlp.w1.weight"]  # AdamW moments split like weights
    assert m["global_shape"] == [128, 64] and [c["offset"] for c in m["chunks"]] == [
        [0, 0],
        [64, 0],
    ]
    common = json.loads((step_dir / "common.json").read_text())
    assert common["consumed_samples"] == SAVE * 4 and common["world_size"] == 2


def _resume_one_process(runs, layout: str, tmp_path: Path) -> Path:
    """Copy the layout's step-2 checkpoint into a fresh save path and continue it with
    `mindloom train` on ONE process (the layout's config file, no msrun), without its
    held-out set: no check here evaluates (evaluation is no resume-drift setting), and the
    final evaluation compiled the evaluation graph for nothing."""
    save = tmp_path / "ckpt"
    if layout == "tp2_sp":
        # tp2_sp's step 2 as pp2_tp2 left it: `latest` on it, and the step-4 save that
        # lost rank 1 mid-write beside it (issue 16: the next run resumes from step 2)
        shutil.copytree(runs["pp2_tp2"] / "checkpoints", save)
    else:
        save.mkdir()
        shutil.copytree(runs[layout] / "checkpoints" / "step_00000002", save / "step_00000002")
        (save / "latest").write_text(f"{SAVE}\n")
    cfg = {k: v for k, v in runs[layout + "_cfg"].items() if k != "eval_dataset"}
    cfg["run_dir"] = str(tmp_path / "resumed")
    cfg["checkpoint"] = {**cfg["checkpoint"], "save_path": str(save), "resume": "required"}
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(cfg))
    from mindloom_train._cli import main

    assert main(["train", str(path)]) == 0
    return tmp_path / "resumed"


@pytest.mark.msrun
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_layout_checkpoint_resumes_on_one_process(runs, layout, tmp_path):
    resumed = _resume_one_process(runs, layout, tmp_path)
    got, ref = step_records(resumed), step_records(runs["ref"])
    assert sorted(got) == list(range(SAVE + 1, STEPS + 1))
    for step in got:
        assert got[step]["step_loss"] == pytest.approx(ref[step]["step_loss"], rel=1e-5)
        assert got[step]["consumed_samples"] == ref[step]["consumed_samples"]
    assert events(resumed, "start")[0]["resumed_from"].endswith("step_00000002")
    # the one-process checkpoint at the end holds the same weights as the launch's
    from mindloom_train._checkpoint import open_checkpoint

    a = open_checkpoint(tmp_path / "ckpt").load_tensors()
    b = open_checkpoint(runs[layout] / "checkpoints").load_tensors()
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.msrun
def test_zero1_matches_and_ranks_agree_on_skips_and_stops(runs):
    """dp=2 with ZeRO-1 (each rank keeps AdamW state for half the parameters) trains the
    one-process model; a fault on rank 1 alone (an infinite gradient and a SIGTERM at step
    3) makes BOTH ranks skip that update and stop after it, with a checkpoint."""
    got, ref = step_records(runs["zero1"]), step_records(runs["ref"])
    # the compiled ZeRO-1 step (_zero_step), each rank holding AdamW state for its part
    for log in (runs["zero1"] / "msrun_logs").glob("worker_*.log"):
        assert "compiled data parallel + ZeRO-1 (GRAPH_MODE)" in log.read_text(errors="replace")
    assert sorted(got) == [1, 2, 3]
    for step in (1, 2, 3):  # step 3's loss is computed before its update is skipped
        assert got[step]["step_loss"] == pytest.approx(ref[step]["step_loss"], rel=1e-5)
    assert got[2]["grad_norm"] == pytest.approx(ref[2]["grad_norm"], rel=1e-4)
    assert got[3]["skipped_steps"] == 1 and got[3]["grad_norm"] is None
    anomaly = events(runs["zero1"], "anomaly")  # written by rank 0, whose own grads were finite
    assert [(a["step"], a["kind"], a["action"]) for a in anomaly] == [
        (3, "nonfinite_grad", "skipped")
    ]
    end = events(runs["zero1"], "end")[-1]
    assert end["status"] == "stopped" and end["step"] == 3 and "another rank" in end["reason"]
    from mindloom_train._checkpoint import open_checkpoint, read_tracker

    assert read_tracker(runs["zero1"] / "checkpoints") == 3
    # the skipped update left the weights of step 2: the same as the reference's step-2 save
    a = open_checkpoint(runs["zero1"] / "checkpoints" / "step_00000003").load_tensors()
    b = open_checkpoint(runs["ref"] / "checkpoints" / "step_00000002").load_tensors()
    assert set(a) == set(b)
    # weights and the (gathered) ZeRO-1 AdamW moments. The ZeRO-1 update is deterministic
    # (two launches fail identically at atol 1e-6: the same 1 of 8192 elements, 2.8e-6):
    # an element whose summed gradient cancels to ~0 carries a large relative rounding
    # difference between the two runs' reduction orders, and AdamW's m / sqrt(v) turns it
    # into an update difference of order lr (3e-3). A skipped or doubled update moves
    # thousands of elements by ~lr, far outside 2e-5.
    tol = {"exp_avg.": (1e-3, 1e-7), "exp_avg_sq.": (1e-3, 1e-10)}
    for name in a:
        rtol, atol = next((v for k, v in tol.items() if name.startswith(k)), (1e-4, 2e-5))
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


def test_pipeline_layouts_choose_the_compiled_stages_in_graph_mode_only():
    """The one choice of step for pp (issue 16): pp > 1 in graph mode runs the compiled
    stage graphs (_pp_step), with any dp / ZeRO-1 and with tp (+ sp) inside a stage
    (session 16; its 4-worker launch is `test_train_parallel_four.py`); pynative keeps the
    engine; no other compiled step claims a pipeline layout."""
    from mindloom_parallel import ParallelDims
    from mindloom_train._pp_step import compiled_pp
    from mindloom_train._tp_step import compiled_tp
    from mindloom_train._zero_step import compiled_zero

    cases = [
        (dict(pp=2, micro_batch_num=2), "graph", True),
        (dict(dp=2, pp=2, micro_batch_num=2), "graph", True),
        (dict(dp=2, pp=2, zero_stage=1), "graph", True),
        (dict(pp=2, micro_batch_num=2), "pynative", False),
        (dict(tp=2, pp=2, micro_batch_num=2), "graph", True),
        (dict(tp=2, pp=2, sequence_parallel=True, micro_batch_num=2), "graph", True),
        (dict(tp=2, pp=2, micro_batch_num=2), "pynative", False),
        (dict(tp=2), "graph", False),
        (dict(dp=2, zero_stage=1), "graph", False),
    ]
    for kw, mode, want in cases:
        dims = ParallelDims(**kw)
        assert compiled_pp(dims, mode) is want, (kw, mode)
        if want:
            assert not (compiled_tp(dims, mode) or compiled_zero(dims, mode)), kw


def test_launch_refuses_a_layout_the_model_does_not_fit(prepared, tmp_path, capsys):
    """tp=2 with the 65-id vocabulary: refused in one line before any worker starts."""
    from mindloom_train._cli import main

    cfg = base_config(prepared, tmp_path / "bad", parallelism={"tp": 2})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["launch", "--nproc", "2", str(path)]) == 2  # a config error
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "error: config parallelism: model.vocab_size = 65 is not divisible by parallelism.tp = 2"
    )
    assert not (tmp_path / "bad" / "msrun_logs").exists()


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_checkpoint_of_a_4_rank_layout_loads_global_tensors(tmp_path, tied):
    """The files and metadata a dp2 x tp2 x pp2 run writes (no msrun needed: each rank's
    shards cut with mindloom_parallel.rank_state) load back as the full tensors."""
    from mindloom_model import get_preset
    from mindloom_parallel import (
        ParallelConfig,
        rank_coords,
        rank_state,
        shard_tensor,
        tensor_layout,
        zero_owners,
    )
    from mindloom_train import _checkpoint as ck
    from mindloom_train._parallel import chunk_metadata

    mcfg = get_preset("debug", num_layers=4, tie_embeddings=tied)
    pcfg = ParallelConfig(dp=2, tp=2, pp=2, micro_batch_num=2)
    rng = np.random.default_rng(0)
    layout = tensor_layout(mcfg, pcfg)
    full = {n: rng.standard_normal(s.global_shape).astype(np.float32) for n, s in layout.items()}
    full.update(
        {f"{k}.{n}": v * 0.5 for n, v in list(full.items()) for k in ("exp_avg", "exp_avg_sq")}
    )
    tensors, files = chunk_metadata(mcfg, pcfg, world=8)
    assert sorted(files) == [0, 1, 4, 5]  # dp rank 0 of every (tp, pp) pair
    shards = {}
    for r, (mfile, ofile) in files.items():
        assert rank_coords(r, pcfg)[0] == 0
        local = rank_state(full, mcfg, pcfg, r)
        shards[mfile] = local
        tp_rank = rank_coords(r, pcfg)[1]
        shards[ofile] = {
            f"{k}.{n}": shard_tensor(full[f"{k}.{n}"], layout[n], tp_rank, 2)
            for n in local
            for k in ("exp_avg", "exp_avg_sq")
        }
    meta = ck.default_metadata({}, 8)
    meta["tensors"] = tensors
    ck.save_checkpoint(tmp_path, 5, shards, {"consumed_samples": 40}, metadata=meta)
    loaded = ck.open_checkpoint(tmp_path).load_tensors()
    assert set(loaded) == set(full)
    for n, v in full.items():
        np.testing.assert_array_equal(loaded[n], v, err_msg=n)
    # ZeRO-1 ownership: every parameter has exactly one owner, the load is balanced
    sizes = [int(np.prod(s.local_shape(2))) for s in layout.values()]
    owners = zero_owners(sizes, 2)
    load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in (0, 1)]
    assert set(owners) == {0, 1} and abs(load[0] - load[1]) <= max(sizes)


_PEAK_LINE = r"memory: peak RSS ([\d.]+) MiB on rank (\d+); estimate ([\d.]+) MiB"


@pytest.mark.msrun
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2", "zero1"])
def test_launch_memory_per_rank_and_estimate_within_20_percent(runs, layout):
    """Issue 18 on the same launches: every rank's memory and samples/s in the records
    (`*_ranks`), and each worker's peak RSS (its log's last `memory:` line) within 20% of
    the estimate for the layout's most-loaded rank."""
    import re

    recs = step_records(runs[layout])
    for rec in recs.values():
        assert len(rec["mem_rss_mb_ranks"]) == 2 and len(rec["samples_per_s_ranks"]) == 2
        assert (
            all(0 < p for p in rec["mem_peak_mb_ranks"]) and "mem_device_peak_mb_ranks" not in rec
        )
        assert rec["mem_rss_mb_ranks"][0] == pytest.approx(rec["mem_rss_mb"], rel=0.2)
        assert all(s > 0 for s in rec["samples_per_s_ranks"])
    peaks = {}
    for log in sorted((runs[layout] / "msrun_logs").glob("worker_*.log")):
        found = re.findall(_PEAK_LINE, log.read_text(errors="replace"))
        assert found, log
        peak, rank, est = found[-1]
        peaks[int(rank)] = (float(peak), float(est))
    assert sorted(peaks) == [0, 1]
    print(f"memory {layout}: " + ", ".join(f"rank {r} peak {p:.1f} MiB estimate {e:.1f} MiB"
                                           for r, (p, e) in sorted(peaks.items())))  # fmt: skip
    for rank, (peak, est) in peaks.items():
        if layout == "zero1" and rank == 1:
            peak -= BALLAST_MB  # the test's own ballast (see runs) is no part of the run
        assert abs(est - peak) <= 0.2 * peak, (layout, rank, peak, est)


@pytest.mark.msrun
def test_per_rank_fields_are_each_ranks_own(runs):
    """Whose value each `*_ranks` entry is: rank 1 of the ZeRO-1 launch holds 64 MiB more
    than rank 0 from step 1 on (MINDLOOM_FAULT ballast@1:1), so in every record its
    resident and peak entries exceed rank 0's by more than half of that; and each rank's
    last `mem_peak_mb_ranks` entry is at most the peak its own worker log reports at the
    end (a dropped, swapped or duplicated row fails one of the two)."""
    import re

    recs = step_records(runs["zero1"])
    assert sorted(recs) == [1, 2, 3]
    for step, rec in recs.items():
        for key in ("mem_rss_mb_ranks", "mem_peak_mb_ranks"):
            r0, r1 = rec[key]
            assert r1 - r0 > BALLAST_MB / 2, (step, key, rec[key])
    logged = {}
    for log in (runs["zero1"] / "msrun_logs").glob("worker_*.log"):
        peak, rank, _ = re.findall(_PEAK_LINE, log.read_text(errors="replace"))[-1]
        logged[int(rank)] = float(peak)
    last = recs[3]["mem_peak_mb_ranks"]
    # VmHWM is max(the high-water mark the kernel records at unmap, the resident set now):
    # memory handed back otherwise (madvise) lowers it slightly; seen on the compiled
    # ZeRO-1 step: 0.16 and 0.27 MiB below the record's value. A swapped or duplicated
    # row is off by the 64 MiB ballast.
    assert all(last[r] <= logged[r] + 1.0 for r in (0, 1)), (last, logged)


# ----------------------------------------------------------------------------------------
# issue 16: distributed checkpoints (every rank its own files) and balanced loading


def _llama_shapes(d=64, f=128, v=66, nl=2, nh=4, nkv=2) -> dict[str, tuple[int, ...]]:
    """The debug preset's tensors (vocab 66, tied) by hand, not from mindloom_parallel."""
    kv = nkv * (d // nh)
    out = {"embed.weight": (v, d), "norm.weight": (d,)}
    for i in range(nl):
        p = f"layers.{i}."
        out.update({p + "attn_norm.weight": (d,), p + "mlp_norm.weight": (d,),
                    p + "attn.wq.weight": (d, d), p + "attn.wk.weight": (kv, d),
                    p + "attn.wv.weight": (kv, d), p + "attn.wo.weight": (d, d),
                    p + "mlp.w1.weight": (f, d), p + "mlp.w2.weight": (d, f),
                    p + "mlp.w3.weight": (f, d)})  # fmt: skip
    return out


def _values(shapes, keep=lambda name: True, tp: int = 1) -> int:
    """Values of the tensors `keep` selects, as one of `tp` ranks holds them (every matrix
    split in two, vectors whole)."""
    return sum(np.prod(s) // (tp if len(s) == 2 else 1) for n, s in shapes.items() if keep(n))


_READ_LINE = r"checkpoint: rank (\d+) read (\d+) tensor bytes from (\d+) files; it holds (\d+)"


def _bytes_read(text: str) -> dict[int, tuple[int, int]]:
    import re

    return {int(r): (int(n), int(h)) for r, n, _, h in re.findall(_READ_LINE, text)}


@pytest.mark.msrun
def test_tp2_written_per_rank_resumes_bit_exact_after_sigterm(runs):
    """tp2_b: SIGTERM at step 3, both ranks write their own files of step 3 (no gather),
    then the relaunch resumes from it: step 4 and the final weights and moments equal the
    uninterrupted tp2_sp run's bit for bit."""
    # tp2_sp's step 2, the one resumed here, was written per rank in the background
    # (async_save) and committed after training moved on (at the first step both writers
    # were done by: 3 unless a writer was slower than a step)
    bg = events(runs["tp2_sp"], "checkpoint")[0]
    assert (bg["step"], bg["per_rank"], bg["background"]) == (2, True, True)
    assert bg["completed_at_step"] in (3, 4)
    stopped = [json.loads(x) for x in runs["tp2_b_stopped"].splitlines()]
    ends = [r for r in stopped if r.get("event") == "end"]
    assert ends[-1]["status"] == "stopped" and ends[-1]["step"] == 3
    saves = [r for r in stopped if r.get("event") == "checkpoint"]
    assert saves[-1]["step"] == 3 and saves[-1]["per_rank"] is True
    meta = json.loads(
        (runs["tp2_b"] / "checkpoints" / "step_00000003" / "metadata.json").read_text()
    )
    files = {c["file"] for e in meta["tensors"].values() for c in e["chunks"]}
    assert files == {
        f"{k}-000000{r}-0000002.safetensors" for k in ("model", "optim") for r in (0, 1)
    }
    a, b = step_records(runs["tp2_sp"]), step_records(runs["tp2_b"])
    assert sorted(b) == [3, 4] and events(runs["tp2_b"], "start")[-1]["step"] == 3
    for step in (3, 4):
        for key in ("loss", "grad_norm", "lr"):
            assert b[step][key] == a[step][key], (step, key)
    from mindloom_train._checkpoint import open_checkpoint

    wa = open_checkpoint(runs["tp2_sp"] / "checkpoints").load_tensors()
    wb = open_checkpoint(runs["tp2_b"] / "checkpoints").load_tensors()
    assert open_checkpoint(runs["tp2_b"] / "checkpoints").step == 4 and set(wa) == set(wb)
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
    # the relaunch read its TP slice only: halves of the matrices, the norms whole, x3
    # (weights and both moments), fp32
    shapes = _llama_shapes()
    logs = "\n".join(p.read_text(errors="replace")
                     for p in (runs["tp2_b"] / "msrun_logs").glob("worker_*.log"))  # fmt: skip
    read = _bytes_read(logs + (runs["tp2_b"] / "train.log").read_text())
    assert sorted(read) == [0, 1]
    for rank, (n, held) in read.items():
        assert n == held == 3 * 4 * _values(shapes, tp=2), (rank, n, held)


@pytest.mark.msrun
def test_tp2_to_pp2_reshard_reads_only_each_stages_tensors(runs):
    """pp2_tp2 resumed tp2_sp's per-rank step 2 under pp2: its steps 3-4 are the one-process
    run's, and each stage read exactly the bytes of its own tensors (from both TP files)."""
    logs = runs["pp2_tp2_logs"]
    got, ref = step_records(runs["pp2_tp2"]), step_records(runs["ref"])
    assert sorted(got) == [3, 4]
    for step in got:
        assert got[step]["step_loss"] == pytest.approx(ref[step]["step_loss"], rel=1e-5)
    shapes = _llama_shapes()

    def stage(n: str) -> int:
        return (
            int(n.split(".")[1]) if n.startswith("layers.") else (1 if n == "norm.weight" else -1)
        )

    want = {  # the tied embedding is on both stages
        0: _values(shapes, lambda n: stage(n) in (0, -1)),
        1: _values(shapes, lambda n: stage(n) in (1, -1) or n == "norm.weight"),
    }
    read = _bytes_read("\n".join(logs.values()))
    assert sorted(read) == [0, 1]
    for rank, (n, held) in read.items():
        assert n == held == 3 * 4 * want[rank], (rank, n, held, want[rank])


@pytest.mark.msrun
def test_rank_killed_mid_write_leaves_latest_on_the_previous_checkpoint(runs):
    """pp2_tp2's end save at step 4: rank 1 SIGKILLed after its first file. The job fails,
    no step 4 exists at a final path, `latest` still names step 2 (which the one-process
    resume of tp2_sp reads from this very save path)."""
    from mindloom_train._checkpoint import complete_steps, read_tracker

    save = runs["pp2_tp2"] / "checkpoints"
    assert runs["pp2_tp2_code"] != 0, runs["pp2_tp2_err"][-2000:]
    assert "checkpoint: saved step 4" not in "\n".join(runs["pp2_tp2_logs"].values())
    assert read_tracker(save) == SAVE and complete_steps(save) == [SAVE]
    assert not (save / "step_00000004").exists()


@pytest.mark.msrun
def test_every_rank_logs_its_own_state_bytes(runs):
    """At start each rank logs "params N, grads N, optimizer N bytes on this rank" from
    the tensors it holds: tp2 halves every matrix (AdamW moments twice the params);
    ZeRO-1 keeps the whole model on each rank and splits the moments between them."""
    import re

    shapes = _llama_shapes()
    line = r"memory: params (\d+), grads (\d+), optimizer (\d+) bytes on this rank"
    for layout, params in (("tp2_sp", 4 * _values(shapes, tp=2)), ("zero1", 4 * _values(shapes))):
        per_rank = {}
        for log in (runs[layout] / "msrun_logs").glob("worker_*.log"):
            found = re.findall(line, log.read_text(errors="replace"))
            per_rank[int(log.stem.split("_")[1])] = [int(x) for x in found[0]]
        assert sorted(per_rank) == [0, 1], layout
        for p, g, _ in per_rank.values():
            assert p == g == params, (layout, p, g, params)
        opt = [o for _, _, o in per_rank.values()]
        if layout == "tp2_sp":
            assert opt == [2 * params, 2 * params]
        else:
            assert sum(opt) == 2 * params and all(0 < o < 2 * params for o in opt), opt


@pytest.mark.msrun
def test_zero1_replicas_write_weights_once_and_each_its_own_moments(runs):
    """The ZeRO-1 launch's SIGTERM save (step 3): the weights once (replica 0's file), the
    AdamW moments from both ranks (each the parameters it owns), each moment tensor in
    exactly one rank's optimizer file; the reassembled tensors are
    `test_zero1_matches_and_ranks_agree_on_skips_and_stops`'s."""
    meta = json.loads(
        (runs["zero1"] / "checkpoints" / "step_00000003" / "metadata.json").read_text()
    )
    files = {c["file"] for e in meta["tensors"].values() for c in e["chunks"]}
    assert files == {"model-0000000-0000002.safetensors", "optim-0000000-0000002.safetensors",
                     "optim-0000001-0000002.safetensors"}  # fmt: skip
    by_rank = {0: 0, 1: 0}
    for name, entry in meta["tensors"].items():
        assert len(entry["chunks"]) == 1, name  # dp replicas: never a block twice
        if name.startswith("exp_avg."):
            by_rank[int(entry["chunks"][0]["file"].split("-")[1])] += 1
    assert by_rank[0] > 0 and by_rank[1] > 0, by_rank
