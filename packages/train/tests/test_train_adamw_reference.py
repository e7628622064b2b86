"""The trainer's AdamW against torch.optim.AdamW on the same gradients, step by step.

Every other train test compares the trainer with itself (resume, loss scale, layouts), so
a wrong update that is wrong the same way everywhere (bias correction dropped, decay on
norms) passes them. Here the reference is torch's own optimizer and clipping:

- the compiled steps: `AccumStep` then the fused `TrainStep` (a numerics log step's path)
  on odd steps, `AccumStep` twice then `UpdateStep` (every other accumulated step's) on
  even ones; a loss that is linear in the weights, so the gradient is exactly the tensor
  fed in; two micro-batches, a 2**10 loss scale, clipping
  active on some steps only, a changing learning rate, decay on matrices only and not on
  the embedding (`decay_embeddings: false`), one skipped (inf-gradient) step;
- the engine path (`EngineStep`, used under `mindloom launch` for tp/pp/ZeRO-1): the real
  model's gradients, taken from the engine at the same weights just before its step.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

BETAS, EPS, WD, CLIP, SCALE = (0.9, 0.95), 1e-8, 0.1, 1.0, 1024.0
LRS = [1e-2, 2e-2, 5e-3, 1e-2, 8e-3]
# max |ms - torch| was 7.5e-9 on weights (float32 rounding of the folded scalars); the planted bugs
# (no bias correction, decay on norms, clip or unscale dropped) move weights by >= 1e-4
ATOL, RTOL = 1e-6, 1e-4


def _debug_params():
    from mindloom_model import Llama, get_preset

    model = Llama(get_preset("debug", vocab_size=64))
    return model, list(model.trainable_params())


def _torch_adamw(params, names, decayed):
    tp = {n: torch.tensor(p.asnumpy().copy(), requires_grad=True) for n, p in zip(names, params)}
    groups = [
        {"params": [tp[n] for n in names if n in decayed], "weight_decay": WD},
        {"params": [tp[n] for n in names if n not in decayed], "weight_decay": 0.0},
    ]
    return tp, torch.optim.AdamW(groups, lr=LRS[0], betas=BETAS, eps=EPS)


def _torch_step(opt, tp, names, grads: dict, lr: float) -> float:
    for n in names:
        tp[n].grad = torch.tensor(grads[n])
    norm = float(torch.nn.utils.clip_grad_norm_([tp[n] for n in names], CLIP))
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()
    return norm


def _assert_same(names, ms_w, ms_m, ms_v, tp, opt, step):
    for n, w, m, v in zip(names, ms_w, ms_m, ms_v):
        st = opt.state[tp[n]]
        np.testing.assert_allclose(w, tp[n].detach().numpy(), rtol=RTOL, atol=ATOL,
                                   err_msg=f"step {step} weight {n}")  # fmt: skip
        np.testing.assert_allclose(m, st["exp_avg"].numpy(), rtol=RTOL, atol=ATOL,
                                   err_msg=f"step {step} exp_avg {n}")  # fmt: skip
        np.testing.assert_allclose(v, st["exp_avg_sq"].numpy(), rtol=RTOL, atol=ATOL * 1e-3,
                                   err_msg=f"step {step} exp_avg_sq {n}")  # fmt: skip


@pytest.mark.parametrize("norm", ["fused kernel", "matmuls"])
def test_compiled_step_matches_torch_adamw(tmp_path, norm):
    """`norm`: the global gradient norm by the fused CPU kernel (KernelSquareSums, what a
    model with `kernels: auto` gets) or by one matmul per tensor (the portable path)."""
    import mindspore as ms
    from mindloom_model import cpu_kernels_buildable, get_preset, square_sums_kernel
    from mindloom_train import _step as S
    from mindspore import Tensor
    from train_testutil import linear_loss_setup

    if norm == "fused kernel" and not cpu_kernels_buildable():
        pytest.skip("no C++ compiler: the fused kernels cannot be built here")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    lin = linear_loss_setup()
    params, names, shapes, sizes = lin.params, lin.names, lin.shapes, lin.sizes
    # independent of decay_flags: every matrix except the embedding (decay_embeddings off)
    decayed = {n for n, s in zip(names, shapes) if len(s) == 2 and n != "embed.weight"}
    assert "lm_head.weight" in decayed and "norm.weight" not in decayed

    loss_net = lin.loss_net
    weights = ms.ParameterTuple(params)
    flags = S.decay_flags(params, decay_embeddings=False)
    train = S.TrainStep(loss_net, weights, flags, accum_steps=2)
    # the linear loss net has no model config: the kernel is set by hand (before the
    # UpdateStep sibling, which shares it)
    train.square_sums = (square_sums_kernel(get_preset("debug"), len(params))
                         if norm == "fused kernel" else None)  # fmt: skip
    if norm == "fused kernel":
        assert train.square_sums is not None, "the fused kernels did not build"
    accum = S.AccumStep(loss_net, weights, train.acc)
    update = S.UpdateStep(loss_net, weights, flags, accum_steps=2, share=train)
    tp, opt = _torch_adamw(params, names, decayed)
    dummy = Tensor(np.zeros(1, np.float32))
    rng = np.random.default_rng(0)
    adam_step = 0
    # per step: the two micro-batches' gradient size; large ones are clipped, small are not
    magnitudes = [3.0, 0.02, 5.0, "inf", 0.05, 2.0]
    for step, mag in enumerate(magnitudes, 1):
        poisoned = mag == "inf"
        mag = 1.0 if poisoned else mag
        micro = [
            [(rng.standard_normal(s) * mag / np.sqrt(sum(sizes))).astype(np.float32) for s in shapes]
            for _ in range(2)
        ]  # fmt: skip
        lr = LRS[adam_step % len(LRS)]
        h = dict(lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                 adam_step=adam_step + 1, clip=CLIP, spike=None, loss_scale=SCALE, n_micro=2)  # fmt: skip
        flat = [lin.flat(mb) for mb in micro]
        l1 = accum(flat[0], dummy, dummy, dummy, dummy, S.hyper_vector(**h))
        last = S.hyper_vector(**h, inf_grad=poisoned, prev_loss_sum=float(l1.asnumpy()))
        if step % 2:
            _, gnorm, ok, _ = train(flat[1], dummy, dummy, dummy, dummy, last)
        else:
            l2 = accum(flat[1], dummy, dummy, dummy, dummy, S.hyper_vector(**h))
            _, gnorm, ok, _ = update(l2, last)
        if poisoned:
            assert not bool(ok.asnumpy()), "an inf gradient must skip the update"
        else:
            assert bool(ok.asnumpy())
            adam_step += 1
            mean = {n: (a + b) / 2 for n, a, b in zip(names, micro[0], micro[1])}
            ref_norm = _torch_step(opt, tp, names, mean, lr)
            assert float(gnorm.asnumpy()) == pytest.approx(ref_norm, rel=1e-5)
            assert (ref_norm > CLIP) == (mag >= 1.0)  # both regimes are exercised
        _assert_same(names, [p.asnumpy() for p in params],
                     [m.asnumpy() for m in train.exp_avg],
                     [v.asnumpy() for v in train.exp_avg_sq], tp, opt, step)  # fmt: skip
    assert adam_step == 5


def test_engine_step_matches_torch_adamw():
    import mindspore as ms
    from mindloom_parallel import ParallelConfig, init_parallel
    from mindloom_train import _step as S
    from mindloom_train._parallel import EngineStep

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    model, params = _debug_params()
    model.set_train(True)
    # zero_stage=1 selects the engine path even in one process (dp = 1 owns everything)
    pcfg = ParallelConfig(zero_stage=1)
    cfg = SimpleNamespace(training=SimpleNamespace(micro_batch_size=4),
                          optimizer=SimpleNamespace(decay_embeddings=True))  # fmt: skip
    es = EngineStep(model, cfg, pcfg, init_parallel(pcfg), lambda msg: None)
    names = list(es.names)
    decayed = {n for n, p in zip(names, es.params) if len(p.shape) == 2}  # embeddings decay too
    tp, opt = _torch_adamw(es.params, names, decayed)
    rng = np.random.default_rng(3)
    for step in range(1, 5):
        toks = rng.integers(0, 64, (4, 17)).astype(np.int32)
        batch = {"tokens": toks[:, :-1].copy(), "labels": toks[:, 1:].copy(),
                 "position_ids": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
                 "segment_ids": np.zeros((4, 16), np.int32),
                 "loss_mask": np.ones((4, 16), np.float32)}  # fmt: skip
        _, grads = es.engine.forward_backward(batch)  # the gradients the step will see
        grads = {n: g.asnumpy() * 40.0 for n, g in zip(names, grads)}  # x grad_mult
        lr = LRS[step % len(LRS)]
        h = S.hyper_vector(lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                           adam_step=step, clip=CLIP, spike=None, loss_scale=1.0,
                           grad_mult=40.0).asnumpy()  # fmt: skip
        _, gnorm, ok, _, _ = es.step([batch], h, stop=False, time_up=False)
        assert ok
        ref_norm = _torch_step(opt, tp, names, grads, lr)
        assert gnorm == pytest.approx(ref_norm, rel=1e-5)
        assert ref_norm > CLIP  # x40 puts every step in the clipped regime
        _assert_same(names, [p.asnumpy() for p in es.params],
                     [es.exp_avg[i].asnumpy() for i in range(len(names))],
                     [es.exp_avg_sq[i].asnumpy() for i in range(len(names))], tp, opt, step)  # fmt: skip
