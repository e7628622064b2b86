"""The "done when" figure: nanoGPT's CPU recipe reaches held-out loss <= 1.89 at 2000 steps.

It trains for real (about 2000 x 768 tokens); on a quiet 2-core CPU that takes longer than
the suite's time budget, so it runs only when asked:

    MINDLOOM_SLOW_TESTS=1 ./dev hatch run train:python -m pytest \
        packages/train/tests/test_train_nanogpt_recipe.py

The measured time and loss are in the package README. The suite runs the recipe's first
CI_STEPS updates (its warmup) and compares the loss curve with one recorded on this
project's machine (issue 22 item 6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mindloom_train._config import load_config
from mindloom_train._trainer import Trainer
from train_testutil import events, step_records

RECIPE = Path(__file__).resolve().parents[3] / "configs" / "nanogpt-shakespeare-char.yaml"


@pytest.mark.slow  # deselected unless MINDLOOM_SLOW_TESTS=1 (the root conftest.py)
def test_nanogpt_recipe_reaches_1_89_at_2000_steps(tmp_path):
    cfg = load_config(RECIPE, [f"run_dir={tmp_path / 'run'}", "monitor.progress_bar=false"])
    assert cfg.training.train_iters == 2000
    assert Trainer(cfg).run() == 0
    final = events(tmp_path / "run", "eval")[-1]
    assert final["step"] == 2000
    assert final["loss"] <= 1.89, final
    assert max(step_records(tmp_path / "run")) == 2000


# The recipe's first 100 updates exactly as the full run takes them (its 100 warmup steps,
# so the schedule is the recipe's own), held-out loss at 50 and 100.
CI_STEPS = 100
CI_OVERRIDES = [
    f"training.train_iters={CI_STEPS}",
    "training.eval_interval=50",
    "checkpoint.save_interval=0",
    "checkpoint.save_at_end=false",
    "monitor.log_interval=50",
]
# Recorded 2026-12-01 on the project's 2-core machine (load average ~45) with these
# overrides; a second process with `train_iters=300 decay_iters=300` (the same first 100
# updates) gave bit-identical values, so the spread between runs here is 0.
RECORDED_TRAIN = {50: 3.5241412925720215, 100: 2.6464390087127687}  # mean over the window
RECORDED_EVAL = {50: 2.914308524131775, 100: 2.446150028705597}
# Why 0.05: between steps 50 and 100 the training loss falls 0.88, ~0.018 a step, so 0.05
# is under 3 steps of progress: a bug that slows learning (bias correction, schedule,
# data order, a broken mask) moves the curve further. The room is for another CPU or
# thread count, where reductions round differently and 100 steps amplify it; that part is
# not measured (only this machine was available).
TOLERANCE = 0.05


def test_nanogpt_recipe_first_100_steps_follow_the_recorded_curve(tmp_path):
    overrides = [f"run_dir={tmp_path / 'run'}", "monitor.progress_bar=false", *CI_OVERRIDES]
    assert Trainer(load_config(RECIPE, overrides)).run() == 0
    train = {s: r["loss"] for s, r in step_records(tmp_path / "run").items()}
    held_out = {e["step"]: e["loss"] for e in events(tmp_path / "run", "eval")}
    assert sorted(train) == sorted(RECORDED_TRAIN) and sorted(held_out) == sorted(RECORDED_EVAL)
    for got, recorded in ((train, RECORDED_TRAIN), (held_out, RECORDED_EVAL)):
        for step, value in recorded.items():
            assert abs(got[step] - value) <= TOLERANCE, (step, got[step], value)
