"""Dropout resumes bit-exactly on the engine path too: the PyNative `ParallelEngine` that tp,
pp and ZeRO-1 run under `mindloom launch` draws the counter-based masks keyed by (seed,
step, micro-batch), as the compiled step does. One process, no msrun: `zero_stage: 1`
selects the engine path, driven through train's own `EngineRunner` (which makes the keys)
with the runtime's layout fields filled in as `Runtime.init_dist` fills them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

SEQ, MICRO, ACCUM = 16, 2, 2


def _config(dropout: float):
    from mindloom_train._config import from_dict

    return from_dict({
        "model": {"preset": "debug", "vocab_size": 64, "dropout": dropout},
        "train_dataset": {"data_prefix": ["unused"], "seq_length": SEQ},
        "training": {"train_iters": 3, "global_batch_size": MICRO * ACCUM,
                     "micro_batch_size": MICRO},
        "parallelism": {"zero_stage": 1},
        "seed": 7,
    })  # fmt: skip


def _runner(cfg):
    from mindloom_model import Llama
    from mindloom_parallel import ParallelDims, init_parallel
    from mindloom_train._modelcfg import build_model_config
    from mindloom_train._runner import EngineRunner

    mcfg = build_model_config(cfg, None)
    model = Llama(mcfg)  # the same initial weights every time (init_seed)
    model.set_train(True)
    pcfg = ParallelDims.from_section(cfg.parallelism).for_steps(cfg.grad_accum_steps)
    rt = SimpleNamespace(pcfg=pcfg, groups=init_parallel(pcfg), rank=0, world=1,
                         dp_rank=0, dp_size=1)  # fmt: skip
    return EngineRunner(SimpleNamespace(model=model, mcfg=mcfg), cfg, rt, lambda msg: None)


def _micro_batches(step: int):
    for i in range(ACCUM):
        toks = np.random.default_rng(100 * step + i).integers(0, 64, (MICRO, SEQ + 1))
        toks = toks.astype(np.int32)
        yield {"tokens": toks[:, :-1].copy(), "labels": toks[:, 1:].copy(),
               "position_ids": np.tile(np.arange(SEQ, dtype=np.int32), (MICRO, 1)),
               "segment_ids": np.zeros((MICRO, SEQ), np.int32),
               "loss_mask": np.ones((MICRO, SEQ), np.float32)}  # fmt: skip


def _step(runner, step: int) -> tuple[float, float]:
    from mindloom_train import _step as S
    from mindloom_train._runner import StepInputs

    def hyper(**over):
        return S.hyper_vector(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                              adam_step=step, clip=1.0, spike=None, loss_scale=1.0, **over)  # fmt: skip

    res = runner.step(StepInputs(step, _micro_batches(step), hyper, lambda: (False, False)))
    assert res.ok
    return res.loss, res.gnorm


def test_engine_dropout_resumed_step_equals_the_uninterrupted_one():
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    cfg = _config(0.1)
    a = _runner(cfg)
    first = _step(a, 1)
    _step(a, 2)
    state = {}
    for tensors in a.par.gather_shards().values():  # one process: every shard is whole
        state.update(tensors)
    third = _step(a, 3)

    # a fresh runner and model resumed from step 2's weights and moments: step 3 again
    b = _runner(cfg)
    b.load(state, "step 2")
    assert _step(b, 3) == third

    # and dropout is really on: without it the first step has another loss
    assert _step(_runner(_config(0.0)), 1)[0] != first[0]
