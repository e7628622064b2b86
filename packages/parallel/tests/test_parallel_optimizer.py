"""ShardedOptimizer in one process against NumPy written from torch's documented update
(AdamW: bias correction, decoupled decay; SGD: heavy-ball momentum). The ZeRO-1 shards
are checked against the same NumPy AdamW in test_parallel_msrun.py (layout dp2)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import parallel_worker as W  # noqa: E402

SHAPES = {"a.weight": (6, 5), "norm.weight": (5,), "b.weight": (3, 7)}


def _run(kind: str, steps: int = 6, **kw):
    import mindspore as ms
    from mindloom_parallel import Group, ShardedOptimizer
    from mindspore import Parameter, Tensor

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    rng = np.random.default_rng(5)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    params = [Parameter(Tensor(v.copy()), name=n) for n, v in init.items()]
    opt = ShardedOptimizer(params, Group(None, (0,), 0), 0, kind=kind, **kw)
    # gradient sizes from 1e-3 to 10: Adam's normalisation must not hide a missing correction
    grads = [
        {n: (rng.standard_normal(s) * 10.0 ** rng.integers(-3, 2)).astype(np.float32)
         for n, s in SHAPES.items()}
        for _ in range(steps)
    ]  # fmt: skip
    for g in grads:
        opt.step([Tensor(g[n]) for n in SHAPES])
    got = {n: p.asnumpy() for n, p in zip(SHAPES, params)}
    return init, grads, got, opt


def test_adamw_matches_numpy_adamw():
    init, grads, got, opt = _run("adamw", lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = W.numpy_adamw(init, grads, lr=0.05, wd=0.1, betas=(0.9, 0.95), eps=1e-8)
    state = opt.gather_state(list(SHAPES))
    for n in SHAPES:
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-5, atol=1e-6, err_msg=n)
        np.testing.assert_allclose(state[f"{n}.exp_avg"], ref[f"exp_avg.{n}"], rtol=1e-5,
                                   atol=1e-7, err_msg=n)  # fmt: skip
        np.testing.assert_allclose(state[f"{n}.exp_avg_sq"], ref[f"exp_avg_sq.{n}"],
                                   rtol=1e-5, atol=1e-9, err_msg=n)  # fmt: skip


def test_sgd_momentum_matches_numpy():
    init, grads, got, _ = _run("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
    for n in SHAPES:
        w = init[n].astype(np.float64)
        buf = np.zeros_like(w)
        # ShardedOptimizer's documented rule: decay outside the momentum buffer (torch's
        # SGD folds it into the gradient instead; the two agree when wd = 0)
        for g in grads:
            buf = 0.9 * buf + g[n]
            w = w - 0.1 * (buf + 0.01 * w)
        np.testing.assert_allclose(got[n], w, rtol=1e-5, atol=1e-6, err_msg=n)
