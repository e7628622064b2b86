"""Expert parallel (`parallelism.ep = 2`, DeepSeek-V3) through `mindloom launch` (real msrun,
2 CPU workers, the compiled step), against one process.

The model is the tiniest with every MoE part: deepseek-v3-debug cut to 2 layers (one
dense, one MoE with 8 routed experts) plus its MTP block (2 routers), the balance loss on,
a bias speed large enough to move the routing. Runs:

- A: one process, 20 steps, a checkpoint every step;
- L: `mindloom launch --nproc 2 ...` with `parallelism: {ep: 2, zero_stage: 1}` (dp not
  given: derived from the 2 workers, the quick start's form; ZeRO-1: dense AdamW state
  split over dp, each rank's expert blocks' state on that rank only) resuming from a copy
  of A's step-1 checkpoint (one process -> ep2 + ZeRO-1), steps 2-20, a checkpoint every
  step;
- L2: the same launch with `dp: 2` given, no ZeRO-1 and a capacity factor
  (`moe_capacity_factor: 1`, `override_drift`) resuming from a copy of L's step-10
  checkpoint (ep2 + ZeRO-1 -> ep2), stopped by SIGTERM during update 15 (it saves step 15
  and exits 0);
- AC: one process with the same capacity factor from the same step-10 checkpoint (ep2 +
  ZeRO-1 -> one process), steps 11-15, stopped as L2 (run while L2's workers start);

(Until 2026-12-03 a run R resumed L2's SIGTERM checkpoint on one process for steps 16-20;
AC resuming L's ep2 checkpoint, L2's step-15 tensors against AC's and the bookkeeping of
every ep checkpoint against the one-process one's cover what it did.) A, AC run in
processes of their own (see `_train`).

References: A and AC (losses within 1e-5 relative, the same expert loads, dropped slots
and biases), NumPy (the bias rule from the recorded loads, the tokens an all-to-all would
move from A's loads, torch's AdamW update of every tensor between two of L's
checkpoints; which slots a capacity drops: mindloom-parallel's test_parallel_ep.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from mindloom_train._checkpoint import Checkpoint, read_tracker
from train_testutil import (
    base_config,
    run_cli,
    start_launch,
    step_records,
    stop_launches,
    wait_launches,
)

STEPS = 20
SPEED = 0.01
E, R = 8, 2  # routed experts; routers (the trunk MoE layer and the MTP block's)
SLOTS = 8 * 32 * 2  # token-slots per router and step: 8 samples x 32 tokens x k = 2
EP = {"dp": 2, "ep": 2}
EP_ZERO = {"ep": 2, "zero_stage": 1}  # dp = world / (tp*pp) = 2
CAPACITY = {"moe_capacity_factor": 1.0}  # C = 32 slots per expert, rank and micro-batch
NUMERICS = {"numerics": True}  # L2 and AC: per-layer norms and moments at every step
NUMERICS_KEYS = ("grad_norm_layers", "param_norm_layers", "update_ratio_layers",
                 "adam_m_layers", "adam_sqrt_v_layers")  # fmt: skip


def _config(prepared, run: Path, **sections) -> dict:
    cfg = base_config(
        prepared, run,
        lr_scheduler={"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_iters": 2, "decay_iters": STEPS},
        model={"preset": "deepseek-v3-debug", "vocab_size": None, "num_layers": 2,
               "moe_bias_update_speed": SPEED, "moe_aux_loss_weight": 0.01},
        training={"train_iters": STEPS, "global_batch_size": 8, "micro_batch_size": 4},
        checkpoint={"save_interval": 5, "keep_last": 10},
    )  # fmt: skip
    del cfg["eval_dataset"]  # no held-out set: no evaluation graph to compile
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _train(cfg: dict, path: Path, fault: str | None = None) -> None:
    """One process, `mindloom train` in a process of its own: a second DeepSeek-V3
    Trainer in one Python process recompiles its accumulation graph at its second step
    (MindSpore state left by the first; 24-40 s of CPU here, measured 2026-12-03), which
    AC and R paid when they ran inside pytest after A."""
    path.write_text(yaml.safe_dump(cfg))
    out = run_cli("train", str(path), timeout=500, fault=fault)
    assert out.returncode == 0, out.stderr[-3000:]


def _seed_checkpoint(src: Path, step: int, run: Path) -> None:
    name = f"step_{step:08d}"
    shutil.copytree(src / "checkpoints" / name, run / "checkpoints" / name)
    (run / "checkpoints" / "latest").write_text(f"{step}\n")


# every step saved: L and T start from step 1, the tests read steps 5, 10, 15, 20
EVERY = {"save_interval": 1, "keep_last": STEPS + 1}


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory) -> dict:
    """A: one process, 20 steps, every step saved."""
    root = tmp_path_factory.mktemp("expert_parallel")
    _train(_config(prepared, root / "a", checkpoint=EVERY), root / "a.yaml")
    return {"root": root, "a": root / "a"}


@pytest.fixture(scope="module")
def runs(prepared, reference) -> dict:
    """A, then L (ep2 + ZeRO-1) resuming from A's step 1 (waited for here)."""
    root = reference["root"]
    out = {**reference, "l": root / "l"}
    every = EVERY
    _seed_checkpoint(out["a"], 1, out["l"])
    procs = {"l": start_launch(_config(prepared, out["l"], parallelism=EP_ZERO, checkpoint=every),
                               root / "l.yaml", timeout_s=500)}  # fmt: skip
    try:
        wait_launches(procs, timeout_s=560)
    finally:
        stop_launches(procs, {"l": out["l"] / "msrun_logs"})
    return out


@pytest.fixture(scope="module")
def resumed(prepared, runs) -> dict:
    """L2 (ep2 + capacity from L's step 10, SIGTERM in update 15) with AC (one process +
    capacity from the same checkpoint) run meanwhile."""
    root = runs["root"]
    l2, ac = root / "l2", root / "ac"
    drift = {"override_drift": True}  # the capacity factor is a model setting
    _seed_checkpoint(runs["l"], 10, l2)
    _seed_checkpoint(runs["l"], 10, ac)
    procs = {"l2": start_launch(_config(prepared, l2, parallelism=EP, model=CAPACITY,
                                        checkpoint=drift, monitor=NUMERICS), root / "l2.yaml",
                                fault="sigterm@15", timeout_s=500)}  # fmt: skip
    try:
        _train(_config(prepared, ac, model=CAPACITY, checkpoint=drift, monitor=NUMERICS),
               root / "ac.yaml", fault="sigterm@15")  # fmt: skip
        wait_launches(procs, timeout_s=560)
    finally:
        stop_launches(procs, {"l2": l2 / "msrun_logs"})
    return {"l2": l2, "ac": ac}


def _tensors(run: Path, step: int) -> dict[str, np.ndarray]:
    ck = Checkpoint(run / "checkpoints" / f"step_{step:08d}")
    return ck.load_tensors(list(ck.metadata["tensors"]))


def _biases(t: dict[str, np.ndarray]) -> np.ndarray:
    names = sorted((k for k in t if k.endswith("expert_bias")), key=lambda k: k.startswith("mtp"))
    return np.stack([t[k] for k in names])


def test_dp_not_given_is_the_world_under_launch_and_1_on_one_process(prepared, tmp_path):
    from mindloom_train._config import ConfigError, from_dict

    assert from_dict(_config(prepared, tmp_path)).parallelism.dp == 1  # one process
    cfg = _config(prepared, tmp_path, parallelism=EP_ZERO)
    assert from_dict(cfg, world_size=2).parallelism.dp == 2
    with pytest.raises(ConfigError, match="ep = 2 does not divide parallelism.dp = 1"):
        from_dict(cfg)  # one process has no ep group
    given = _config(prepared, tmp_path, parallelism={"dp": 1, "tp": 1})
    assert from_dict(given, world_size=2).parallelism.dp == 1  # launch then refuses it
    with pytest.raises(ConfigError, match=r"^config parallelism: world size 3 is not divisible "
                       r"by tp\*pp = 2\*1 = 2: parallelism.dp is not given"):  # fmt: skip
        from_dict(_config(prepared, tmp_path, parallelism={"tp": 2}), world_size=3)


def test_zero1_with_ep_is_the_ep_step_and_is_no_longer_refused(prepared, tmp_path):
    """ZeRO-1 under ep is the compiled ep step's (`_ep_step`, its own sharding), never the
    plain ZeRO-1 step; deepseek_v3 takes zero_stage 1 only with ep > 1 (one line else)."""
    from mindloom_parallel import ParallelDims
    from mindloom_train._config import ConfigError, from_dict
    from mindloom_train._ep_step import compiled_ep
    from mindloom_train._modelcfg import build_model_config
    from mindloom_train._zero_step import compiled_zero

    for kw, ep, zero in [(EP_ZERO | {"dp": 2}, True, False), ({"dp": 2, "ep": 2}, True, False),
                         ({"dp": 2, "zero_stage": 1}, False, True),
                         ({"dp": 2, "ep": 2, "tp": 2}, True, False),
                         ({"dp": 2, "ep": 2, "pp": 2}, False, False)]:  # fmt: skip
        dims = ParallelDims.from_dict(kw)
        assert (compiled_ep(dims), compiled_zero(dims, "graph")) == (ep, zero), kw
    cfg = from_dict(_config(prepared, tmp_path, parallelism=EP_ZERO), world_size=2)
    assert build_model_config(cfg, 65).family == "deepseek_v3"
    cfg = from_dict(_config(prepared, tmp_path, parallelism={"dp": 2, "zero_stage": 1}))
    with pytest.raises(ConfigError, match=r"parallelism.zero_stage: 1 is not supported .*"
                       r"without expert parallel \(ZeRO-1 runs under parallelism.ep > 1\); use 0$"):  # fmt: skip
        build_model_config(cfg, 65)


def test_ep2_losses_loads_and_biases_equal_one_process(runs):
    a, b = step_records(runs["a"]), step_records(runs["l"])
    assert sorted(b) == list(range(2, STEPS + 1))
    for step in range(2, STEPS + 1):
        for key in ("step_loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
        # the routing decisions of the whole global batch: the same token-slots per expert
        assert b[step]["moe_load"] == a[step]["moe_load"], step
        assert b[step]["moe_dropped_tokens"] == a[step]["moe_dropped_tokens"] == 0  # dropless
    assert a[2]["moe_load"] != a[STEPS]["moe_load"]  # the bias moved the routing
    # dp was not given: the launcher and both workers derived 2 from the world size
    resolved = yaml.safe_load((runs["l"] / "config.yaml").read_text())["parallelism"]
    assert (resolved["dp"], resolved["ep"], resolved["zero_stage"]) == (2, 2, 1)
    for step in (5, 10, 15, 20):
        ta, tb = _tensors(runs["a"], step), _tensors(runs["l"], step)
        np.testing.assert_array_equal(_biases(tb), _biases(ta), err_msg=f"step {step}")
        worst = max(float(np.abs(ta[k] - tb[k]).max()) for k in ta)
        assert worst < 1e-4, (step, worst)


def test_bias_follows_the_numpy_rule_from_the_global_loads(runs):
    """The ep2 biases after each save step equal NumPy's sign rule applied to the loads
    the run recorded (global: summed over both ranks), from A's step-1 biases on."""
    b = step_records(runs["l"])
    bias = _biases(_tensors(runs["a"], 1)).astype(np.float32)
    for step in range(2, STEPS + 1):
        load = np.asarray(b[step]["moe_load"], np.float64)
        sign = np.sign(load.mean(1, keepdims=True) - load).astype(np.float32)
        bias = (bias + np.float32(SPEED) * sign).astype(np.float32)
        if step % 5 == 0:
            np.testing.assert_array_equal(_biases(_tensors(runs["l"], step)), bias)


def test_checkpoint_holds_global_expert_tensors_and_the_split(runs):
    """L's checkpoint reads back as the one-process tensors (names and shapes), its
    metadata records the split, and each expert block sits in its owner's file."""
    ta, tb = _tensors(runs["a"], 20), _tensors(runs["l"], 20)
    assert sorted(ta) == sorted(tb)  # the one-process names: any layout loads it
    for k in ta:
        assert ta[k].shape == tb[k].shape, k
    assert tb["layers.1.mlp.experts.w1"].shape[0] == E
    meta = json.loads((runs["l"] / "checkpoints" / "step_00000020" / "metadata.json").read_text())
    assert meta["expert_parallel"]["ep_rank_experts"] == [[0, 4], [4, 8]]
    assert meta["expert_parallel"]["expert_dp"] == 1
    # written per owning rank: each rank's block of experts (and under ZeRO-1 its own
    # blocks' moments) in its own file, at its global expert offset
    for key, kind in (
        ("layers.1.mlp.experts.w1", "model"),
        ("exp_avg.layers.1.mlp.experts.w1", "optim"),
    ):
        chunks = meta["tensors"][key]["chunks"]
        assert sorted((c["offset"][0], c["file"]) for c in chunks) == [
            (0, f"{kind}-0000000-0000002.safetensors"), (4, f"{kind}-0000001-0000002.safetensors")
        ], key  # fmt: skip


def test_zero1_update_of_every_tensor_is_numpy_adamw(runs):
    """Under ep2 + ZeRO-1 each rank updates only its dense shares and its own expert
    blocks; the checkpoint gathers the moments from their one holder. Between two saved
    steps every tensor's change is torch's AdamW written out in float64 NumPy: the
    gradient its first moment implies, g = (m1 - b1 m0) / (1 - b1), gives its second
    moment, and the new weight is the bias-corrected step plus decoupled decay (matrices
    only). Steps 1 -> 2 (the one-process moments loaded into the shards) and 19 -> 20."""
    opt = yaml.safe_load((runs["l"] / "config.yaml").read_text())["optimizer"]
    b1, b2, eps, wd = opt["beta1"], opt["beta2"], opt["eps"], opt["weight_decay"]
    assert opt["decay_embeddings"]
    records = step_records(runs["l"])
    for s0 in (1, STEPS - 1):
        a, b = _tensors(runs["l"], s0), _tensors(runs["l"], s0 + 1)
        lr = records[s0 + 1]["lr"]
        common = runs["l"] / "checkpoints" / f"step_{s0 + 1:08d}" / "common.json"
        t = json.loads(common.read_text())["adam_step"]
        names = sorted(n for n in a if f"exp_avg.{n}" in a)
        assert any(".mlp.experts." in n for n in names) and len(names) > 40
        for n in names:
            w0, m0, v0 = (a[k].astype(np.float64) for k in (n, f"exp_avg.{n}", f"exp_avg_sq.{n}"))
            w1, m1, v1 = (b[k].astype(np.float64) for k in (n, f"exp_avg.{n}", f"exp_avg_sq.{n}"))
            g = (m1 - b1 * m0) / (1 - b1)
            v_ref = b2 * v0 + (1 - b2) * g * g
            # measured: 3.4e-7 (float32 moments); a moment lost or stale moves it by ~1
            assert np.abs(v1 - v_ref).max() <= 1e-5 * np.abs(v1).max(), (s0, n)
            decay = wd if w0.ndim >= 2 else 0.0
            w_ref = w0 * (1 - lr * decay) - lr * (m1 / (1 - b1**t)) / (
                np.sqrt(v1 / (1 - b2**t)) + eps
            )
            # measured: 3e-5 of a step (float32 weights); no bias correction: ~0.3 of one
            assert np.abs(w1 - w_ref).max() <= 1e-3 * lr, (s0, n, np.abs(w1 - w_ref).max() / lr)


def test_zero1_holds_each_moment_once_in_the_world(runs):
    """What each rank logs it holds: the dense shares add up to the dense tensors once
    (split over dp), and each rank holds all of its own 4 experts' state (the expert-data-
    parallel group is the rank alone: held once, nowhere replicated)."""
    import re

    a = _tensors(runs["a"], 1)
    sizes = {n: a[n].size for n in a if f"exp_avg.{n}" in a}
    dense = sum(v for n, v in sizes.items() if ".mlp.experts." not in n)
    expert = sum(v for n, v in sizes.items() if ".mlp.experts." in n)
    held = []
    for rank in range(2):
        log = (runs["l"] / "msrun_logs" / f"worker_{rank}.log").read_text()
        m = re.search(r"AdamW state for (\d+) dense \+ (\d+) expert of this rank's (\d+) "
                      r"values .* expert-data-parallel 1\)", log)  # fmt: skip
        assert m, log[-2000:]
        held.append([int(x) for x in m.groups()])
    assert sum(h[0] for h in held) == dense
    assert 0 < held[0][0] < dense and 0 < held[1][0] < dense  # really split
    assert [h[1] for h in held] == [expert // 2, expert // 2]
    assert [h[2] for h in held] == [dense + expert // 2] * 2


def test_tokens_sent_and_received_per_rank_match_the_one_process_loads(runs):
    """Each rank's own slots are R * SLOTS / 2; what it receives plus what it kept of its
    own is the global load on its 4 experts, i.e. one process's load there."""
    a, b = step_records(runs["a"]), step_records(runs["l"])
    for step in range(2, STEPS + 1):
        r = b[step]
        sent, received = r["ep_tokens_sent_ranks"], r["ep_tokens_received_ranks"]
        load = np.asarray(a[step]["moe_load"], np.float64) * SLOTS  # [R, E] token-slots
        for rank in range(2):
            mine = load[:, 4 * rank : 4 * rank + 4].sum()
            kept = R * SLOTS / 2 - sent[rank]
            assert received[rank] + kept == pytest.approx(mine, abs=1e-6), (step, rank)
        assert sum(sent) == sum(received)
        assert r["ep_tokens_sent"] == sent[0]
        assert 0 < r["ep_exchange_s"] and 0 < r["ep_exchange_share"] <= 1


def test_same_ep_resume_with_a_capacity_drops_what_one_process_drops(runs, resumed):
    """L2 (ep2, resumed from ep2's step 10) against AC (one process, the same checkpoint and
    capacity): each rank drops at the source what one process drops on that micro-batch,
    and `moe_dropped_tokens` sums both ranks (AC's counts the whole global batch)."""
    l2 = resumed["l2"]
    assert read_tracker(l2 / "checkpoints") == 15
    a, b = step_records(resumed["ac"]), step_records(l2)
    assert sorted(b) == list(range(11, 16))
    for step in b:
        for key in ("step_loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
        assert b[step]["moe_load"] == a[step]["moe_load"], step
        assert b[step]["moe_dropped_tokens"] == a[step]["moe_dropped_tokens"], step
    assert sum(b[step]["moe_dropped_tokens"] for step in b) > 0  # the capacity dropped some
    # NumPy bounds from the recorded global loads L_e of each router (2 ranks, C = 32 per
    # rank): sum_e max(0, L_e - 2C) <= dropped <= sum_e max(0, L_e - C); a count from
    # one rank, or a mean over ranks, falls below the lower bound
    cap = 1.0 * SLOTS / 2 / E  # ceil(cf * N * k / E) with N = 4 x 32 tokens per rank
    for step in b:
        load = np.asarray(b[step]["moe_load"], np.float64) * SLOTS  # [R, E] token-slots
        low, high = np.maximum(load - 2 * cap, 0).sum(), np.maximum(load - cap, 0).sum()
        assert low <= b[step]["moe_dropped_tokens"] <= high, (step, low, high)
    ta, tb = _tensors(resumed["ac"], 15), _tensors(l2, 15)
    assert sorted(ta) == sorted(tb)
    np.testing.assert_array_equal(_biases(tb), _biases(ta))
    worst = max(float(np.abs(ta[k] - tb[k]).max()) for k in ta)
    assert worst < 1e-4, worst


def test_numerics_under_ep_combine_the_expert_blocks(runs, resumed):
    """`monitor.numerics` under ep2 (L2): each rank's rows of its expert blocks are
    combined over the ep group, so the per-layer statistics are the whole model's: AC's
    (one process) at every step, and NumPy's from the checkpoints: the weight norms of
    step 11 (before its update: L's step-10 tensors) and the moments' means of step 15."""
    a, b = step_records(resumed["ac"]), step_records(resumed["l2"])
    for step in b:
        for key in NUMERICS_KEYS:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4), (step, key)
    w10, t15 = _tensors(runs["l"], 10), _tensors(resumed["l2"], 15)
    for layer in (0, 1):  # the dense layer and the MoE layer (8 experts, 4 per rank)
        names = [n for n in w10 if n.startswith(f"layers.{layer}.") and f"exp_avg.{n}" in w10]
        assert any(".mlp.experts." in n for n in names) == (layer == 1)
        norm = np.sqrt(sum((w10[n].astype(np.float64) ** 2).sum() for n in names))
        assert b[11]["param_norm_layers"][layer] == pytest.approx(norm, rel=1e-5), layer
        count = sum(t15[n].size for n in names)
        m = sum(np.abs(t15[f"exp_avg.{n}"].astype(np.float64)).sum() for n in names) / count
        v = sum(np.sqrt(t15[f"exp_avg_sq.{n}"].astype(np.float64)).sum() for n in names) / count
        assert b[15]["adam_m_layers"][layer] == pytest.approx(m, rel=1e-5), layer
        assert b[15]["adam_sqrt_v_layers"][layer] == pytest.approx(v, rel=1e-5), layer


def _common(run: Path, step: int) -> dict:
    common = json.loads((run / "checkpoints" / f"step_{step:08d}" / "common.json").read_text())
    keep = ("step", "consumed_samples", "consumed_tokens", "data", "adam_step", "drift")
    return {k: common.get(k) for k in keep}


def test_ep_checkpoints_record_the_one_process_position(runs, resumed):
    """What a resume reads besides the tensors (step, samples and tokens consumed, the data
    position, the AdamW step, the config drift record) is the one-process run's: L's
    (ep2 + ZeRO-1) against A's at every step read, L2's SIGTERM save against AC's."""
    for step in (5, 10, 15, 20):
        assert _common(runs["l"], step) == _common(runs["a"], step), step
    assert _common(resumed["l2"], 15) == _common(resumed["ac"], 15)


# ------------------------------------------------------------------ tp2 x ep2 (4 workers)
# in the default suite since session 21 (~75 s here: one 4-worker launch and a one-process
# resume), once the fused kernels had made the suite ~3 minutes shorter

TP_EP = {"dp": 2, "tp": 2, "ep": 2}


@pytest.fixture(scope="module")
def tp_ep(prepared, reference) -> dict:
    """T: `mindloom launch --nproc 4` with tp2 x dp2, ep2 inside dp, resuming from a copy of
    A's step-1 checkpoint (one process -> tp2 x ep2), steps 2-20, saves every 5 steps;
    then TR: one process resuming T's step-10 checkpoint (tp2 x ep2 -> one process)."""
    root = reference["root"]
    t, tr = root / "t", root / "tr"
    _seed_checkpoint(reference["a"], 1, t)
    procs = {"t": start_launch(_config(prepared, t, parallelism=TP_EP), root / "t.yaml",
                               nproc=4, timeout_s=600)}  # fmt: skip
    try:
        wait_launches(procs, timeout_s=660)
    finally:
        stop_launches(procs, {"t": t / "msrun_logs"})
    _seed_checkpoint(t, 10, tr)
    _train(_config(prepared, tr), root / "tr.yaml")
    return {"t": t, "tr": tr}


def _moved_slots(a: list, b: list) -> int:
    """Token-slots routed to another expert between two [routers, E] load fractions: each
    moved slot leaves one expert and joins another."""
    return round(float(np.abs(np.asarray(a) - np.asarray(b)).sum()) * SLOTS / 2)


@pytest.mark.msrun
def test_tp2_ep2_losses_loads_and_tensors_equal_one_process(reference, tp_ep):
    """Issue 17's 4-worker tp2 + ep2 through the trainer: MLA and the dense / shared-expert
    MLPs split over tp (deepseek_tp_plan), the routed experts over ep; every step's loss
    parts and grad norm within 1e-5 / 1e-4 of A, the same biases at every save, tensors
    within 1e-4 while the routing is A's; the checkpoints hold the one-process tensors.

    The loads: tp sums the row-parallel projections' halves (a0 + a1) where one process
    runs one matmul, so the router's scores differ in their last bits, and a token whose
    biased scores for two experts are that close can pick the other one. Measured
    (2026-12-03): one slot of 512 at one router in step 19 of 19. Allowed: at most one
    moved slot in at most one step; from then on the weights are compared within 1e-3
    (measured 1.04e-4 at step 20, an expert's) and the moments, which hold that slot's
    gradient, not at all."""
    logs = sorted((tp_ep["t"] / "msrun_logs").glob("worker_*.log"))
    assert len(logs) == 4
    for log in logs:
        assert "tensor parallel tp=2 (deepseek_tp_plan" in log.read_text(errors="replace")
    a, t = step_records(reference["a"]), step_records(tp_ep["t"])
    assert sorted(t) == list(range(2, STEPS + 1))
    moved = {}
    for step in t:
        for key in ("step_loss", "lm_loss", "mtp_loss", "balance_loss"):
            assert t[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
        assert t[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), step
        assert len(t[step]["comm_s_ranks"]) == 4
        if t[step]["moe_load"] != a[step]["moe_load"]:
            moved[step] = _moved_slots(t[step]["moe_load"], a[step]["moe_load"])
    assert len(moved) <= 1 and all(n == 1 for n in moved.values()), moved
    first = min(moved, default=STEPS + 1)
    for step in (5, 10, 15, 20):
        ta, tt = _tensors(reference["a"], step), _tensors(tp_ep["t"], step)
        assert sorted(ta) == sorted(tt)
        np.testing.assert_array_equal(_biases(tt), _biases(ta), err_msg=f"step {step}")
        for k in ta:
            assert ta[k].shape == tt[k].shape, k
            moment = k.startswith("exp_avg")
            if step >= first and moment:
                continue  # a moved slot's gradient sits in the moments from then on
            # moments: an element whose gradient is ~0 has a relative error of its own
            atol = {"exp_avg_sq": 1e-9, "exp_avg": 1e-6}.get(k.split(".")[0], 1e-4)
            atol = atol if step < first else 1e-3
            np.testing.assert_allclose(tt[k], ta[k], rtol=1e-3 if moment else 0, atol=atol,
                                       err_msg=f"{k} step {step}")  # fmt: skip
        assert _common(tp_ep["t"], step) == _common(reference["a"], step), step
    meta = json.loads((tp_ep["t"] / "checkpoints" / "step_00000020" / "metadata.json").read_text())
    assert meta["tensor_parallel"]["tp"] == 2 and meta["expert_parallel"]["ep"] == 2


@pytest.mark.msrun
def test_tp2_ep2_checkpoint_resumes_on_one_process(reference, tp_ep):
    """TR: T's step-10 checkpoint (written per rank: tp shards and expert blocks at their
    offsets) on one process, steps 11-20: A's losses and loads."""
    a, tr = step_records(reference["a"]), step_records(tp_ep["tr"])
    assert sorted(tr) == list(range(11, STEPS + 1))
    for step in tr:
        assert tr[step]["step_loss"] == pytest.approx(a[step]["step_loss"], rel=1e-5), step
        assert _moved_slots(tr[step]["moe_load"], a[step]["moe_load"]) <= 1, step
