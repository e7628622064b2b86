"""Training health in the monitor (issue 18): the trainer's `health` alerts, communication
share and data wait, memory per rank and the layer x step heat maps, in the app (Pilot)
and in --once. Expected values are recomputed here from what the tests wrote."""

import json
import math
import re
import statistics

import pytest
from mindloom_monitor._app import MonitorApp
from mindloom_monitor._cli import main
from mindloom_monitor._records import parse_line
from mindloom_monitor._stats import RunData
from monitor_helpers import T0, fixed_clock, metric, screen_text, wait_for, write_run

ADVICE = "the data loader cannot keep up: tokenize and pack offline"
SHADES = " .:-=+*#%@"


def layer_norms(step):
    return [0.5 * (i + 1) * (1 + step / 50) for i in range(3)]


def health_fields(step):
    return {
        "comm_share": 0.1 + step / 1000,
        "comm_share_ranks": [0.1 + step / 1000, 0.2 + step / 1000],
        "mem_rss_mb_ranks": [800.0 + step, 900.0 + step],
        "mem_peak_mb_ranks": [1000.0 + step, 1100.0 + step],
        "samples_per_s_ranks": [40.0, 20.0 + step],
        "logits_over_bound_frac": step / 100,
        "data_wait_frac": 0.01 * (step % 7),
        "grad_norm_layers": layer_norms(step),
        "max_logits": [3.0 + step / 10, 5.0],
    }


def write_health_run(run_dir, steps=30, trainer_health=True, extra=()):
    run_dir.mkdir(parents=True, exist_ok=True)
    start = {"event": "start", "time": T0, "run_name": "hr", "total_steps": 100}
    if trainer_health:
        start["health"] = {"grad_factor": 5.0}
    lines = [start]
    lines += [metric(s, **health_fields(s)) for s in range(1, steps + 1)]
    lines += list(extra)
    with open(run_dir / "metrics.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in lines)
    return run_dir


def alert(step, rule="data_wait", reason="the step waits for data 30% of the time"):
    return {"event": "health", "time": T0 + step, "step": step, "rule": rule,
            "reason": reason, "advice": ADVICE + ", put the data on local disk"}  # fmt: skip


def load(run):
    data = RunData(str(run))
    with open(run / "metrics.jsonl") as fh:
        for line in fh:
            rec = parse_line(line)
            if rec is not None:
                data.add(rec)
    return data


def test_health_events_are_alerts_with_their_advice(tmp_path):
    data = load(write_health_run(tmp_path / "r", extra=[alert(31), alert(31)]))
    assert [(a.kind, a.step) for a in data.alerts] == [("data_wait", 31)]  # one, not two
    (ev,) = [e for e in data.events if e.kind == "data_wait"]
    assert ev.level == "warn" and ADVICE in ev.text and "30%" in ev.text


def test_spikes_are_the_trainers_verdict_when_its_start_event_says_so(tmp_path):
    spike = [metric(31, grad_norm=40.0), metric(32, loss=60.0)]
    legacy = load(write_health_run(tmp_path / "old", trainer_health=False, extra=spike))
    assert {"grad_spike", "loss_spike"} <= {e.kind for e in legacy.events}
    new = load(write_health_run(tmp_path / "new", extra=spike))
    assert not {"grad_spike", "loss_spike"} & {e.kind for e in new.events}


def test_lists_of_the_wrong_shape_are_ignored_not_fatal():
    rec = parse_line(json.dumps({"step": 1, "loss": 2.0, "comm_share_ranks": ["a"],
                                 "max_logits": [1.0, None], "grad_norm_layers": 3}))  # fmt: skip
    assert rec is not None and rec.fields["loss"] == 2.0
    assert "comm_share_ranks" not in rec.lists and "grad_norm_layers" not in rec.lists
    assert rec.lists["max_logits"][0] == 1.0 and math.isnan(rec.lists["max_logits"][1])


def expected_heat(rows_of_values):
    logs = [math.log10(x) for row in rows_of_values for x in row]
    lo, hi = min(logs), max(logs)
    out = []
    for layer in range(len(rows_of_values[0])):
        cells = ""
        for row in rows_of_values:
            idx = 1 + round((math.log10(row[layer]) - lo) / (hi - lo) * (len(SHADES) - 2))
            cells += SHADES[min(idx, len(SHADES) - 1)]
        out.append(cells)
    return out


def test_once_has_alerts_comm_wait_memory_and_the_heat_map(tmp_path, capsys):
    run = write_health_run(tmp_path / "r", extra=[alert(30)])
    assert main(["--once", str(run)]) == 0
    out = capsys.readouterr().out
    assert "health alerts (1, last 1):" in out
    assert re.search(r"step 30  data_wait: the step waits .*advice: " + ADVICE, out)
    assert "communication share of the step (step 30): 13.0%  per rank: r0 13.0% r1 23.0%" in out
    mean = statistics.fmean(0.01 * (s % 7) for s in range(1, 31))
    assert f"data wait (step 30): 2.0%  run mean {100 * mean:.1f}%" in out
    assert "memory RSS MiB per rank (step 30): r0 830 r1 930" in out
    assert "peak memory RSS MiB per rank (step 30): r0 1030 r1 1130" in out
    assert "samples/s per rank (step 30): r0 40 r1 50" in out
    assert "device memory peak" not in out  # the CPU backend reports none
    assert "max attention logit (step 30): 6  tokens over the output-logit bound: 30.0%" in out
    rows = re.findall(r"^  L(\d) +\|(.*)\|$", out, re.M)
    want = expected_heat([layer_norms(s) for s in range(1, 31)])
    # two heat maps (grad norm, MaxLogits); the grad-norm one comes first
    assert [r[1] for r in rows[:3]] == want
    assert "grad norm per layer (steps 1-30;" in out


def test_once_of_an_older_run_has_no_health_block(tmp_path, capsys):
    assert main(["--once", str(write_run(tmp_path / "r", 30))]) == 0
    assert "health alerts" not in capsys.readouterr().out


async def settle(pilot, app):
    assert await wait_for(pilot, lambda: app.settled)
    await pilot.pause(0.1)


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_health_pane_shows_alerts_and_panels(tmp_path, size):
    run = write_health_run(tmp_path / "r", extra=[alert(30)])
    app = MonitorApp([str(run)], clock=fixed_clock(30))
    async with app.run_test(size=size) as pilot:
        await settle(pilot, app)
        text = screen_text(app)
        assert "health: 1 alert(s), last data_wait" in text
        if size == (80, 24):
            assert "5 Health" in text
            await pilot.press("5")
            assert app.pane == "health"
            await settle(pilot, app)
            text = screen_text(app)
        assert "health alerts (1, last 1):" in text
        assert "communication share of the step" in text
        assert "communication % of step" in text and "data wait % of step" in text
        if size == (160, 48):  # each rank's value beside its own rank (the last record's)
            assert "memory RSS MiB per rank (step 30): r0 830 r1 930" in text
            assert "peak memory RSS MiB per rank (step 30): r0 1030 r1 1130" in text
            assert "samples/s per rank (step 30): r0 40 r1 50" in text
        assert app.query_one("#plot-comm_share").x_range == (1, 30)


@pytest.mark.asyncio
async def test_no_health_pane_for_an_older_run(tmp_path):
    app = MonitorApp([str(write_run(tmp_path / "r", 30))], clock=fixed_clock(30))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        await pilot.press("5")
        assert app.pane == "plots" and "Health" not in screen_text(app)
