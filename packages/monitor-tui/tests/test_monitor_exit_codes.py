"""The mindloom-monitor CLI's exception -> exit-code table (README "Exit codes")."""

import errno

import pytest
from mindloom_monitor._cli import RunDirError, exit_code, main


def test_usage_error_is_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--stall-after", "-1", "x"])
    assert exc.value.code == 2


def test_refused_run_dir_is_2(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").mkdir()  # not a regular file
    assert main(["--once", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'metrics.jsonl'}: not a regular file; refusing to read it\n"


@pytest.mark.parametrize(
    "exc, code, text",
    [
        (RunDirError("run directory 'x': no such directory"), 2,
         "run directory 'x': no such directory"),
        (KeyboardInterrupt(), 130, "interrupted"),
        (OSError(errno.EACCES, "Permission denied", "/r/metrics.jsonl"), 1,
         "/r/metrics.jsonl: Permission denied"),
    ],
)  # fmt: skip
def test_every_row_of_the_table(exc, code, text):
    assert exit_code(exc) == (code, text)
    assert exit_code(RuntimeError("bug")) is None
