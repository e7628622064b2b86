"""What the expert-parallel launch tests share: `ep_worker.py`'s one-process reference run
beside a launch, and the checks of a 4-worker DeepSeek-V3 layout against it (losses and
their parts, expert loads, weights, biases, ZeRO-1 moments).

`test_parallel_msrun_four.py` runs dp4_ep2_zero1 in its 4-worker launch (default suite);
`test_parallel_ep_four.py` runs pp2_ep2 and tp2_ep2 in its own (opt-in).
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

# layout -> stage -> the rows of the reference's 3 routers (layer 0, layer 1, MTP) it holds
ROUTERS = {"pp2_ep2": {0: [0], 1: [1, 2]}, "dp4_ep2_zero1": {0: [0, 1, 2]},
           "tp2_ep2": {0: [0, 1, 2]}}  # fmt: skip


def steps_env(steps: int | None) -> dict[str, str]:
    """The environment that gives `ep_worker` (the reference and the launch's workers)
    `steps` steps; None: its own default, or MINDLOOM_EP_STEPS as set."""
    return {} if steps is None else {"MINDLOOM_EP_STEPS": str(steps)}


def start_reference(ref_dir: Path, steps: int | None = None):
    """`ep_worker.py --reference` in its own process, started now (the launch's workers
    share the cores meanwhile); returns a `finish()` that waits for it and asserts it
    passed."""
    box: dict = {}
    env = dict(os.environ, GLOG_v="3", **steps_env(steps))

    def run():
        box["proc"] = subprocess.run(
            [sys.executable, str(HERE / "ep_worker.py"), str(ref_dir), "--reference"],
            env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip

    thread = threading.Thread(target=run)
    thread.start()

    def finish() -> None:
        thread.join()
        proc = box["proc"]
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    return finish


def runs_of(out: Path, ref_dir: Path, res: dict, steps: int | None = None) -> dict:
    """The dict every check takes: the layouts' directory, the reference's, the per-rank
    results (rank -> layout -> record), the reference's record and the step count."""
    return {"out": out, "ref_dir": ref_dir, "res": res, "steps": steps or W.STEPS,
            "ref": json.loads((ref_dir / "reference.json").read_text())}  # fmt: skip


def assemble(layout: str, runs: dict) -> dict[str, np.ndarray]:
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


def check_losses_and_loads(layout: str, runs: dict) -> None:
    """Every rank's per-step loss and its main / MTP / balance parts within 1e-5 relative
    of one process, no token dropped, the global loads at this rank's routers exactly the
    reference's, and every router's bias moved."""
    ref = runs["ref"]
    want = np.array(ref["loss"])
    assert len(want) == runs["steps"]
    for rank, res in runs["res"].items():
        r = res[layout]
        np.testing.assert_allclose(r["loss"], want, rtol=1e-5, atol=0, err_msg=f"{layout} {rank}")
        # main, MTP and balance parts summed over the micro-batches (dropless: 0 dropped)
        np.testing.assert_allclose(np.array(r["stats"])[:, :3], np.array(ref["stats"])[:, :3],
                                   rtol=1e-5, atol=0, err_msg=f"{layout} rank {rank}")  # fmt: skip
        assert np.array(r["stats"])[:, 3].sum() == 0
        rows = ROUTERS[layout][r["stage"]]
        for step in range(runs["steps"]):
            # the global batch's token-slots per expert at this rank's routers, exactly
            assert r["loads"][step] == [ref["loads"][step][i] for i in rows], (layout, rank, step)
    # every router's bias moved (an untrained router's scores differ by less than one
    # bias step, so the biases steer the routing: the loads above cover the update; a
    # bias can swing back to 0, hence 'at some step')
    moved = np.abs(np.array(ref["biases"])).max(axis=(0, 2))
    assert moved.shape == (3,) and (moved > 0).all(), moved


def check_final_weights_and_biases(layout: str, runs: dict) -> None:
    """The assembled final weights within 1e-4 of one process's, the biases equal."""
    full = assemble(layout, runs)
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
    assert moved > 1e-2  # AdamW steps of lr 3e-3 (8 or 20) moved the weights


def check_biases_follow_the_numpy_rule(layout: str, runs: dict) -> None:
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


def check_zero1_dp_above_ep(runs: dict, layout: str = "dp4_ep2_zero1") -> None:
    """dp4 + ep2: the dense AdamW state split over 4 ranks, each expert block's over its 2
    holders (the expert-data-parallel group); the moments the owners hold, assembled, are
    the one-process AdamW's."""
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


def skip_unless(layout: str, layouts) -> None:
    if layout not in layouts:
        pytest.skip(f"{layout} not run (MINDLOOM_EP_LAYOUTS)")
