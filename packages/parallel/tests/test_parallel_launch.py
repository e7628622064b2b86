"""The msrun launcher: refuse bad layouts before starting, name the dead rank, time out."""

from __future__ import annotations

from pathlib import Path

import pytest
from mindloom_model import get_preset
from mindloom_parallel import LaunchError, ParallelConfig, ParallelConfigError, launch
from mindloom_parallel._launch import diagnose, free_port

WORKER = str(Path(__file__).parent / "parallel_worker.py")


def test_a_layout_that_does_not_fit_fails_before_any_worker_starts(tmp_path):
    logs = tmp_path / "logs"
    with pytest.raises(ParallelConfigError, match=r"world size 2 != dp\*tp\*pp = 2\*2\*1 = 4"):
        launch(
            [WORKER, str(tmp_path)],
            nproc=2,
            log_dir=logs,
            pcfg=ParallelConfig(dp=2, tp=2),
            model_cfg=get_preset("debug"),
        )
    with pytest.raises(
        ParallelConfigError, match="num_kv_heads = 2 is not divisible by parallelism.tp = 4"
    ):
        launch(
            [WORKER, str(tmp_path)],
            nproc=4,
            log_dir=logs,
            pcfg=ParallelConfig(tp=4),
            model_cfg=get_preset("debug"),
        )
    # msrun never ran: no log directory, no worker log (proven by that, not by a time bound)
    assert not logs.exists()


def test_bad_launch_arguments_are_one_line_errors(tmp_path):
    with pytest.raises(LaunchError, match="script not found"):
        launch([str(tmp_path / "missing.py")], nproc=2, log_dir=tmp_path / "l")
    with pytest.raises(LaunchError, match="explicit master_port"):
        launch([WORKER], nproc=1, nnodes=2, node_rank=1, log_dir=tmp_path / "l")
    with pytest.raises(LaunchError, match="bad launch shape"):
        launch([WORKER], nproc=1, nnodes=2, node_rank=2, log_dir=tmp_path / "l")


def test_diagnose_reads_the_per_rank_logs(tmp_path):
    (tmp_path / "worker_0.log").write_text("[INFO] fine\n")
    (tmp_path / "worker_1.log").write_text(
        "Traceback (most recent call last):\n  File x\nValueError: shapes differ\n"
    )
    assert diagnose(tmp_path, 1).startswith("worker rank 1 failed: ValueError: shapes differ")


@pytest.mark.msrun
def test_a_dead_worker_is_named_and_the_job_ends(tmp_path):
    with pytest.raises(LaunchError) as e:
        launch(
            [WORKER, str(tmp_path / "out"), "--fail-rank", "1"],
            nproc=2,
            log_dir=tmp_path / "logs",
            timeout_s=300,
            cluster_timeout_s=60,
        )
    assert "worker rank 1 failed: RuntimeError: injected failure on rank 1" in str(e.value)
    assert e.value.returncode != 0
    assert (tmp_path / "logs" / "worker_0.log").exists() and (
        tmp_path / "logs" / "worker_1.log"
    ).exists()


@pytest.mark.msrun
def test_a_missing_node_is_a_rendezvous_timeout(tmp_path):
    # node 1 of 2 never starts: node 0's worker must give up after the cluster timeout
    with pytest.raises(LaunchError, match="rendezvous timed out") as e:
        launch(
            [WORKER, str(tmp_path / "out"), "--layouts", "dp2"],
            nproc=1,
            nnodes=2,
            node_rank=0,
            master_port=free_port(),
            log_dir=tmp_path / "logs",
            timeout_s=300,
            cluster_timeout_s=5,
        )
    assert str(tmp_path / "logs") in str(e.value)


def test_script_options_colliding_with_the_launcher_are_refused(tmp_path):
    # msrun expands abbreviations even after the script: --worker would be --worker_num
    with pytest.raises(LaunchError, match="--worker would be read by msrun"):
        launch([WORKER, "--worker"], nproc=2, log_dir=tmp_path / "l")
    assert not (tmp_path / "l" / "msrun.log").exists()
