"""Rules for every suite (pytest loads this for each package's tests: it sits in the rootdir)."""

from __future__ import annotations

import os


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only with MINDLOOM_SLOW_TESTS=1 (`./dev test --slow`);
    otherwise they are deselected (not skipped: the suite's count stays what ran)."""
    if os.environ.get("MINDLOOM_SLOW_TESTS") == "1":
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
