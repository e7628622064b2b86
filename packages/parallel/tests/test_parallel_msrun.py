"""Every two-worker layout trains the same model as one process (real msrun, CPU backend).

One 2-worker launch runs dp2 (+ZeRO-1, 2 micro-batches), dp2 with plain SGD (one
micro-batch), tp2, tp2+sp, pp2 (4 micro-batches, 1F1B), pp2 with tied embeddings, dp2 with
the GradReducer inside a compiled (@jit) step, tp2 and tp2+sp compiled, dp2 + ZeRO-1 as
one compiled step (ZeroShardUpdate) and pp2 (untied and tied) with compiled stage graphs,
one after another; every check here shares it. Each layout is compared with the
one-process reference (`msrun_checks`): losses, final weights, and for AdamW (dp2, ZeRO-1)
the final weights and moments against a NumPy AdamW fed the same gradients (SGD keeps no
optimizer state). The 4-worker layouts are `test_parallel_msrun_four.py`'s: a file each,
so pytest-xdist runs the two launches at once.
"""

from __future__ import annotations

import numpy as np
import pytest
from msrun_checks import W, check_layout, launch_layouts

pytestmark = pytest.mark.msrun

TWO_WORKER_LAYOUTS = ["dp2", "dp2_sgd", "tp2", "tp2_sp", "pp2", "pp2_tied", "dp2_compiled",
                      "tp2_compiled", "tp2_sp_compiled", "dp2_zero1_compiled", "pp2_compiled",
                      "pp2_tied_compiled"]  # fmt: skip
# run in the same launch, checked against NumPy on its own (not a layout of the model)
TWO_WORKER_EXTRA = ["tp2_mlp_compiled"]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def two_workers(out, reference):
    return launch_layouts(out, "two", TWO_WORKER_LAYOUTS + TWO_WORKER_EXTRA, 2)


@pytest.mark.parametrize("layout", TWO_WORKER_LAYOUTS)
def test_two_worker_layouts_match_one_process(layout, two_workers, reference, out):
    get, ref_dir = reference
    check_layout(layout, two_workers, get(), out / "two", ref_dir)


def test_layouts_report_the_same_grad_norm(two_workers):
    layouts = ("tp2", "tp2_sp", "pp2", "tp2_compiled", "tp2_sp_compiled", "pp2_compiled")
    norms = {name: two_workers[0][name]["grad_norms"] for name in layouts}
    for name in layouts[1:]:
        np.testing.assert_allclose(norms["tp2"], norms[name], rtol=1e-5, err_msg=name)


def test_compiled_zero1_keeps_half_the_state_and_identical_replicas(two_workers, out):
    """dp2 + ZeRO-1 as one compiled step (ZeroShardUpdate): each rank holds AdamW moments
    for its owned parameters only (together every parameter once, each rank under the
    whole), and after the owners' share both replicas hold the same bytes (the weights
    against one process and NumPy AdamW, and the gathered moments, are checked above)."""
    res = {r: two_workers[r]["dp2_zero1_compiled"] for r in (0, 1)}
    total = res[0]["values"]
    assert res[0]["state_values"] + res[1]["state_values"] == total
    assert all(0 < res[r]["state_values"] < total for r in (0, 1))
    print("ZeRO-1 moments per rank:", [res[r]["state_values"] for r in (0, 1)], "of", total)
    a = np.load(out / "two" / "dp2_zero1_compiled_rank0.npz")
    b = np.load(out / "two" / "dp2_zero1_compiled_rank1.npz")
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _silu(z):
    return z / (1.0 + np.exp(-z))


def test_compiled_column_row_parallel_mlp_equals_numpy(two_workers, out):
    """The smallest compiled TP graph (parallel_worker.run_mlp_compiled): f, a column-
    parallel W1, SiLU, a row-parallel W2, g, mean squared error, in one @jit graph per
    rank. Loss, input gradient (f's backward all-reduce) and each rank's weight-shard
    gradients against the whole MLP's forward and backward written out in NumPy."""
    a = {k: v.astype(np.float64) for k, v in W.mlp_arrays().items()}
    x, w1, w2, t = a["x"], a["w1"], a["w2"], a["t"]
    z = x @ w1.T
    h = _silu(z)
    y = h @ w2.T
    loss = ((y - t) ** 2).mean()
    dy = 2.0 * (y - t) / y.size
    gw2 = np.einsum("bsd,bsf->df", dy, h)
    dh = dy @ w2
    sig = 1.0 / (1.0 + np.exp(-z))
    dz = dh * (sig * (1.0 + z * (1.0 - sig)))
    gw1 = np.einsum("bsf,bsd->fd", dz, x)
    dx = dz @ w1
    k1, k2 = w1.shape[0] // 2, w2.shape[1] // 2
    for rank in (0, 1):
        got = np.load(out / "two" / f"tp2_mlp_compiled_rank{rank}.npz")
        np.testing.assert_allclose(got["loss"], loss, rtol=1e-5)
        np.testing.assert_allclose(got["dx"], dx, rtol=1e-4, atol=1e-6, err_msg="input grad")
        np.testing.assert_allclose(got["w1"], gw1[rank * k1 : (rank + 1) * k1], rtol=1e-4,
                                   atol=1e-6, err_msg=f"rank {rank}: column W1 grad")  # fmt: skip
        np.testing.assert_allclose(got["w2"], gw2[:, rank * k2 : (rank + 1) * k2], rtol=1e-4,
                                   atol=1e-6, err_msg=f"rank {rank}: row W2 grad")  # fmt: skip


def test_compiled_pipeline_equals_the_engine(two_workers):
    """PipelineGraph (compiled stage graphs) against ParallelEngine's PyNative pipeline on
    the same batches, untied (4 micro-batches) and tied (2): the same losses and global
    gradient norms on both ranks (both also equal one process, above)."""
    for compiled, engine in (("pp2_compiled", "pp2"), ("pp2_tied_compiled", "pp2_tied")):
        for rank, res in two_workers.items():
            for key in ("losses", "grad_norms"):
                np.testing.assert_allclose(res[compiled][key], res[engine][key], rtol=1e-5,
                                           err_msg=f"{compiled} rank {rank} {key}")  # fmt: skip
