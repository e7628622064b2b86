import os
import sys

import pytest

# pytest runs in importlib mode: make the shared helpers importable by name.
sys.path.insert(0, os.path.dirname(__file__))

from monitor_helpers import write_run  # noqa: E402


@pytest.fixture
def run_dir(tmp_path):
    return write_run(tmp_path / "run")


@pytest.fixture(scope="session")
def million_run(tmp_path_factory):
    """A run directory whose metrics.jsonl has a start event and 1,000,000 metric lines."""
    run = tmp_path_factory.mktemp("big") / "big"
    run.mkdir()
    n = 1_000_000
    with open(run / "metrics.jsonl", "w") as fh:
        fh.write(f'{{"event": "start", "time": 0.0, "run_name": "big", "total_steps": {2 * n}}}\n')
        fh.write(
            "".join(
                f'{{"step": {i}, "time": {i}.0, "loss": {2 + 1 / i:.5f}}}\n'
                for i in range(1, n + 1)
            )
        )
    return run
