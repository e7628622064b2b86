"""The MoE fields of a DeepSeek-V3 run: the expert-load heat map, the imbalance and MTP
curves, --once, and lines whose MoE fields are malformed. The expected values are
recomputed here from the loads the tests wrote (statistics / bisect), not taken from
the monitor."""

import bisect
import json
import re
import statistics

import pytest
from mindloom_monitor._app import MonitorApp
from mindloom_monitor._cli import main
from mindloom_monitor._records import Metric, parse_line
from monitor_helpers import (
    append,
    fixed_clock,
    metric,
    moe_fields,
    screen_text,
    wait_for,
    write_moe_run,
    write_run,
)

SHADE_CHARS = "x░▒▓█"  # no token, < 0.5x, 0.5-1x, 1-2x, >= 2x of an even share


def expected_shades(row):
    """One character per expert: its share against an even share 1/E."""
    total, n = sum(row), len(row)
    out = ""
    for load in row:
        rel = load * n / total
        out += "x" if rel == 0 else SHADE_CHARS[1 + bisect.bisect_right([0.5, 1.0, 2.0], rel)]
    return out


def max_over_mean(row):
    return max(row) / statistics.fmean(row)


def last_line(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


async def settle(pilot, app):
    assert await wait_for(pilot, lambda: app.settled)
    await pilot.pause(0.1)


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_heat_map_shows_every_layer_and_expert_of_the_newest_load(tmp_path, size):
    run = write_moe_run(tmp_path / "run", 40)  # early: skewed loads, one dead expert
    rec = last_line(run)
    app = MonitorApp([str(run)], clock=fixed_clock(40))
    async with app.run_test(size=size) as pilot:
        await settle(pilot, app)
        text = screen_text(app)
        if size == (80, 24):
            assert "4 MoE" in text
            await pilot.press("4")
            await settle(pilot, app)
            text = screen_text(app)
        assert "step 40: 5 layers x 16 experts" in text
        rows = {}
        for line in text.splitlines():
            m = re.match(rf"(L\d) ([{SHADE_CHARS}]+) (\d+\.\d\d)", line)
            if m:
                rows[m[1]] = (m[2], float(m[3]))
        assert sorted(rows) == [f"L{i}" for i in range(5)]
        for i, row in enumerate(rec["moe_load"]):
            shades, imb = rows[f"L{i}"]
            assert shades == expected_shades(row), f"layer {i}"
            assert imb == pytest.approx(max_over_mean(row), abs=0.006)
        assert rows["L0"][0][3] == "x"  # the dead expert of layer 0
        assert "x no token" in text and "█ >= 2x" in text
        assert "expert load max/mean, overall" in text and "MTP loss" in text
        plot = app.query_one("#plot-moe_imbalance")
        assert plot.x_range == (1, 40)
        assert app.query_one("#plot-mtp_loss").x_range == (1, 40)


@pytest.mark.asyncio
async def test_moe_pane_appears_with_new_moe_lines_and_never_for_a_dense_run(tmp_path):
    dense = write_run(tmp_path / "dense", 30)
    app = MonitorApp([str(dense)], clock=fixed_clock(30))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        assert "MoE" not in screen_text(app)
        await pilot.press("4")  # nothing to show: stays on the plots
        assert app.pane == "plots" and not app.query_one("#moe").display
        append(dense / "metrics.jsonl", metric(31, **moe_fields(31)))
        assert await wait_for(pilot, lambda: "4 MoE" in screen_text(app))
        await pilot.press("4")
        assert app.pane == "moe" and app.query_one("#moe").display
        await settle(pilot, app)
        assert "step 31: 5 layers x 16 experts" in screen_text(app)


@pytest.mark.asyncio
async def test_malformed_moe_lines_are_counted_and_the_rest_still_shows(tmp_path):
    good = metric(41, **moe_fields(41))
    bad = [
        metric(42, moe_load=[[0.5, 0.5], [1.0]]),  # ragged
        metric(43, moe_load=[[0.5, -0.5]]),  # negative
        metric(44, moe_load=[["a", "b"]]),  # not numbers
        metric(45, moe_load=[]),  # empty
        metric(46, moe_load=[[0.5, 0.5]], moe_imbalance=[1.0, 1.0]),  # one per row
        metric(47, mtp_loss="high"),
        metric(48, moe_imbalance="1.2"),
        metric(49, moe_load={"0": [1.0]}),
    ]
    run = write_moe_run(tmp_path / "run", 40)
    append(run / "metrics.jsonl", good, *bad)
    for rec in bad:
        assert parse_line(json.dumps(rec)) is None
    assert isinstance(parse_line(json.dumps(good)), Metric)
    app = MonitorApp([str(run)], clock=fixed_clock(41))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        assert "skipped 8 lines" in screen_text(app)
        await pilot.press("4")
        await settle(pilot, app)
        assert "step 41: 5 layers x 16 experts" in screen_text(app)


def test_once_prints_imbalance_per_layer_and_overall_and_the_mtp_loss(tmp_path, capsys):
    run = write_moe_run(tmp_path / "run", 60)
    rec = last_line(run)
    assert main(["--once", str(run)]) == 0
    out = capsys.readouterr().out
    load = rec["moe_load"]
    overall = max_over_mean([sum(col) for col in zip(*load)])
    m = re.search(r"moe \(step 60\): imbalance max/mean overall (\S+)", out)
    assert m and float(m[1]) == pytest.approx(overall, rel=1e-3)
    per = re.search(r"per layer: (.*)", out)[1]
    got = [float(v) for v in re.findall(r"L\d+ (\S+)", per)]
    assert got == pytest.approx([max_over_mean(r) for r in load], rel=2e-3)
    assert f"MTP loss (step 60): {rec['mtp_loss']:.4g}" in out
    assert "dead experts 0" in out


def test_once_derives_the_imbalance_when_only_the_loads_are_written(tmp_path, capsys):
    run = write_run(tmp_path / "run", 0)
    loads = {s: moe_fields(s, layers=3, experts=8)["moe_load"] for s in (1, 2)}
    append(run / "metrics.jsonl", *(metric(s, moe_load=loads[s], mtp_loss=3.0) for s in (1, 2)))
    append(run / "metrics.jsonl", metric(3, mtp_loss=None))  # null: non-finite, shown
    assert main(["--once", str(run)]) == 0
    out = capsys.readouterr().out
    overall = max_over_mean([sum(col) for col in zip(*loads[2])])
    m = re.search(r"moe \(step 2\): imbalance max/mean overall (\S+)", out)
    assert m and float(m[1]) == pytest.approx(overall, rel=1e-3)
    got = [float(v) for v in re.findall(r"L\d+ (\S+)", re.search(r"per layer: (.*)", out)[1])]
    assert got == pytest.approx([max_over_mean(r) for r in loads[2]], rel=2e-3)
    assert "MTP loss (step 3): NaN" in out


def test_once_of_a_dense_run_has_no_moe_lines(run_dir, capsys):
    assert main(["--once", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "moe" not in out.lower() and "MTP" not in out
