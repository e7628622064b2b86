"""Rules for every suite (pytest loads this for each package's tests: it sits in the rootdir)."""

from __future__ import annotations

import os

# Seconds of test time per file in a fresh-clone run (CI24, session 14, wall seconds from
# MINDLOOM_TEST_CPU), for the files worth more than ~10 s. The files are sorted longest first
# below, but under `./dev test` pytest-xdist 3.8 (`--dist loadfile`) then re-sorts them by
# their number of tests (its loadscope reorder), keeping this order only among files with
# as many tests. Handing them out longest first (`--no-loadscope-reorder`) was measured in
# session 14 and was slower: it starts the big msrun launches together on two cores
# (docs/testing.md); except in the parallel suite, where since session 25 `./dev test`
# keeps this order (174 s against 190). Without xdist (MINDLOOM_TEST_WORKERS=0) this order
# holds.
FILE_SECONDS = {
    "test_parallel_ep_four.py": 220,  # opt-in (slow)
    "test_train_parallel_four.py": 100,  # default suite since session 25
    "test_train_launch_signals.py": 176, "test_train_expert_parallel.py": 167,
    "test_train_pipeline_moe.py": 111,  # default suite since session 24
    "test_train_parallel_launch.py": 161, "test_parallel_msrun_four.py": 170,
    "test_parallel_msrun.py": 109,
    # (an order, not its time: 80 s of waiting launches the parallel suite hands out before
    # test_parallel_msrun.py, beside the 4-worker launch; ./dev keeps this order there)
    "test_parallel_launch.py": 140,
    "test_train_deepseek.py": 100, "test_train_health.py": 94, "test_train_loop.py": 74,
    "test_train_reliability.py": 62, "test_train_compile_cache.py": 60,
    "test_train_cli.py": 56, "test_train_hang.py": 52, "test_train_memory.py": 49,
    "test_model_deepseek.py": 47, "test_train_precision.py": 35,
    "test_model_kernels.py": 24, "test_pipeline.py": 23, "test_train_numerics.py": 22,
    "test_train_nanogpt_recipe.py": 21, "test_model_train.py": 17,
    "test_train_faults.py": 14, "test_model_generate.py": 14, "test_monitor_app.py": 13,
    "test_data_metadata.py": 13, "test_model_compile_cache.py": 13, "test_data_ray.py": 13,
    "test_data_ray_cluster.py": 13, "test_data_megatron_interop.py": 12,
    "test_train_adamw_reference.py": 12, "test_train_async_save.py": 12,
    "test_train_dropout.py": 12, "test_model_dropout.py": 11, "test_train_golden.py": 10,
}  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only with MINDLOOM_SLOW_TESTS=1 (`./dev test --slow`);
    otherwise they are deselected (not skipped: the suite's count stays what ran). Then
    the files are ordered longest first (FILE_SECONDS; a stable sort, so the tests of a
    file and the files not listed keep their order)."""
    if os.environ.get("MINDLOOM_SLOW_TESTS") != "1":
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))


def pytest_runtest_protocol(item, nextitem):
    """MINDLOOM_TEST_CPU=FILE: append one line per test -- node id, CPU seconds (this
    process plus the child processes it waited for: CLI runs, msrun workers), wall
    seconds, the time it ended (Unix seconds) and the xdist worker -- so the suite's cost
    can be read per test on a machine where wall time is distorted by other load, and the
    gaps where a worker sat idle found (docs/testing.md)."""
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
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        f.write(f"{item.nodeid}\t{cpu() - c0:.2f}\t{time.perf_counter() - w0:.2f}"
                f"\t{time.time():.2f}\t{worker}\n")  # fmt: skip
    return True
