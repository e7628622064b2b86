"""Dropout resumes bit-exactly: masks are keyed by (seed, step, micro-batch, site), so a run
stopped by SIGTERM and resumed reproduces the uninterrupted run's per-step losses exactly."""

from __future__ import annotations

from train_testutil import SCHED, base_config, events, run_config, step_records

# two micro-batches per step, so the micro-batch part of the key is exercised too; that
# dropout is really on in training is test_train_precision's job
MODEL = {"preset": "debug", "vocab_size": None, "dropout": 0.1}
TRAINING = {"train_iters": 4, "global_batch_size": 4, "micro_batch_size": 2}


def _cfg(prepared, run):
    return base_config(prepared, run, lr_scheduler=SCHED, model=MODEL, training=TRAINING)


def test_dropout_run_stopped_and_resumed_equals_the_uninterrupted_run(prepared, tmp_path):
    full = tmp_path / "full"
    assert run_config(_cfg(prepared, full)) == 0
    a = step_records(full)
    assert sorted(a) == list(range(1, 5))

    # SIGTERM during step 2: the trainer saves step 2 and exits; a fresh Trainer resumes
    part = tmp_path / "part"
    cfg = _cfg(prepared, part)
    assert run_config(cfg, fault="sigterm@2") == 0
    assert max(step_records(part)) == 2
    assert run_config(cfg) == 0
    assert events(part, "start")[-1]["resumed_from"]
    b = step_records(part)
    assert sorted(b) == list(range(1, 5))
    for step in range(1, 5):
        for key in ("step_loss", "grad_norm"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
