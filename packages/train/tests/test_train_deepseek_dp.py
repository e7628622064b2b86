"""DeepSeek-V3 through `mindloom launch --nproc 2` (plain data parallel) and with
activation recompute, each against a one-process run of the same config.

One module: the dp=2 launch starts first and runs in the background while this process
trains the one-process reference C (4 steps, 2 micro-batches of 4 per step; the launch
gives each rank one micro-batch of 4, so both see the same 8 samples per step) and then
the recompute run F (C with layer 1, the MoE layer, recomputed: 2 steps). No held-out set in any of
them (no evaluation graph to compile). test_train_deepseek.py holds the model and the
config helpers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_train_deepseek import STEPS, _biases, _config
from train_testutil import kill_msrun, launch_env, run_config, step_records


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_dp")
    out = {"c": root / "c", "dp": root / "dp", "full": root / "full"}
    path = root / "dp.yaml"
    path.write_text(yaml.safe_dump(_config(prepared, out["dp"], eval_data=False,
                                           parallelism={"dp": 2})))  # fmt: skip
    dp = subprocess.Popen(
        [sys.executable, "-m", "mindloom_train._cli", "launch", "--nproc", "2", str(path),
         "--timeout", "900"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(),
    )  # fmt: skip
    try:
        assert run_config(_config(prepared, out["c"], eval_data=False)) == 0
        rc = {"mode": "selected", "layers": [1]}
        full = _config(prepared, out["full"], eval_data=False, recompute=rc,
                       training={"train_iters": 2}, checkpoint={"save_interval": 0})  # fmt: skip
        assert run_config(full) == 0
        _, err = dp.communicate(timeout=960)
        assert dp.returncode == 0, f"dp2: {err[-3000:]}"
    finally:
        if dp.poll() is None:  # only after a failure or a timeout
            kill_msrun(out["dp"] / "msrun_logs")
            dp.kill()
            dp.communicate()
    return out


@pytest.mark.msrun
def test_dp2_losses_and_biases_equal_one_process(runs):
    c, dp = step_records(runs["c"]), step_records(runs["dp"])
    assert sorted(dp) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert dp[step]["step_loss"] == pytest.approx(c[step]["step_loss"], rel=1e-5), step
        # loads summed over both ranks = over the one process's 2 micro-batches
        np.testing.assert_array_equal(dp[step]["moe_load"], c[step]["moe_load"])
    for step in range(1, STEPS + 1):
        np.testing.assert_array_equal(_biases(runs["dp"], step), _biases(runs["c"], step))
    assert np.abs(_biases(runs["c"], STEPS)).max() > 0  # the biases moved


def test_recompute_gives_the_losses_of_none(runs):
    """Layer 1 (MoE) recomputed and layer 0 not, in the compiled TrainStep and AccumStep
    (the mix that used to fail to compile: "Graph cycle exists"): the same step losses,
    MTP losses, grad norms and expert loads as the run without recompute."""
    c, f = step_records(runs["c"]), step_records(runs["full"])
    assert sorted(f) == [1, 2]
    for step in (1, 2):
        for key in ("step_loss", "lm_loss", "mtp_loss", "grad_norm"):
            assert f[step][key] == pytest.approx(c[step][key], rel=1e-5), (step, key)
        assert f[step]["moe_load"] == c[step]["moe_load"], step
    # the run really recomputed: its start line names the mode
    assert "recompute selected" in (runs["full"] / "train.log").read_text()
