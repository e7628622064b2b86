"""DeepSeek-V3 (MLA + MoE + MTP) through `mindloom train` and `mindloom launch`: one-process
run, resume, data parallel and activation recompute.

Module fixtures run each job once and the checks below share them: a one-process
reference A (4 steps, 2 micro-batches of 4 per step, a checkpoint after every step, the
held-out loss at the end), trained in this process while a `mindloom launch --nproc 2`
dp=2 run of the same config (no held-out set; each rank one micro-batch of 4, so both see
A's 8 samples per step) runs in the background; a run B in a new process that resumes
from A's step-1 checkpoint and is stopped by SIGTERM during update 3; a run F with layer
1 (the MoE layer) recomputed, 2 steps. The model is the tiniest that still has every part:
deepseek-v3-debug cut to 2 layers (one dense, one MoE) plus its MTP block (2 routers).
References: NumPy for the expert-bias rule and the load statistics, run A for resume,
data parallel and recompute (A's held-out evaluation runs after its last step and changes
no training record or checkpoint), `transformers` for the exported Hugging Face directory.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from mindloom_train._checkpoint import Checkpoint, read_tracker
from mindloom_train._cli import main
from train_testutil import (
    SCHED,
    base_config,
    events,
    kill_msrun,
    launch_env,
    run_cli,
    run_config,
    step_records,
)

STEPS = 4
SPEED = 0.01  # large enough that the bias moves the routing within 4 steps
E = 8  # deepseek-v3-debug: routed experts
R = 2  # routers: the one trunk MoE layer and the MTP block's


def _config(prepared, run: Path, eval_data: bool = True, **sections) -> dict:
    cfg = base_config(
        prepared, run, lr_scheduler=SCHED,
        model={"preset": "deepseek-v3-debug", "vocab_size": None, "num_layers": 2,
               "moe_bias_update_speed": SPEED, "moe_aux_loss_weight": 0.01},
        training={"train_iters": STEPS, "global_batch_size": 8, "micro_batch_size": 4},
        checkpoint={"save_interval": 1, "keep_last": 10},
    )  # fmt: skip
    if not eval_data:  # no held-out set: no evaluation graph to compile
        del cfg["eval_dataset"]
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    """The one-process reference A, trained while the dp=2 launch of the same config starts
    and runs in the background (waited for by `dp_run`)."""
    root = tmp_path_factory.mktemp("deepseek")
    out = {"root": root, "a": root / "a", "dp": root / "dp"}
    path = root / "dp.yaml"
    # two micro-batches of 2 per rank (A: two of 4): the dp update graph with accumulation
    # is the one that exceeded MindSpore's default call depth (session 15)
    path.write_text(yaml.safe_dump(_config(prepared, out["dp"], eval_data=False,
                                           parallelism={"dp": 2},
                                           training={"micro_batch_size": 2})))  # fmt: skip
    out["dp_proc"] = subprocess.Popen(
        [sys.executable, "-m", "mindloom_train._cli", "launch", "--nproc", "2", str(path),
         "--timeout", "900"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(),
    )  # fmt: skip
    try:
        assert run_config(_config(prepared, out["a"])) == 0
        yield out
    finally:
        dp = out["dp_proc"]
        if dp.poll() is None:  # only after a failure or a timeout
            kill_msrun(out["dp"] / "msrun_logs")
            dp.kill()
            dp.communicate()


@pytest.fixture(scope="module")
def dp_run(runs) -> Path:
    """The dp=2 launch started by `runs`, finished."""
    dp = runs["dp_proc"]
    _, err = dp.communicate(timeout=960)
    assert dp.returncode == 0, f"dp2: {err[-3000:]}"
    return runs["dp"]


@pytest.fixture(scope="module")
def run_f(prepared, runs) -> Path:
    """F: A's config with layer 1 (MoE) recomputed, 2 steps, no held-out set."""
    run = runs["root"] / "full"
    rc = {"mode": "selected", "layers": [1]}
    full = _config(prepared, run, eval_data=False, recompute=rc,
                   training={"train_iters": 2}, checkpoint={"save_interval": 0})  # fmt: skip
    assert run_config(full) == 0
    return run


@pytest.fixture(scope="module")
def run_b(prepared, runs) -> dict:
    """B: a new `mindloom train` process resuming from a copy of A's step-1 checkpoint,
    SIGTERM during update 3 (saves step 3, exits 0)."""
    run = runs["root"] / "b"
    shutil.copytree(runs["a"] / "checkpoints" / "step_00000001",
                    run / "checkpoints" / "step_00000001")  # fmt: skip
    (run / "checkpoints" / "latest").write_text("1\n")
    path = runs["root"] / "b.yaml"
    path.write_text(yaml.safe_dump(_config(prepared, run)))
    proc = run_cli("train", str(path), timeout=900, fault="sigterm@3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"run": run, "stopped_at": read_tracker(run / "checkpoints"), "stderr": proc.stderr}


def _tensors(run: Path, step: int) -> dict[str, np.ndarray]:
    ck = Checkpoint(run / "checkpoints" / f"step_{step:08d}")
    return ck.load_tensors(list(ck.metadata["tensors"]))


def _biases(run: Path, step: int) -> np.ndarray:
    """[R, E] in the trunk-then-MTP router order the metrics use."""
    t = _tensors(run, step)
    trunk = sorted((k for k in t if k.startswith("layers.") and k.endswith("expert_bias")),
                   key=lambda k: int(k.split(".")[1]))  # fmt: skip
    mtp = sorted((k for k in t if k.startswith("mtp.") and k.endswith("expert_bias")),
                 key=lambda k: int(k.split(".")[1]))  # fmt: skip
    return np.stack([t[k] for k in trunk + mtp])


def test_losses_finite_falling_and_eval(runs):
    a = step_records(runs["a"])
    assert sorted(a) == list(range(1, STEPS + 1))
    for r in a.values():
        for key in ("step_loss", "lm_loss", "mtp_loss", "balance_loss"):
            assert math.isfinite(r[key]), (key, r)
    assert a[STEPS]["step_loss"] < a[1]["step_loss"] - 0.1
    assert a[STEPS]["lm_loss"] < a[1]["lm_loss"]
    # the objective: CE + 0.3 * MTP + 0.01 * balance (means over the 2 micro-batches)
    r = a[1]
    assert r["step_loss"] == pytest.approx(
        r["lm_loss"] + 0.3 * r["mtp_loss"] + 0.01 * r["balance_loss"], rel=1e-5
    )
    ev = events(runs["a"], "eval")
    assert [e["step"] for e in ev] == [STEPS]
    assert ev[0]["ppl"] == pytest.approx(math.exp(ev[0]["loss"]))
    # the held-out loss is the main CE: same scale as lm_loss, far below the objective
    assert ev[0]["loss"] < a[STEPS]["step_loss"]


def test_moe_metrics_are_consistent(runs):
    a = step_records(runs["a"])
    for r in a.values():
        load = np.asarray(r["moe_load"], np.float64)
        assert load.shape == (R, E)  # the trunk MoE layer + the MTP block's
        np.testing.assert_allclose(load.sum(1), 1.0, rtol=0, atol=1e-12)
        np.testing.assert_allclose(r["moe_imbalance"], load.max(1) / load.mean(1), rtol=1e-12)
        total = load.sum(0)  # every layer routes the same number of token-slots
        assert r["moe_imbalance_overall"] == pytest.approx(total.max() / total.mean(), rel=1e-12)
        assert r["moe_dead_experts"] == int((load == 0).sum())
        # token-slots: 8 samples x 32 tokens x 2 experts per layer, so fractions are k/512
        np.testing.assert_array_equal(load * 512, np.round(load * 512))
    for step in range(1, STEPS + 1):
        norm = float(np.sqrt((_biases(runs["a"], step).astype(np.float64) ** 2).sum()))
        assert a[step]["moe_bias_norm"] == pytest.approx(norm, rel=1e-6)


def _bias_rule(bias: np.ndarray, load: np.ndarray) -> np.ndarray:
    # DeepSeek-V3: b_e += gamma * sign(mean load - load_e), applied after the update, fp32
    sign = np.sign(load.mean(1, keepdims=True) - load)
    return (bias + np.float32(SPEED) * sign.astype(np.float32)).astype(np.float32)


def test_bias_update_equals_the_numpy_rule_from_the_recorded_loads(runs):
    a = step_records(runs["a"])
    bias = np.zeros((R, E), np.float32)
    for step in range(1, STEPS + 1):
        bias = _bias_rule(bias, np.asarray(a[step]["moe_load"], np.float64))
        np.testing.assert_array_equal(_biases(runs["a"], step), bias, err_msg=f"step {step}")
    assert np.abs(bias).max() > 0  # it moved
    # the routing used the bias: loads differ between the steps
    assert a[1]["moe_load"] != a[STEPS]["moe_load"]


def test_resume_after_sigterm_is_bit_exact_including_the_bias(runs, run_b):
    """B resumed from A's step-1 checkpoint: steps 2-3 equal A's bit for bit, and the
    checkpoint B's SIGTERM saved at step 3 holds exactly A's step-3 tensors (weights,
    AdamW moments, the expert biases) and data position, so a resume from it is A's."""
    assert run_b["stopped_at"] == 3
    assert "resumed from" in run_b["stderr"]
    a, b = step_records(runs["a"]), step_records(run_b["run"])
    assert sorted(b) == [2, 3]
    for step in (2, 3):
        for key in ("step_loss", "grad_norm", "mtp_loss", "moe_load", "moe_bias_norm"):
            assert a[step][key] == b[step][key], (step, key)
    ta, tb = _tensors(runs["a"], 3), _tensors(run_b["run"], 3)
    assert sorted(ta) == sorted(tb)
    assert sum(k.endswith("expert_bias") for k in ta) == R
    for name in ta:
        np.testing.assert_array_equal(ta[name], tb[name], err_msg=name)
    ca, cb = (json.loads((r / "checkpoints" / "step_00000003" / "common.json").read_text())
              for r in (runs["a"], run_b["run"]))  # fmt: skip
    for key in ("step", "consumed_samples", "consumed_tokens"):
        assert ca[key] == cb[key], key


def test_generate_and_export_hf_from_the_checkpoint(runs, tmp_path, capsys):
    # the CLI's `main` in this process (what the `mindloom` script calls): no second and
    # third MindSpore import; an uncaught exception would fail the test right here
    ckpt = runs["a"] / "checkpoints"
    capsys.readouterr()
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "ROMEO:",
                 "--max-new-tokens", "8", "--temperature", "0"])  # fmt: skip
    got = capsys.readouterr()
    assert code == 0, got.err[-2000:]
    assert got.out.startswith("ROMEO:")
    out = tmp_path / "hf"
    code = main(["export-hf", "--checkpoint", str(ckpt), "--out", str(out)])
    got = capsys.readouterr()
    assert code == 0, got.err[-2000:]
    assert "DeepseekV3ForCausalLM" in got.out

    import torch
    from mindloom_train._generate import load_model
    from mindspore import Tensor
    from transformers import DeepseekV3ForCausalLM

    ours, _ = load_model(ckpt)
    ref = DeepseekV3ForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, (2, 16)).astype(np.int32)
    with torch.no_grad():
        want = ref(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    got = ours(Tensor(ids)).asnumpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_memory_estimate_counts_deepseek_recompute(prepared, tmp_path):
    """On an accelerator a recomputed layer keeps only its input (plus one layer rebuilt
    at a time); MindSpore's CPU graph keeps every intermediate, so there recompute adds."""
    from mindloom_train._config import from_dict
    from mindloom_train._memory import estimate

    def acts(device, **recompute):
        # the preset's 3 layers (nothing compiles here): selecting layers 1-2 of 3 sits
        # between none and full (with 2 layers the rebuilt MoE layer outweighs the kept
        # dense one, so full < selected does not hold there)
        cfg = from_dict(_config(prepared, tmp_path / "m", model={"num_layers": 3},
                                recompute=recompute))  # fmt: skip
        return estimate(cfg, device=device).components["activations"]

    none, sel, full = (acts("910b", mode="none"), acts("910b", mode="selected", layers=[1, 2]),
                       acts("910b", mode="full"))  # fmt: skip
    assert full < sel < none
    none, sel, full = (acts("cpu", mode="none"), acts("cpu", mode="selected", layers=[1, 2]),
                       acts("cpu", mode="full"))  # fmt: skip
    assert none < sel < full


@pytest.mark.parametrize(
    ("sections", "key"),
    [({"parallelism": {"pp": 2, "tp": 2, "micro_batch_num": 2}}, "parallelism.tp: 2"),
     ({"parallelism": {"pp": 2, "dp": 2, "ep": 2, "zero_stage": 1}}, "parallelism.zero_stage: 1"),
     ({"parallelism": {"dp": 2, "zero_stage": 1}}, "parallelism.zero_stage: 1"),
     ({"parallelism": {"dp": 1, "tp": 2}, "context": {"mode": "pynative"}},
      "context.mode: pynative")],
)  # fmt: skip
def test_unwired_layouts_refuse_the_family_in_one_line(prepared, tmp_path, sections, key):
    """The layouts no compiled DeepSeek-V3 step runs: tensor parallel or ZeRO-1 inside
    pipeline stages, ZeRO-1 without ep, PyNative. Each is refused in one line naming the
    key; the layouts that run (dp x tp x ep, pp x dp x ep) build."""
    from mindloom_train._config import ConfigError, from_dict
    from mindloom_train._modelcfg import build_model_config

    cfg = from_dict(_config(prepared, tmp_path / "r", **sections))
    with pytest.raises(ConfigError, match=rf"config key {key} is not supported for family "
                       "deepseek_v3") as exc:  # fmt: skip
        build_model_config(cfg, 65)
    assert "\n" not in str(exc.value)
    for ok in ({"dp": 2, "tp": 2, "ep": 2}, {"pp": 2, "dp": 2, "ep": 2}):
        cfg = from_dict(_config(prepared, tmp_path / "r", parallelism=ok))
        assert build_model_config(cfg, 65).family == "deepseek_v3"


def test_launch_refuses_zero_for_the_family_before_any_worker(prepared, tmp_path, capsys):
    run = tmp_path / "z"
    path = tmp_path / "z.yaml"
    path.write_text(yaml.safe_dump(_config(prepared, run, parallelism={"dp": 2, "zero_stage": 1})))
    assert main(["launch", "--nproc", "2", str(path)]) == 2  # in this process: no worker
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: config key parallelism.zero_stage: 1 is not supported for")
    assert not (run / "msrun_logs").exists()


@pytest.mark.msrun
def test_dp2_losses_and_biases_equal_one_process(runs, dp_run):
    a, dp = step_records(runs["a"]), step_records(dp_run)
    assert sorted(dp) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert dp[step]["step_loss"] == pytest.approx(a[step]["step_loss"], rel=1e-5), step
        # loads summed over both ranks' 2 micro-batches each = over the one process's 2
        np.testing.assert_array_equal(dp[step]["moe_load"], a[step]["moe_load"])
    for step in range(1, STEPS + 1):
        np.testing.assert_array_equal(_biases(dp_run, step), _biases(runs["a"], step))
    assert np.abs(_biases(runs["a"], STEPS)).max() > 0  # the biases moved


def test_recompute_gives_the_losses_of_none(runs, run_f):
    """Layer 1 (MoE) recomputed and layer 0 not, in the compiled TrainStep and AccumStep
    (the mix that used to fail to compile: "Graph cycle exists"): the same step losses,
    MTP losses, grad norms and expert loads as the run without recompute."""
    a, f = step_records(runs["a"]), step_records(run_f)
    assert sorted(f) == [1, 2]
    for step in (1, 2):
        for key in ("step_loss", "lm_loss", "mtp_loss", "grad_norm"):
            assert f[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
        assert f[step]["moe_load"] == a[step]["moe_load"], step
    # the run really recomputed: its start line names the mode
    assert "recompute selected" in (run_f / "train.log").read_text()
