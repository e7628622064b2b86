"""Pipeline parallel with expert parallel for DeepSeek-V3 (`parallelism: {pp: 2, ep: 2}`)
through `mindloom launch` (real msrun, 4 CPU workers), against one process (issue 17).

The model: deepseek-v3-debug with 4 layers (layer 0 dense, layers 1-3 MoE with 8 routed
experts) and its MTP block, the balance loss on, a bias speed that moves the routing. The
4 workers: pp2 x dp2, ep2 inside dp; stage 0 = layers 0-1 (1 router), stage 1 = layers
2-3 + the MTP block (3 routers), each stage's experts split over its two ranks; two
micro-batches per rank and step (1F1B). Runs:

- B: one process, 20 steps, a checkpoint every step, held-out loss at steps 10 and 20 over
  4 micro-batches;
- P: `mindloom launch --nproc 4` resuming a copy of B's step-1 checkpoint (one process ->
  pp2 x ep2), steps 2-20, a checkpoint every 5 steps (every rank writes its own blocks),
  the held-out loss over 2 micro-batches per dp rank (B's 4); its end save at step 20
  loses rank 3 (stage 1, an expert block's only writer) mid-write: the job fails and
  `latest` must stay on step 15;
- PR: one process resuming P's step-10 checkpoint (pp2 x ep2 -> one process), steps 11-20.

References: B and PR (one process: no mindloom_parallel code on their path); B's losses,
parts, grad norms, held-out losses, expert loads, biases and tensors. The parallel
package's own test (test_parallel_ep_four.py) checks the stage graphs' grad norm and
held-out loss against NumPy and a one-process forward.

In the default suite since session 24 (opt-in before): a 4-worker DeepSeek-V3 launch,
164 CPU-s here (MINDLOOM_TEST_CPU, 2026-12-04).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from mindloom_train._checkpoint import Checkpoint
from train_testutil import (
    base_config,
    events,
    run_cli,
    start_launch,
    step_records,
    stop_launches,
)

pytestmark = pytest.mark.msrun

STEPS = 20
PP_EP = {"pp": 2, "dp": 2, "ep": 2, "micro_batch_num": 2}
ROUTERS = 4  # layers 1-3 and the MTP block
SLOTS = 16 * 32 * 2  # token-slots per router and step: 16 samples x 32 tokens x k = 2


def _config(prepared, run: Path, **sections) -> dict:
    cfg = base_config(
        prepared, run,
        lr_scheduler={"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_iters": 2, "decay_iters": STEPS},
        model={"preset": "deepseek-v3-debug", "vocab_size": None, "num_layers": 4,
               "moe_bias_update_speed": 0.01, "moe_aux_loss_weight": 0.01},
        training={"train_iters": STEPS, "global_batch_size": 16, "micro_batch_size": 4,
                  "eval_interval": 10, "eval_iters": 4},
        checkpoint={"save_interval": 1, "keep_last": STEPS + 1},
    )  # fmt: skip
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _train(cfg: dict, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg))
    out = run_cli("train", str(path), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def _seed(src: Path, step: int, run: Path) -> None:
    name = f"step_{step:08d}"
    shutil.copytree(src / "checkpoints" / name, run / "checkpoints" / name)
    (run / "checkpoints" / "latest").write_text(f"{step}\n")


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pipeline_moe")
    b, p, pr = root / "b", root / "p", root / "pr"
    _train(_config(prepared, b), root / "b.yaml")
    _seed(b, 1, p)
    # eval_iters per dp rank: 2 x 2 ranks = B's 4 micro-batches, the same samples
    cfg = _config(prepared, p, parallelism=PP_EP, training={"eval_iters": 2},
                  checkpoint={"save_interval": 5})  # fmt: skip
    procs = {"p": start_launch(cfg, root / "p.yaml", fault="kill_save@20:3", nproc=4,
                               timeout_s=600)}  # fmt: skip
    try:
        _, err = procs["p"].communicate(timeout=660)
    finally:
        stop_launches(procs, {"p": p / "msrun_logs"})
    _seed(p, 10, pr)
    _train(_config(prepared, pr, checkpoint={"save_interval": 0}), root / "pr.yaml")
    return {"b": b, "p": p, "pr": pr, "p_code": procs["p"].returncode, "p_err": err}


def _tensors(run: Path, step: int) -> dict[str, np.ndarray]:
    ck = Checkpoint(run / "checkpoints" / f"step_{step:08d}")
    return ck.load_tensors(list(ck.metadata["tensors"]))


def _moved_slots(a: list, b: list) -> int:
    """Token-slots routed to another expert between two [routers, E] load fractions: each
    moved slot leaves one expert and joins another."""
    return round(float(np.abs(np.asarray(a) - np.asarray(b)).sum()) * SLOTS / 2)


def _first_moved(b: dict, p: dict) -> int:
    """The first step whose loads differ from B's (STEPS + 1: none). The runs are compared
    up to it: a near-tie (at most two slots there, after step 10), not a wiring bug (one
    plant moved 1062 slots at step 3). After it the runs part for good: the bias rule is a
    sign, so one moved slot can move an expert's next bias by 2 x speed the other way, and
    more slots follow (measured 2026-12-04: 1, 3, 5, 4, 5, 6, 14, 72, 362 in steps 12-20)."""
    moved = {s: _moved_slots(p[s]["moe_load"], b[s]["moe_load"]) for s in p
             if p[s]["moe_load"] != b[s]["moe_load"]}  # fmt: skip
    first = min(moved, default=STEPS + 1)
    assert not moved or (moved[first] <= 2 and first > 10), moved
    return first


def test_losses_grad_norms_and_loads_equal_one_process(runs):
    """Every step of P until the first moved slot (after step 10): the loss and its parts
    within 1e-5, the grad norm (each stage's dense tensors once, expert blocks over ep,
    stages summed) within 1e-4 relative, the loads of all 4 routers (each stage's rows
    summed over the pipeline) and the bias norm equal to B's; the workers ran the stage
    layout described above.

    The loads: the pipeline sums a step's gradients in another order than one process
    (per stage graph, scaled before the dp sum), so the weights differ in their last bits
    and a token whose biased scores for two experts are that close can pick the other.
    Measured (2026-12-04): one slot of 1024 at one router in step 19 (the loss then
    1.6e-5 off), one again in step 20; PR, one process from P's step-10 weights, moves the
    same slot at step 19, so the tie is in the weights, not in the pipeline's step.
    Since the one-process step sums the squares of the gradient norm in float64
    (`KernelSquareSums`, DeepSeek-V3's step since session 23; P's stages sum in float32)
    the first moved slot comes at step 12 and the runs part after it (see `_first_moved`;
    with the float32 sums in B too, measured the same day, no slot moved). Allowed: at most two slots at the first step
    whose loads differ, which must be after step 10; nothing is compared from it on."""
    logs = sorted((runs["p"] / "msrun_logs").glob("worker_*.log"))
    assert len(logs) == 4
    text = [log.read_text(errors="replace") for log in logs]
    assert sum("pipeline stage 0 of 2: layers [0, 1], 1 routers" in t for t in text) == 2
    assert sum("pipeline stage 1 of 2: layers [2, 3], 3 routers" in t for t in text) == 2
    b, p = step_records(runs["b"]), step_records(runs["p"])
    assert sorted(p) == list(range(2, STEPS + 1))
    first = _first_moved(b, p)  # after step 10: the loads of steps 2-10 equal, slot for slot
    for step in p:
        assert np.shape(p[step]["moe_load"]) == (ROUTERS, 8)
        assert len(p[step]["comm_s_ranks"]) == 4
        if step >= first:
            continue
        for key in ("step_loss", "lm_loss", "mtp_loss", "balance_loss"):
            assert p[step][key] == pytest.approx(b[step][key], rel=1e-5), (step, key)
        assert p[step]["grad_norm"] == pytest.approx(b[step]["grad_norm"], rel=1e-4), step
        assert p[step]["moe_bias_norm"] == pytest.approx(b[step]["moe_bias_norm"], rel=1e-6)


def test_held_out_loss_equals_one_process_on_the_same_samples(runs):
    """The stage-to-stage evaluation forward: P's held-out loss (2 micro-batches on each of
    2 dp ranks) equals B's over the same 4 micro-batches."""
    first = _first_moved(step_records(runs["b"]), step_records(runs["p"]))
    b = {e["step"]: e["loss"] for e in events(runs["b"], "eval")}
    p = {e["step"]: e["loss"] for e in events(runs["p"], "eval")}
    assert sorted(p) == [10, 20]
    assert first > 10
    for step in p:  # step 10 always; step 20 unless a slot moved (see _first_moved)
        if step < first:
            assert p[step] == pytest.approx(b[step], rel=1e-5), step


def test_token_traffic_is_consistent_over_the_ranks(runs):
    """Each stage's ep group sends what it receives (the tokens one rank routes to the
    other's experts arrive there), and ranks without routed tokens do not exist here."""
    p = step_records(runs["p"])
    for step in (10, 20):
        sent, received = p[step]["ep_tokens_sent_ranks"], p[step]["ep_tokens_received_ranks"]
        assert len(sent) == 4 and min(sent) > 0
        for pair in ((0, 1), (2, 3)):  # the two stages' ep groups
            assert sent[pair[0]] == pytest.approx(received[pair[1]], rel=1e-6), step
            assert sent[pair[1]] == pytest.approx(received[pair[0]], rel=1e-6), step


def test_per_rank_checkpoints_hold_the_one_process_tensors(runs):
    """P's checkpoints (every rank its own blocks, expert blocks at their global offset)
    read back as the one-process tensors: B's within 1e-4 (moments within 1e-6 / 1e-9),
    the biases equal, the same names and shapes, and the position B records; from the
    first moved slot on (see `_first_moved`) the names and shapes only."""
    first = _first_moved(step_records(runs["b"]), step_records(runs["p"]))
    for step in (5, 10, 15):
        tb, tp = _tensors(runs["b"], step), _tensors(runs["p"], step)
        assert sorted(tb) == sorted(tp)
        for k in tb:
            assert tb[k].shape == tp[k].shape, k
            if step >= first:  # the runs have parted (see _first_moved)
                continue
            if k.endswith("expert_bias"):
                np.testing.assert_array_equal(tp[k], tb[k], err_msg=f"{k} step {step}")
                continue
            moment = k.startswith("exp_avg")
            atol = {"exp_avg_sq": 1e-9, "exp_avg": 1e-6}.get(k.split(".")[0], 1e-4)
            np.testing.assert_allclose(tp[k], tb[k], rtol=1e-3 if moment else 0, atol=atol,
                                       err_msg=f"{k} step {step}")  # fmt: skip
        cb = json.loads(
            (runs["b"] / "checkpoints" / f"step_{step:08d}" / "common.json").read_text()
        )
        cp = json.loads(
            (runs["p"] / "checkpoints" / f"step_{step:08d}" / "common.json").read_text()
        )
        for key in ("step", "consumed_samples", "consumed_tokens", "data", "adam_step"):
            assert cp.get(key) == cb.get(key), (step, key)
    meta = json.loads((runs["p"] / "checkpoints" / "step_00000015" / "metadata.json").read_text())
    w1 = meta["tensors"]["layers.3.mlp.experts.w1"]
    assert sorted(c["offset"][0] for c in w1["chunks"]) == [0, 4]


def test_a_rank_killed_mid_write_leaves_latest_on_the_previous_checkpoint(runs):
    """P's end save at step 20 loses rank 3 after its first file: the job fails, no step 20
    exists at a final path, `latest` still names step 15 (the checks above read it)."""
    from mindloom_train._checkpoint import complete_steps, read_tracker

    save = runs["p"] / "checkpoints"
    assert runs["p_code"] != 0, runs["p_err"][-2000:]
    assert 20 in step_records(runs["p"])  # the step ran; only its save was lost
    assert read_tracker(save) == 15 and complete_steps(save) == [1, 5, 10, 15]
    assert not (save / "step_00000020").exists()


def test_pipeline_checkpoint_resumes_on_one_process(runs):
    """PR: P's step-10 checkpoint on one process, steps 11-20: B's losses within 1e-5 until
    the first moved slot (see `_first_moved`), which must be a near-tie."""
    b, pr = step_records(runs["b"]), step_records(runs["pr"])
    assert sorted(pr) == list(range(11, STEPS + 1))
    first = _first_moved(b, pr)
    for step in pr:
        if step < first:  # step 11 at least: P's weights and moments restored
            assert pr[step]["step_loss"] == pytest.approx(b[step]["step_loss"], rel=1e-5), step
