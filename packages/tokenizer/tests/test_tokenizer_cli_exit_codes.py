"""The mindloom-tokenizer CLI's exception -> exit-code table (README "Exit codes")."""

import errno

import pytest
from mindloom_tokenizer._cli import exit_code, main
from mindloom_tokenizer._readers import NoInputError
from mindloom_tokenizer._tokenizer import TokenizerError


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def test_usage_error_is_2(capsys):
    assert main(["train", "--bogus"]) == 2
    assert "(see mindloom-tokenizer train --help)" in _err(capsys)


def test_tokenizer_error_is_1(tmp_path, capsys):
    assert main(["export", "-t", str(tmp_path / "nope")]) == 1
    assert _err(capsys).startswith("error: tokenizer not found")


def test_missing_input_is_1(tmp_path, capsys):
    argv = ["train", "-i", str(tmp_path / "none.txt"), "-o", str(tmp_path / "t")]
    assert main([*argv, "--vocab-size", "100"]) == 1
    assert "none.txt" in _err(capsys)


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (KeyboardInterrupt(), 130, "error: interrupted"),
        (TokenizerError("bad model"), 1, "error: bad model"),
        (NoInputError("no input"), 1, "error: no input"),
        (OSError(errno.ENOSPC, "No space left on device", "/d/f"), 1,
         "error: /d/f No space left on device"),
    ],
)  # fmt: skip
def test_every_row_of_the_table(exc, code, line):
    got_code, text = exit_code(exc)
    assert (got_code, f"error:{text}") == (code, line)
    assert exit_code(RuntimeError("bug")) is None
