"""The one-process reference both msrun files compare with (`msrun_checks`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # msrun_checks, parallel_worker


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(getter, directory) of the one-process run, once per test session (imported here,
    not at collection: the other parallel files need neither MindSpore nor the worker)."""
    from msrun_checks import shared_reference

    yield from shared_reference(tmp_path_factory)
