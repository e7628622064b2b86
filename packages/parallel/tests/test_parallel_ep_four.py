"""Expert parallel with pipeline parallel, and ZeRO-1 with dp > ep, on 4 msrun workers
(real msrun, CPU backend), against one process (issue 17).

One 4-worker launch (`ep_worker.py`) runs, one after the other in the same workers:

- pp2_ep2: pp = 2, dp = 2, ep = 2 (`MoEPipelineGraph`: compiled stage graphs, 1F1B in
  Python; stage 0 = layer 0, stage 1 = layer 1 + the MTP block, each stage's 8 experts
  split over its two ranks);
- dp4_ep2_zero1: dp = 4, ep = 2, ZeRO-1 (`EPZeroShardUpdate` with an expert-data-parallel
  group of 2: the case dp == ep never runs), one compiled step.

The one-process reference runs in its own process meanwhile. 20 AdamW steps of a 2-layer
DeepSeek-V3 (both layers MoE, 3 routers with the MTP block's), the bias moving the routing.
Checks: every rank's per-step loss (and main / MTP / balance parts) within 1e-5 relative,
the global expert loads equal, the final weights (every replica byte-identical, the expert
blocks assembled) within 1e-4 and the biases equal; the biases also against NumPy's sign
rule from the recorded loads; ZeRO-1's assembled moments against the reference AdamW's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import ep_worker as W  # noqa: E402

# opt-in (`./dev test --slow`, docs/testing.md): ~300 CPU-s of compiles for layouts the trainer
# does not run yet (pp + ep is refused by `mindloom train`); it joins the default suite, in
# a shared launch, when the trainer wires pp + ep
pytestmark = [pytest.mark.msrun, pytest.mark.slow]

# MINDLOOM_EP_LAYOUTS runs some of them (the plants were tried so)
LAYOUTS = os.environ.get("MINDLOOM_EP_LAYOUTS", "pp2_ep2,dp4_ep2_zero1,tp2_ep2").split(",")
ROUTERS = {"pp2_ep2": {0: [0], 1: [1, 2]}, "dp4_ep2_zero1": {0: [0, 1, 2]},
           "tp2_ep2": {0: [0, 1, 2]}}  # stage -> rows  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from mindloom_parallel import launch

    out = tmp_path_factory.mktemp("ep_four")
    ref_dir = out / "ref"
    ref_out: dict = {}

    def reference():  # its own process: the launch's workers share the cores meanwhile
        ref_out["proc"] = subprocess.run(
            [sys.executable, str(HERE / "ep_worker.py"), str(ref_dir), "--reference"],
            env=dict(os.environ, GLOG_v="3"), capture_output=True, text=True, timeout=900,
        )  # fmt: skip

    thread = threading.Thread(target=reference)
    thread.start()
    try:
        launch([str(HERE / "ep_worker.py"), str(out / "four"), "--layouts", ",".join(LAYOUTS)],
               nproc=4, log_dir=out / "logs", timeout_s=900, cluster_timeout_s=300)  # fmt: skip
    finally:
        thread.join()
    proc = ref_out["proc"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = {r: json.loads((out / "four" / f"result_rank{r}.json").read_text()) for r in range(4)}
    return {"out": out / "four", "ref_dir": ref_dir, "res": res,
            "ref": json.loads((ref_dir / "reference.json").read_text())}  # fmt: skip


def _assemble(layout: str, runs: dict) -> dict[str, np.ndarray]:
    """Every rank's tensors -> global ones, by shape against the reference alone: a tensor
    whose shape is the global one must be byte-identical on every rank holding it; one
    with an axis shorter is a block of it (routed experts: axis 0, in ep order; a tp shard:
    the shorter axis, in tp order), and every copy of a block must be byte-identical too;
    every element of the global tensor must be covered."""
    ref = dict(np.load(runs["ref_dir"] / "reference.npz"))
    full: dict[str, np.ndarray] = {}
    covered: dict[str, np.ndarray] = {}
    for rank in range(4):
        r = runs["res"][rank][layout]
        for name, arr in np.load(runs["out"] / f"{layout}_rank{rank}.npz").items():
            want = ref[name].shape
            if name not in full:
                full[name] = np.zeros(want, arr.dtype)
                covered[name] = np.zeros(want, bool)
            axes = [a for a in range(len(want)) if arr.shape[a] != want[a]]
            assert len(axes) <= 1, (layout, name, arr.shape, want)
            where = [slice(None)] * len(want)
            if axes:
                (a,) = axes
                idx = r["ep_index"] if ".mlp.experts." in name else r["tp_index"]
                where[a] = slice(idx * arr.shape[a], (idx + 1) * arr.shape[a])
            where = tuple(where)
            seen = covered[name][where]
            assert seen.all() or not seen.any(), (layout, name, rank)
            if seen.any():
                np.testing.assert_array_equal(arr, full[name][where],
                                              err_msg=f"{layout}: replicas of {name}")  # fmt: skip
            full[name][where] = arr
            covered[name][where] = True
    for name, c in covered.items():
        assert c.all(), (layout, name, "not every element is held by some rank")
    return full


@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_and_expert_loads_equal_one_process(layout, runs):
    ref = runs["ref"]
    want = np.array(ref["loss"])
    assert len(want) == W.STEPS
    for rank, res in runs["res"].items():
        r = res[layout]
        np.testing.assert_allclose(r["loss"], want, rtol=1e-5, atol=0, err_msg=f"{layout} {rank}")
        # main, MTP and balance parts summed over the micro-batches (dropless: 0 dropped)
        np.testing.assert_allclose(np.array(r["stats"])[:, :3], np.array(ref["stats"])[:, :3],
                                   rtol=1e-5, atol=0, err_msg=f"{layout} rank {rank}")  # fmt: skip
        assert np.array(r["stats"])[:, 3].sum() == 0
        rows = ROUTERS[layout][r["stage"]]
        for step in range(W.STEPS):
            # the global batch's token-slots per expert at this rank's routers, exactly
            assert r["loads"][step] == [ref["loads"][step][i] for i in rows], (layout, rank, step)
    # every router's bias moved (an untrained router's scores differ by less than one
    # bias step, so the biases steer the routing: the loads above cover the update; a
    # bias can swing back to 0, hence 'at some step')
    moved = np.abs(np.array(ref["biases"])).max(axis=(0, 2))
    assert moved.shape == (3,) and (moved > 0).all(), moved


@pytest.mark.parametrize("layout", ["pp2_ep2", "tp2_ep2"])
def test_global_grad_norm_equals_one_process(layout, runs):
    """The global gradient norm against the norm of the one-process gradient computed in
    NumPy (float64). tp2 x ep2: the tp shards summed over tp, the whole tensors once, the
    MLA down-projections after their partial gradients are summed, the expert blocks over
    ep. pp2 x ep2 (`MoEPipelineGraph.grad_norm`): each stage's dense tensors once (the
    embedding's copy on the last stage, which the MTP block reads, not again), its expert
    blocks over ep, the stages summed."""
    if layout not in LAYOUTS:
        pytest.skip(f"{layout} not run (MINDLOOM_EP_LAYOUTS)")
    want = np.array(runs["ref"]["grad_norm"])
    assert want.min() > 0
    for rank, res in runs["res"].items():
        got = np.array(res[layout]["grad_norm"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0, err_msg=f"rank {rank}")


def test_pipeline_held_out_loss_equals_one_process(runs):
    """`MoEPipelineGraph.eval_loss` (stage to stage, the main CE on the last stage, the dp
    mean) of the first batch on the final weights against one process's CE of the same
    micro-batches."""
    if "pp2_ep2" not in LAYOUTS:
        pytest.skip("pp2_ep2 not run (MINDLOOM_EP_LAYOUTS)")
    want = runs["ref"]["eval"]
    assert 0 < want < 20
    for rank, res in runs["res"].items():
        assert res["pp2_ep2"]["eval"] == pytest.approx(want, rel=1e-5, abs=0), rank


@pytest.mark.parametrize("layout", LAYOUTS)
def test_final_weights_and_biases_equal_one_process(layout, runs):
    full = _assemble(layout, runs)
    ref = dict(np.load(runs["ref_dir"] / "reference.npz"))
    init = dict(np.load(runs["ref_dir"] / "reference_init.npz"))
    assert sorted(full) == sorted(ref)
    moved = 0.0
    for name in ref:
        assert full[name].shape == ref[name].shape, name
        if name.endswith("expert_bias"):
            np.testing.assert_array_equal(full[name], ref[name], err_msg=name)
        else:
            np.testing.assert_allclose(full[name], ref[name], rtol=0, atol=1e-4, err_msg=name)
        moved = max(moved, float(np.abs(ref[name] - init[name]).max()))
    assert moved > 1e-2  # 20 AdamW steps of lr 3e-3 moved the weights


@pytest.mark.parametrize("layout", LAYOUTS)
def test_biases_follow_the_numpy_rule_from_the_recorded_loads(layout, runs):
    """From the initial biases, NumPy's b += speed * sign(mean(load) - load) on the loads
    each rank recorded gives the final biases it saved."""
    init = dict(np.load(runs["ref_dir"] / "reference_init.npz"))
    names = sorted(
        (k for k in init if k.endswith("expert_bias")), key=lambda k: k.startswith("mtp")
    )
    assert len(names) == 3
    for rank, res in runs["res"].items():
        r = res[layout]
        rows = ROUTERS[layout][r["stage"]]
        bias = np.stack([init[names[i]] for i in rows]).astype(np.float32)
        for loads in r["loads"]:
            load = np.asarray(loads, np.float64)
            sign = np.sign(load.mean(1, keepdims=True) - load).astype(np.float32)
            bias = (bias + np.float32(W.SPEED) * sign).astype(np.float32)
        saved = np.load(runs["out"] / f"{layout}_rank{rank}.npz")
        np.testing.assert_array_equal(np.stack([saved[names[i]] for i in rows]), bias)


def test_zero1_with_dp_above_ep_shards_state_and_matches_the_reference_moments(runs):
    """dp4 + ep2: the dense AdamW state split over 4 ranks, each expert block's over its 2
    holders (the expert-data-parallel group); the moments the owners hold, assembled, are
    the one-process AdamW's."""
    if "dp4_ep2_zero1" not in LAYOUTS:
        pytest.skip("dp4_ep2_zero1 not run (MINDLOOM_EP_LAYOUTS)")
    layout = "dp4_ep2_zero1"
    ref = dict(np.load(runs["ref_dir"] / "reference_moments.npz"))
    held = [runs["res"][r][layout]["state_values"] for r in range(4)]
    weights = dict(np.load(runs["ref_dir"] / "reference_init.npz"))
    dense = sum(weights[n[2:]].size for n in ref if n.startswith("m.") and ".experts." not in n)
    expert = sum(weights[n[2:]].size for n in ref if n.startswith("m.") and ".experts." in n)
    assert sum(h[0] for h in held) == dense and all(0 < h[0] < dense for h in held)
    # each rank holds half of its E/ep experts' blocks' state: every expert value once per
    # expert-data-parallel group, i.e. expert values / ep / edp per rank on average
    assert sum(h[1] for h in held) == expert and all(0 < h[1] < expert // 2 for h in held)
    moments: dict[str, dict[int, np.ndarray]] = {}
    for rank in range(4):
        idx = runs["res"][rank][layout]["ep_index"]
        for k, v in np.load(runs["out"] / f"{layout}_moments_rank{rank}.npz").items():
            moments.setdefault(k, {})[idx] = v
    for key, blocks in moments.items():
        kind, name = key.split(".", 1)
        want = ref[("m." if kind == "exp_avg" else "v.") + name]
        got = np.concatenate([blocks[i] for i in sorted(blocks)]) if ".experts." in name \
            else blocks[0]  # fmt: skip
        atol = 1e-6 if kind == "exp_avg" else 1e-9
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=atol, err_msg=key)
