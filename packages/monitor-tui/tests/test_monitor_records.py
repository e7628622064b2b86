import math
import subprocess
import sys

from mindloom_monitor._records import Event, Metric, parse_line, parse_lines


def test_metric_line_with_unknown_fields_parses():
    rec = parse_line(
        b'{"step": 5, "time": 1.5, "loss": 2.5, "lr": 0.001, "new_field": 3, "tag": "x", "nested": {"a": 1}}'
    )
    assert isinstance(rec, Metric)
    assert rec.step == 5 and rec.time == 1.5
    assert rec.fields["loss"] == 2.5 and rec.fields["lr"] == 0.001
    assert rec.fields["new_field"] == 3.0  # unknown numeric fields are kept for --once
    assert "tag" not in rec.fields and "nested" not in rec.fields


def test_null_nan_and_infinity_are_non_finite_values():
    rec = parse_line(
        '{"step": 1, "loss": null, "grad_norm": NaN, "lr": Infinity, "mfu": -Infinity}'
    )
    assert isinstance(rec, Metric)
    assert math.isnan(rec.fields["loss"]) and math.isnan(rec.fields["grad_norm"])
    assert rec.fields["lr"] == math.inf and rec.fields["mfu"] == -math.inf


def test_event_lines():
    rec = parse_line(
        '{"event": "checkpoint", "time": 3.0, "step": 100, "path": "ckpt/step_00000100"}'
    )
    assert isinstance(rec, Event)
    assert (rec.kind, rec.step, rec.time) == ("checkpoint", 100, 3.0)
    assert rec.data["path"] == "ckpt/step_00000100"
    start = parse_line('{"event": "start", "run_name": "r", "total_steps": 10}')
    assert isinstance(start, Event) and start.step is None and start.time is None


def test_garbage_is_none_never_raises():
    bad = [
        b"not json",
        b'{"step": 1, "loss": 2.0',  # partial line
        b"[1, 2, 3]",
        b'"a string"',
        b'{"loss": 2.0}',  # no step
        b'{"step": -1, "loss": 2.0}',
        b'{"step": "12", "loss": 2.0}',
        b'{"step": true}',
        b'{"event": 3}',
        b"\xff\xfe\x00garbage",
        b"[" * 100_000,  # deep nesting
    ]
    for line in bad:
        assert parse_line(line) is None, line


def test_float_steps_and_huge_ints():
    rec = parse_line('{"step": 7.0, "tokens": ' + "9" * 400 + "}")
    assert rec.step == 7 and rec.fields["tokens"] == math.inf
    assert parse_line('{"step": 7.5}') is None


def test_parse_lines_counts_skipped_and_ignores_blanks():
    res = parse_lines(
        [b'{"step": 1}', b"", b"   ", b"oops", b'{"event": "end", "status": "completed"}']
    )
    assert res.skipped == 1 and res.parsed == 3
    assert [type(r).__name__ for r in res.records] == ["Metric", "Event"]


def test_parsing_modules_do_not_import_textual():
    code = (
        "import sys\n"
        "import mindloom_monitor, mindloom_monitor._records, mindloom_monitor._stats\n"
        "import mindloom_monitor._tail, mindloom_monitor._source, mindloom_monitor._summary\n"
        "def ui(): return sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'textual_plotext', 'plotext'))\n"
        "print(ui())\n"
        "import mindloom_monitor._app\n"  # the app does pull Textual in: the probe can fail
        "print(bool(ui()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout
