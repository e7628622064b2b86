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


def pytest_runtest_protocol(item, nextitem):
    """MINDLOOM_TEST_CPU=FILE: append one line per test -- node id, CPU seconds (this
    process plus the child processes it waited for: CLI runs, msrun workers) and wall
    seconds -- so the suite's cost can be read per test on a machine where wall time is
    distorted by other load (docs/testing.md)."""
    path = os.environ.get("MINDLOOM_TEST_CPU")
    if not path:
        return None
    import resource
    import time

    def cpu() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    c0, w0 = cpu(), time.perf_counter()
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    from _pytest.runner import runtestprotocol

    runtestprotocol(item, nextitem=nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{item.nodeid}\t{cpu() - c0:.2f}\t{time.perf_counter() - w0:.2f}\n")
    return True
