"""Precision paths on the real CPU backend: dynamic loss scaling (fp32 and fp16 compute)
and dropout on in training, off in eval (its exact resume: test_train_dropout.py). Only the
dropout test evaluates: the other runs leave the held-out set out, which saves each of them
the compile of the evaluation graph."""

from __future__ import annotations

import math

from train_testutil import SCHED, TINY_MODEL, base_config, events, run_config, step_records


def test_dynamic_loss_scale_unscales_exactly(prepared, run_a, tmp_path):
    # a power-of-two scale is exact in fp32, so the scaled step must reproduce the
    # unscaled run: the reported grad norm is the unscaled one and the update the same
    run = tmp_path / "ls"
    cfg = base_config(prepared, run, lr_scheduler=SCHED, eval_dataset=None,
                      precision={"loss_scale": "dynamic", "initial_loss_scale": 1024.0})  # fmt: skip
    assert run_config(cfg) == 0
    a, b = step_records(run_a), step_records(run)
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step]["loss_scale"] == 1024.0
        for key in ("step_loss", "grad_norm"):
            assert math.isclose(a[step][key], b[step][key], rel_tol=1e-5), (step, key)


def test_overflow_halves_the_scale_and_good_steps_double_it(prepared, tmp_path):
    # 2**68 overflows the squared gradient norm of this model (grad norm ~0.9-1.1: every
    # scale from 2**65 up overflows, 2**64 on some steps; measured: steps 1-4 skipped): the
    # first steps are skipped and the scale halves each time; overflow skips are expected
    # under loss scaling, so they never count toward max_consecutive_skips. The one-layer
    # TINY_MODEL (was the debug preset at 2**66): nothing here is compared with another
    # run, and its graph compiles in a fraction of the debug preset's
    run = tmp_path / "of"
    initial = 2.0**68
    cfg = base_config(prepared, run, model=TINY_MODEL, lr_scheduler=SCHED, eval_dataset=None,
                      training={"train_iters": 10, "max_consecutive_skips": 2},
                      precision={"loss_scale": "dynamic", "initial_loss_scale": initial,
                                 "loss_scale_window": 2})  # fmt: skip
    assert run_config(cfg) == 0
    recs = step_records(run)
    skipped = {e["step"] for e in events(run, "anomaly")}
    assert all(e["kind"] == "nonfinite_grad" and e["action"] == "skipped"
               for e in events(run, "anomaly"))  # fmt: skip
    assert {1, 2, 3} <= skipped, skipped  # at least three in a row, more than the limit of 2
    assert recs[10]["skipped_steps"] == len(skipped)
    prev, good, doubled = initial, 0, False
    for step in range(1, 11):
        scale = recs[step]["loss_scale"]
        if step in skipped:
            assert scale == prev / 2, (step, scale, prev)
            good = 0
        else:
            good += 1
            if good == 2:
                assert scale == prev * 2, (step, scale, prev)
                good, doubled = 0, True
            else:
                assert scale == prev, (step, scale, prev)
        prev = scale
    assert doubled
    assert all(math.isfinite(recs[s]["step_loss"]) for s in recs)
    assert events(run, "end")[-1]["status"] == "completed"


def test_fp16_compute_trains_with_automatic_loss_scaling(prepared, run_a, tmp_path):
    run = tmp_path / "fp16"
    cfg = base_config(prepared, run, lr_scheduler=SCHED, eval_dataset=None,
                      precision={"compute_dtype": "fp16"})  # fmt: skip
    assert run_config(cfg) == 0
    a, b = step_records(run_a), step_records(run)
    assert sorted(b) == list(range(1, 9))
    assert b[1]["loss_scale"] == 65536.0  # `auto` turns dynamic scaling on for fp16
    # same weights and data as the fp32 run: fp16 matmuls change the numbers a little
    assert math.isclose(a[1]["step_loss"], b[1]["step_loss"], rel_tol=1e-2)
    assert all(math.isfinite(r["step_loss"]) for r in b.values())
    assert b[8]["loss"] < b[1]["loss"]  # it learns
    assert not events(run, "anomaly")


def test_dropout_is_on_in_training_and_off_in_eval(prepared, run_a, tmp_path):
    # MindSpore cells start in inference mode, where nn.Dropout is the identity: a trainer
    # that forgets set_train(True) trains without dropout and nobody notices
    from mindloom_train._config import from_dict
    from mindloom_train._trainer import Trainer

    model = {"preset": "debug", "vocab_size": None, "dropout": 0.3}
    short = {"train_iters": 2, "eval_interval": 2}
    on = base_config(prepared, tmp_path / "on", lr_scheduler=SCHED, model=model, training=short)
    trainer = Trainer(from_dict(on))
    assert trainer.run() == 0
    # run_a: the same weights and data without dropout (a step's loss is computed before its
    # update, and the first batches do not depend on train_iters), so only dropout can
    # change the first step's loss
    a, b = step_records(tmp_path / "on"), step_records(run_a)
    assert a[1]["step_loss"] != b[1]["step_loss"]
    # evaluation runs without dropout: the same weights evaluate to the same loss twice
    assert trainer.evaluate(2) == trainer.evaluate(2)
