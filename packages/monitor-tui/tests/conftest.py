import os
import sys

import pytest

# pytest runs in importlib mode: make the shared helpers importable by name.
sys.path.insert(0, os.path.dirname(__file__))

from monitor_helpers import write_run  # noqa: E402


@pytest.fixture
def run_dir(tmp_path):
    return write_run(tmp_path / "run")
