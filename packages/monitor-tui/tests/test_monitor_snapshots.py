"""Layout pinned with pytest-textual-snapshot: fixed data, a fixed clock and relative
paths, so nothing in the picture depends on when or where the test runs.

Update after an intended layout change with `pytest --snapshot-update`."""

import pytest
from mindloom_monitor._app import MonitorApp
from monitor_helpers import fixed_clock, metric, wait_for, write_run


@pytest.fixture
def snap_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_run(
        tmp_path / "run",
        300,
        extra=["garbage line", metric(301, loss=None), metric(302, grad_norm=40.0)],
    )
    return "run"


def ready(app):
    async def run_before(pilot):
        assert await wait_for(pilot, lambda: app.settled)
        await pilot.pause(0.1)  # let the widgets repaint

    return run_before


def test_snapshot_80x24_plots(snap_run, snap_compare):
    app = MonitorApp([snap_run], clock=fixed_clock(302))
    assert snap_compare(app, terminal_size=(80, 24), run_before=ready(app))


def test_snapshot_80x24_events(snap_run, snap_compare):
    app = MonitorApp([snap_run], clock=fixed_clock(302))
    assert snap_compare(app, terminal_size=(80, 24), run_before=ready(app), press=["2"])


def test_snapshot_160x48(snap_run, snap_compare):
    app = MonitorApp([snap_run], clock=fixed_clock(302))
    assert snap_compare(app, terminal_size=(160, 48), run_before=ready(app))


def test_snapshot_160x48_overlay_two_runs(snap_run, tmp_path, snap_compare):
    write_run(tmp_path / "run-b", 200, name="tiny-b")
    app = MonitorApp([snap_run, "run-b"], clock=fixed_clock(302))

    async def run_before(pilot):
        await ready(app)(pilot)
        await pilot.press("o")
        assert await wait_for(pilot, lambda: app.settled)
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=(160, 48), run_before=run_before)


def test_snapshot_80x24_waiting(tmp_path, monkeypatch, snap_compare):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty-run").mkdir()
    app = MonitorApp(["empty-run"], clock=fixed_clock())
    assert snap_compare(app, terminal_size=(80, 24), run_before=ready(app))
