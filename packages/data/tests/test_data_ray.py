"""The Ray executor on one local Ray instance (2 CPUs): same output as the local executor
with more tasks than CPUs, a rank failing once is retried, one failing always is named."""

import sys
from pathlib import Path

import pytest
import ray  # required here: a missing ray fails collection, never skips
from mindloom_data import clean
from mindloom_data._executors import FAULT_ENV, ExecutorError, RayExecutor
from mindloom_data._ranked_tokenize import tokenize_ranks

sys.path.insert(0, str(Path(__file__).parent))
from data_exec_util import file_bytes, outcome, shared_reference  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    ray.init(
        address="local",  # never a cluster some other process left running
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 * 1024**2,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return shared_reference(tmp_path_factory)


def test_ray_with_more_tasks_than_cpus_matches_local(ray_local, reference, tmp_path):
    ex = RayExecutor()  # joins the instance of this module; 6 scan ranks, 5 partitions
    clean(reference["src"], tmp_path / "clean", executor=ex, tasks=5, progress=False)
    assert outcome(tmp_path / "clean") == reference["outcome"]
    r = tokenize_ranks(reference["shards"], reference["tok"], tmp_path / "tok", executor=ex)
    assert r["ranks"] == 6
    assert file_bytes(tmp_path / "tok") == reference["tokens"]
    assert ray.is_initialized()  # an executor never shuts down a cluster it did not start


def test_ray_rank_failing_once_is_retried(ray_local, reference, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "exact:0:once,write:3:once,tokenize:1:once")
    ex = RayExecutor(max_retries=1)
    clean(reference["src"], tmp_path / "clean", executor=ex, progress=False)
    assert outcome(tmp_path / "clean") == reference["outcome"]
    faults = sorted(p.name for p in (tmp_path / "clean" / ".work" / "faults").iterdir())
    assert faults == ["exact-0", "write-3"]
    tokenize_ranks(reference["shards"], reference["tok"], tmp_path / "tok", executor=ex, tasks=3)
    assert file_bytes(tmp_path / "tok") == reference["tokens"]
    assert (tmp_path / "tok.work" / "faults" / "tokenize-1").exists()


def test_ray_rank_failing_always_stops_the_run(ray_local, reference, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "scan:4:always")
    with pytest.raises(ExecutorError) as err:
        clean(reference["src"], tmp_path / "c", executor=RayExecutor(max_retries=1))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("clean stage scan rank 4 failed after 2 attempts (inputs: ")
    assert msg.endswith(f"part4.jsonl): RuntimeError: injected fault ({FAULT_ENV}=scan:4:always)")
    assert not list((tmp_path / "c").glob("shard-*"))
