"""A two-node Ray cluster on one machine: `ray start --head` and a second `ray start
--address` as separate processes (one CPU each, so the ranks of a stage spread over both
raylets). The executor joins it by address and gives the local executor's output."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray  # required here: a missing ray fails collection, never skips
from mindloom_data import clean
from mindloom_data._cli import main
from mindloom_data._executors import RayExecutor

sys.path.insert(0, str(Path(__file__).parent))
from data_exec_util import file_bytes, outcome, shared_reference  # noqa: E402

# Token authentication (on by default in this Ray) needs a token shared by every process;
# a throwaway cluster on 127.0.0.1 goes without. On a loaded machine a raylet can wait
# longer than its default 15 s for its Python agents to come up.
_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_agent_register_timeout_ms": "60000",
    "RAY_raylet_start_wait_time_s": "120",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args, log: Path) -> subprocess.Popen:
    ray_cli = Path(sys.executable).parent / "ray"
    common = ["--num-cpus=1", "--object-store-memory=100000000", "--block"]
    common += [f"--dashboard-agent-listen-port={_free_port()}", "--disable-usage-stats"]
    return subprocess.Popen(
        [str(ray_cli), "start", *args, *common],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **_ENV},
    )


def _stop(p: subprocess.Popen) -> None:
    # `ray start --block` stops the processes it started when it gets SIGTERM.
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ray_logs")
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)  # for this process, the driver
    port = _free_port()
    address = f"127.0.0.1:{port}"
    head = _start(["--head", f"--port={port}", "--include-dashboard=false"], logs / "head.log")
    nodes = [head]
    try:
        deadline = time.monotonic() + 120
        while True:  # the second node and the driver need the head's GCS up
            assert head.poll() is None, (logs / "head.log").read_text()[-2000:]
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "the Ray head did not come up"
            time.sleep(0.5)
        # A raylet gives its agents a few seconds to start; under load they make it only
        # if the head is not booting at the same time, so wait for the head to be ready.
        ray.init(address=address, log_to_driver=False)
        nodes.append(_start([f"--address={address}"], logs / "node2.log"))
        try:
            _wait_for_nodes(2, logs)
        finally:
            ray.shutdown()
        yield address
    finally:
        for p in reversed(nodes):
            _stop(p)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return shared_reference(tmp_path_factory)


def _wait_for_nodes(n: int, logs: Path) -> None:
    deadline = time.monotonic() + 120
    while sum(node["Alive"] for node in ray.nodes()) < n:
        assert time.monotonic() < deadline, (logs / "node2.log").read_text()[-2000:]
        time.sleep(0.5)


def test_two_node_cluster_matches_local(cluster, reference, tmp_path, capsys):
    address = cluster
    ex = RayExecutor(address)
    try:
        clean(reference["src"], tmp_path / "clean", executor=ex, progress=False)
        assert len(ex.nodes_used) == 2  # both raylets ran ranks
    finally:
        ex.close()
    assert not ray.is_initialized()  # it joined by address, so it disconnects
    assert outcome(tmp_path / "clean") == reference["outcome"]

    prefix = tmp_path / "tokens"
    argv = ["tokenize", "--tokenizer", reference["tok"], "--output-prefix", str(prefix)]
    argv += ["--input", *reference["shards"], "--executor", "ray", "--ray-address", address]
    assert main([*argv, "--tasks", "4"]) == 0, capsys.readouterr().err
    assert "from 4 ranks (ray executor)" in capsys.readouterr().out
    assert file_bytes(prefix) == reference["tokens"]
