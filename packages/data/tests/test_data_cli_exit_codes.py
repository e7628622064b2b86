"""The mindloom-data CLI's exception -> exit-code table (README "Exit codes"), row by row:
through the real command where a failure is cheap to cause, else with a real instance of
the row's exception against `exit_code`."""

import errno
import re

import numpy as np
import pytest
from mindloom_data._clean_config import CleanError
from mindloom_data._cli import EXIT_CODES, exit_code, main
from mindloom_data._executors import ExecutorError
from mindloom_data._indexed import IndexedDatasetBuilder, IndexedDatasetError
from mindloom_data._normalize import MissingExtraError
from mindloom_data._readers import NoInputError
from mindloom_tokenizer import TokenizerError


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(r"(mindloom-data( \w+)?: )?error: ", err), err
    return err.strip()


def test_usage_error_is_2(capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's own exit, as it always was
        main(["clean", "--frobnicate"])
    assert exc.value.code == 2 and "arguments are required" in _err(capsys)


def test_unknown_config_key_is_1(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "a b c"}\n')
    (tmp_path / "c.yaml").write_text("dedup: {exactly: true}\n")
    rc = main(["clean", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o"), "-c",
               str(tmp_path / "c.yaml"), "-q"])  # fmt: skip
    assert rc == 1 and "unknown config key dedup.exactly" in _err(capsys)


def test_missing_input_is_1(tmp_path, capsys):
    rc = main(["clean", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o"), "-q"])
    assert rc == 1 and "none.jsonl" in _err(capsys)


def test_corrupt_dataset_is_1(tmp_path, capsys):
    (tmp_path / "bad.bin").write_bytes(b"")
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    assert main(["inspect", str(tmp_path / "bad")]) == 1
    assert "bad.idx" in _err(capsys)


def test_os_error_is_1_and_names_the_file(tmp_path, capsys):
    for name in ("a", "b"):
        with IndexedDatasetBuilder(str(tmp_path / name), dtype=np.uint16) as b:
            b.add_document(np.arange(5, dtype=np.uint16))
    (tmp_path / "file").write_bytes(b"")
    out = tmp_path / "file" / "m"  # under a regular file: no directory can be made there
    assert (
        main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix", str(out)]) == 1
    )
    err = _err(capsys)
    assert f"error: {tmp_path / 'file'}: " in err  # the path that could not be made


@pytest.mark.parametrize(
    "exc, code",
    [
        (KeyboardInterrupt(), 130),
        (CleanError("x"), 1),
        (ExecutorError("x"), 1),
        (MissingExtraError("x"), 1),
        (NoInputError("x"), 1),
        (IndexedDatasetError("x"), 1),
        (TokenizerError("x"), 1),
        (ValueError("x"), 1),
        (OSError(errno.ENOSPC, "No space left on device", "/d/f"), 1),
    ],
)
def test_every_row_of_the_table(exc, code):
    assert exit_code(exc)[0] == code
    assert "\n" not in exit_code(exc)[1]


def test_unexpected_errors_are_not_swallowed():
    assert exit_code(RuntimeError("bug")) is None and exit_code(SystemExit(3)) is None
    assert len(EXIT_CODES) == 3
