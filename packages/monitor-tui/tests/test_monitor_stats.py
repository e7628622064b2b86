import math

from mindloom_monitor._records import Event, Metric, parse_obj
from mindloom_monitor._stats import RunData, Settings, downsample, fmt_count, fmt_duration
from monitor_helpers import T0, metric


def feed(data, objs):
    for obj in objs:
        data.add(parse_obj(obj))


def kinds(data):
    return [e.kind for e in data.events]


def test_smoothing_is_a_bias_corrected_ema_that_skips_nan():
    data = RunData("r", Settings(smoothing=0.5))
    feed(data, [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": None}])
    assert data.smoothed[0] == 4.0
    # (0.5*0.5*4 + 0.5*2) / (1 - 0.25) = 2.666...
    assert math.isclose(data.smoothed[1], 2 / 0.75)
    assert data.smoothed[2] == data.smoothed[1]  # a NaN loss does not poison the curve


def test_the_trainers_own_smoothed_loss_wins_over_the_ema():
    data = RunData("r", Settings(smoothing=0.5))
    feed(
        data,
        [
            {"step": 1, "loss": 4.0, "loss_smoothed": 3.5},
            {"step": 2, "loss": 2.0, "loss_smoothed": None},  # non-finite: fall back to the EMA
            {"step": 3, "loss": 1.0, "loss_smoothed": 1.25},
        ],
    )
    assert data.smoothed[0] == 3.5
    assert math.isclose(
        data.smoothed[1], 2.0
    )  # the EMA over the losses seen with no smoothed value
    assert data.smoothed[2] == 1.25


def test_header_facts_eta_elapsed_tokens_checkpoint():
    data = RunData("runs/x")
    feed(data, [{"event": "start", "time": T0, "run_name": "demo", "total_steps": 1000}])
    feed(data, [metric(s) for s in range(1, 201)])
    feed(data, [{"event": "checkpoint", "time": T0 + 100, "step": 200, "path": "ck/step_200"}])
    assert data.name == "demo" and data.total_steps == 1000
    assert data.last.step == 200 and data.tokens == 4096 * 200
    assert math.isclose(data.seconds_per_step(), 0.5)
    assert math.isclose(data.eta(), 800 * 0.5)
    assert math.isclose(data.elapsed(T0 + 150), 150)
    assert data.last_checkpoint == (200, "ck/step_200")
    feed(data, [{"event": "end", "time": T0 + 120, "step": 200, "status": "completed"}])
    assert data.eta() is None and data.elapsed(T0 + 10_000) == 120
    assert data.status() == "completed"


def test_nan_loss_and_grad_are_events_once_per_step():
    data = RunData("r")
    feed(data, [metric(s) for s in range(1, 30)])
    feed(data, [metric(30, loss=None), metric(31, grad_norm=math.inf)])
    feed(
        data,
        [
            {
                "event": "anomaly",
                "time": 1,
                "step": 30,
                "kind": "nonfinite_loss",
                "value": None,
                "action": "skipped",
            }
        ],
    )
    assert kinds(data).count("nan") == 1  # the trainer's anomaly for step 30 is not repeated
    assert "nan_grad" in kinds(data)
    assert all(e.level == "error" for e in data.events if e.kind.startswith("nan"))


def test_loss_and_grad_spikes_are_detected_and_normal_noise_is_not():
    data = RunData("r")
    feed(data, [metric(s) for s in range(1, 200)])
    assert not {"loss_spike", "grad_spike"} & set(kinds(data))
    feed(data, [metric(200, loss=9.0, grad_norm=50.0)])
    spikes = [e for e in data.events if e.kind in ("loss_spike", "grad_spike")]
    assert sorted(e.kind for e in spikes) == ["grad_spike", "loss_spike"]
    assert all(e.step == 200 for e in spikes)


def test_skipped_steps_counter_increase_is_an_event():
    data = RunData("r")
    feed(data, [metric(1), metric(2, skipped_steps=2), metric(3, skipped_steps=2)])
    ev = [e for e in data.events if e.kind == "skipped"]
    assert len(ev) == 1 and ev[0].step == 2 and "2 step(s) skipped" in ev[0].text


def test_throughput_drop_fires_once_and_rearms_after_recovery():
    data = RunData("r")
    feed(data, [metric(s, tokens_per_s=5000.0) for s in range(1, 20)])
    feed(data, [metric(s, tokens_per_s=2000.0) for s in range(20, 25)])
    feed(data, [metric(s, tokens_per_s=5000.0) for s in range(25, 30)])
    feed(data, [metric(30, tokens_per_s=1000.0)])
    drops = [e.step for e in data.events if e.kind == "throughput_drop"]
    assert drops == [20, 30]


def test_stall_is_reported_once_until_new_data_and_never_after_end():
    data = RunData("r", Settings(stall_after_s=60))
    feed(data, [metric(1)])
    t = data.last_report
    assert not data.check_stall(t + 59)
    assert data.check_stall(t + 61) and data.status() == "stalled"
    assert not data.check_stall(t + 500)  # once
    feed(data, [metric(2)])
    assert kinds(data)[-1] == "resumed" and data.status() == "running"
    feed(data, [{"event": "end", "time": data.last_report, "status": "failed", "reason": "oom"}])
    assert not data.check_stall(t + 10_000)
    assert data.status() == "failed"


def test_resumed_run_repeating_steps_replaces_them():
    data = RunData("r")
    feed(data, [metric(s) for s in range(1, 51)])
    feed(data, [metric(s, loss=1.0) for s in range(41, 46)])
    assert data.steps[-6:] == [40, 41, 42, 43, 44, 45]
    assert data.series["loss"][-1] == 1.0
    assert "restart" in kinds(data)


def test_a_resumed_run_reports_its_evals_again():
    data = RunData("r")
    feed(data, [metric(s) for s in range(1, 31)])
    feed(data, [{"event": "eval", "time": T0, "step": 20, "loss": 3.0, "ppl": 20.0}])
    feed(data, [metric(s) for s in range(11, 21)])  # resumed from a step-10 checkpoint
    feed(data, [{"event": "eval", "time": T0, "step": 20, "loss": 2.9, "ppl": 18.2}])
    assert [e.text for e in data.events if e.kind == "eval"] == [
        "loss 3  ppl 20",
        "loss 2.9  ppl 18.2",
    ]
    assert data.evals == [(20, 2.9, 18.2)]


def test_view_range_and_downsampling_keep_extremes():
    data = RunData("r")
    feed(data, [metric(s) for s in range(1, 5001)])
    feed(data, [metric(5001, loss=50.0)])
    xs, ys = data.view("loss", None, buckets=100)
    assert len(xs) <= 200 and max(ys) == 50.0  # min/max buckets keep the spike
    xs, ys = data.view("loss", 100, buckets=1000)
    assert xs[0] == 4901 and xs[-1] == 5001
    xs, ys = downsample(list(range(10)), list(range(10)), 100)
    assert xs == list(range(10))


def test_memory_is_bounded_by_thinning():
    data = RunData("r", Settings(max_points=1000))
    for s in range(1, 10_001):
        data.add(Metric(step=s, time=float(s), fields={"loss": 1.0}))
    assert len(data.steps) <= 1000
    assert data.steps == sorted(data.steps) and data.steps[-1] == 10_000
    assert all(len(v) == len(data.steps) for v in data.series.values())


def test_unknown_events_are_listed():
    data = RunData("r")
    data.add(Event(kind="profile", time=None, step=3, data={}))
    assert kinds(data) == ["profile"]


def test_formatting_helpers():
    assert fmt_duration(3725) == "1:02:05" and fmt_duration(None) == "-"
    assert fmt_duration(2 * 86400 + 3600) == "2d01h00m"
    assert fmt_count(4_920_000) == "4.92M" and fmt_count(math.nan) == "-"


def test_trainer_event_shapes_failed_checkpoint_and_resume():
    data = RunData("r")
    feed(
        data,
        [
            {
                "event": "start",
                "time": T0,
                "step": 100,
                "run_name": "x",
                "total_steps": 500,
                "resumed_from": 100,
            }
        ],
    )
    feed(
        data,
        [
            {
                "event": "checkpoint",
                "time": T0,
                "step": 200,
                "path": "ck/200",
                "reason": "interval",
                "seconds": 0.4,
            }
        ],
    )
    feed(
        data,
        [
            {
                "event": "checkpoint",
                "time": T0,
                "step": 300,
                "path": None,
                "status": "failed",
                "reason": "disk full",
            }
        ],
    )
    feed(data, [{"event": "eval", "time": T0, "step": 300, "loss": 800.0, "ppl": None}])
    assert "resumed from 100" in data.events[0].text
    assert data.last_checkpoint == (200, "ck/200")  # a failed save is not the last checkpoint
    assert data.events[2].level == "error" and "FAILED disk full" in data.events[2].text
    assert data.evals[0][:2] == (300, 800.0) and math.isnan(data.evals[0][2])


def test_lines_without_time_still_count_as_reports():
    data = RunData("r", Settings(stall_after_s=60))
    data.add(Metric(step=1, time=None, fields={"loss": 1.0}))
    assert not data.check_stall(1000.0)  # nothing to measure silence from yet
    data.seen(1000.0)  # the app saw new lines at 1000
    assert not data.check_stall(1050.0)
    assert data.check_stall(1061.0)
    data.seen(1100.0)
    assert data.status() == "running" and data.events[-1].kind == "resumed"


def test_events_are_bounded():
    import mindloom_monitor._stats as stats

    data = RunData("r")
    for s in range(1, stats.MAX_EVENTS + 10):
        data.add(Metric(step=s, time=None, fields={"loss": math.nan}))  # an event per step
    assert len(data.events) <= stats.MAX_EVENTS
    assert data.events[-1].step == stats.MAX_EVENTS + 9
