"""The compiled step's optional numerics (issue 18, local norms): per-layer gradient and
parameter norms, update/weight ratio and AdamW moment statistics, against NumPy on the
weights and moments before and after each step.

Like test_train_adamw_reference.py (the same set-up: train_testutil.linear_loss_setup), the
loss is linear in the weights, so the gradient is exactly the tensor fed in; a loss scale
and clipping are active, so unscaling and the order of the weight copy against the
in-place update are both exercised."""

from __future__ import annotations

import numpy as np
import pytest

SCALE, CLIP = 1024.0, 1.0


def test_numerics_per_layer_match_numpy():
    import mindspore as ms
    from mindloom_train import _step as S
    from mindspore import Tensor
    from train_testutil import linear_loss_setup

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    lin = linear_loss_setup()
    params, names, shapes, sizes = lin.params, lin.names, lin.shapes, lin.sizes
    layer_of = {n: int(n.split(".")[1]) for n in names if n.startswith("layers.")}
    assert sorted(set(layer_of.values())) == [0, 1]

    weights = ms.ParameterTuple(params)
    step = S.TrainStep(lin.loss_net, weights, S.decay_flags(params, False), numerics=True)
    dummy = Tensor(np.zeros(1, np.float32))
    rng = np.random.default_rng(0)
    for adam_step, mag in enumerate((3.0, 0.05), 1):  # clipped, then not
        grads = [(rng.standard_normal(s) * mag / np.sqrt(sum(sizes))).astype(np.float32)
                 for s in shapes]  # fmt: skip
        before = [p.asnumpy().copy() for p in params]
        h = S.hyper_vector(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                           adam_step=adam_step, clip=CLIP, spike=None, loss_scale=SCALE)  # fmt: skip
        _, _, ok, _, rows = step(lin.flat(grads), dummy, dummy, dummy, dummy, h)
        assert bool(ok.asnumpy())
        got = S.layer_numerics(names, sizes, rows.asnumpy())
        after = [p.asnumpy() for p in params]
        ms_m = [m.asnumpy() for m in step.exp_avg]
        ms_v = [v.asnumpy() for v in step.exp_avg_sq]
        for layer in (0, 1):
            idx = [i for i, n in enumerate(names) if layer_of.get(n) == layer]
            gn = np.sqrt(sum(float((grads[i].astype(np.float64) ** 2).sum()) for i in idx))
            wn = np.sqrt(sum(float((before[i].astype(np.float64) ** 2).sum()) for i in idx))
            un = np.sqrt(sum(float(((after[i] - before[i]).astype(np.float64) ** 2).sum())
                             for i in idx))  # fmt: skip
            n = sum(sizes[i] for i in idx)
            m = sum(float(np.abs(ms_m[i]).sum()) for i in idx) / n
            v = sum(float(np.sqrt(ms_v[i]).sum()) for i in idx) / n
            assert got["grad_norm_layers"][layer] == pytest.approx(gn, rel=1e-5)
            assert got["param_norm_layers"][layer] == pytest.approx(wn, rel=1e-5)
            assert un > 0 and got["update_ratio_layers"][layer] == pytest.approx(un / wn, rel=1e-4)
            assert got["adam_m_layers"][layer] == pytest.approx(m, rel=1e-5)
            assert got["adam_sqrt_v_layers"][layer] == pytest.approx(v, rel=1e-5)
        assert len(got["grad_norm_layers"]) == 2
