"""Dropout resumes bit-exactly: masks are keyed by (seed, step, micro-batch, site), so a fresh
Trainer resumed from a step-2 checkpoint reproduces the uninterrupted run's per-step losses
exactly."""

from __future__ import annotations

import shutil

from train_testutil import SCHED, TINY_MODEL, base_config, events, run_config, step_records

# two micro-batches per step, so the micro-batch part of the key is exercised too; that
# dropout is really on in training is test_train_precision's job. No held-out set: nothing
# here evaluates, and its graph would be a third compile. The one-layer TINY_MODEL: the
# claim is about the mask keys (every dropout site of a layer, both micro-batches, the
# step), not the depth, and its two graphs compile in a fraction of the debug preset's.
MODEL = {**TINY_MODEL, "dropout": 0.1}
TRAINING = {"train_iters": 4, "global_batch_size": 4, "micro_batch_size": 2}


def _cfg(prepared, run, **sections):
    return base_config(prepared, run, lr_scheduler=SCHED, model=MODEL, training=TRAINING,
                       eval_dataset=None, **sections)  # fmt: skip


def test_dropout_run_stopped_and_resumed_equals_the_uninterrupted_run(prepared, tmp_path):
    # the uninterrupted run saves step 2 on its way (a save is the same whether an interval
    # or a SIGTERM asks for it: test_train_loop's resume test covers the SIGTERM stop)
    full = tmp_path / "full"
    assert run_config(_cfg(prepared, full, checkpoint={"save_interval": 2})) == 0
    a = step_records(full)
    assert sorted(a) == list(range(1, 5))

    # a fresh Trainer (new runner, new cells, nothing carried in memory) resumes from
    # that step-2 checkpoint alone
    part = tmp_path / "part"
    step2 = "step_00000002"
    shutil.copytree(full / "checkpoints" / step2, part / "checkpoints" / step2)
    (part / "checkpoints" / "latest").write_text("2\n")
    assert run_config(_cfg(prepared, part)) == 0
    assert events(part, "start")[-1]["resumed_from"].endswith(step2)
    b = step_records(part)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in ("step_loss", "grad_norm"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
