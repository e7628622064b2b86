"""Every four-worker layout trains the same model as one process (real msrun, CPU backend).

One 4-worker launch made of two msrun invocations on 127.0.0.1 acting as two nodes (2
workers each) runs dp2+tp2, dp2+pp2 and tp2+pp2+sp through the engine, dp2+tp2 and
dp2+tp2+sp as one compiled step each, and dp2+pp2 and tp2+pp2+sp with compiled stage
graphs; every check here shares it. Each layout is compared with the one-process reference
(`msrun_checks`, shared with `test_parallel_msrun.py`): losses and final weights.

The same workers then run DeepSeek-V3 under dp4 x ep2 + ZeRO-1 (`ep_worker.run_dp_zero`):
the one layout whose expert-data-parallel group has 2 ranks (expert gradients summed over
it, expert AdamW state split over it), against `ep_worker`'s one-process reference run
meanwhile in its own process (`ep_checks`): 8 steps' (EP_STEPS) losses and parts, expert loads,
weights, biases (and NumPy's sign rule) and the ZeRO-1 moments.
"""

from __future__ import annotations

import ep_checks as C
import numpy as np
import pytest
from msrun_checks import check_layout, launch_two_nodes

pytestmark = pytest.mark.msrun

FOUR_WORKER_LAYOUTS = ["dp2_tp2", "dp2_pp2", "tp2_pp2_sp", "dp2_tp2_compiled",
                       "dp2_tp2_sp_compiled", "dp2_pp2_compiled",
                       "tp2_pp2_sp_compiled"]  # fmt: skip
EP_LAYOUT = "dp4_ep2_zero1"  # DeepSeek-V3, ep_worker's
# 8 of ep_worker's 20 steps: a step costs ~0.9 s of each worker's wall time here (4 workers
# on 2 cores: 20 steps were half the layout's time), and the bug it is for (expert
# gradients not summed over the expert-data-parallel group) moves the loss from step 2 on
EP_STEPS = 8


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("parallel_four")


@pytest.fixture(scope="module")
def four_workers(out, reference):
    finish = C.start_reference(out / "ep_ref", EP_STEPS)
    try:
        return launch_two_nodes(out, "four", FOUR_WORKER_LAYOUTS + [EP_LAYOUT], 2,
                                env=C.steps_env(EP_STEPS))  # fmt: skip
    finally:
        finish()


@pytest.fixture(scope="module")
def ep_runs(four_workers, out):
    return C.runs_of(out / "four", out / "ep_ref", four_workers, EP_STEPS)


def test_compiled_dp2_tp2_grad_norm_equals_the_engine(four_workers):
    """The 4-worker compiled dp2 x tp2 step's global gradient norm (TPNormSquare over tp
    after the dp buckets) against the engine's dp2_tp2 on the same batches; the compiled
    pipelines' (dp2 x pp2, tp2 x pp2 + sp) against the engine's same layouts."""
    pairs = (("dp2_tp2_compiled", "dp2_tp2"), ("dp2_tp2_sp_compiled", "dp2_tp2"),
             ("dp2_pp2_compiled", "dp2_pp2"), ("tp2_pp2_sp_compiled", "tp2_pp2_sp"))  # fmt: skip
    for layout, engine in pairs:
        for rank, res in four_workers.items():
            np.testing.assert_allclose(res[layout]["grad_norms"], res[engine]["grad_norms"],
                                       rtol=1e-5, err_msg=f"{layout} rank {rank}")  # fmt: skip


@pytest.mark.parametrize("layout", FOUR_WORKER_LAYOUTS)
def test_four_worker_layouts_match_one_process(layout, four_workers, reference, out):
    get, ref_dir = reference
    check_layout(layout, four_workers, get(), out / "four", ref_dir)


def test_two_nodes_train_together(four_workers, out):
    """The 4-worker launch is two msrun invocations (node rank 0 and 1, two workers each)
    that rendezvous on node 0: every rank reported, node 0 hosted the scheduler, both nodes
    ran workers. The layouts themselves are checked above, weights included."""
    assert sorted(res["dp2_tp2"]["rank"] for res in four_workers.values()) == [0, 1, 2, 3]
    assert (out / "logs_four_node0" / "scheduler.log").exists()  # node 0 hosts the rendezvous
    # node 1's workers may outlive node 0's: its msrun waits for the scheduler as MindSpore has it
    assert "scheduler released" not in (out / "logs_four_node0" / "msrun.log").read_text()
    for node in (0, 1):
        assert len(list((out / f"logs_four_node{node}").glob("worker_*.log"))) == 2, node


def test_dp4_ep2_zero1_losses_and_expert_loads_equal_one_process(ep_runs):
    C.check_losses_and_loads(EP_LAYOUT, ep_runs)


def test_dp4_ep2_zero1_weights_and_biases_equal_one_process(ep_runs):
    C.check_final_weights_and_biases(EP_LAYOUT, ep_runs)
    C.check_biases_follow_the_numpy_rule(EP_LAYOUT, ep_runs)


def test_dp4_ep2_zero1_shards_state_over_dp_and_edp_and_matches_the_reference_moments(ep_runs):
    C.check_zero1_dp_above_ep(ep_runs, EP_LAYOUT)
