"""The command line: train / eval / export, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mindloom_tokenizer import Tokenizer
from mindloom_tokenizer._cli import main


def _one_line_error(capsys) -> str:
    """The error is the last line of stderr (progress lines may come before it)."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    return errors[0]


def test_train_eval_export(corpus_dir, tmp_path, capsys):
    out = tmp_path / "tok"
    rc = main(
        [
            "train",
            "--input",
            str(corpus_dir / "a.txt"),
            str(corpus_dir / "b.jsonl"),
            "--vocab-size",
            "700",
            "--out",
            str(out),
            "--model-type",
            "unigram",
            "--num-threads",
            "2",
            "--user-defined-symbols",
            "<sep>,<cls>",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "reading 2 file(s)" in err and "training SentencePiece unigram" in err
    tok = Tokenizer.load(out)
    assert tok.vocab_size == 700 and tok.model_type == "unigram"
    assert tok.metadata["user_defined_symbols"] == ["<sep>", "<cls>"]

    rc = main(
        [
            "eval",
            "--tokenizer",
            str(out),
            "--input",
            str(corpus_dir),
            "--num-sentences",
            "500",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "coverage" in text and "chars/token" in text and "tokens/char" in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["sentences"] == 500 and report["ok"] is True
    assert report["fertility"]["cjk"]["characters"] > 0
    assert report["fertility"]["latin"]["words"] > 0

    assert main(["export", "--tokenizer", str(out)]) == 0
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()


def test_char_without_special_tokens(shakespeare, tmp_path, capsys):
    out = tmp_path / "char"
    assert (
        main(
            [
                "train",
                "-i",
                str(shakespeare),
                "-o",
                str(out),
                "--model-type",
                "char",
                "--no-special-tokens",
                "-q",
            ]
        )
        == 0
    )
    assert Tokenizer.load(out).vocab_size == 65
    assert capsys.readouterr().err == ""


def test_eval_warns_below_threshold(tmp_path, capsys):
    (tmp_path / "train.txt").write_text("abc abd abe\nbcd bce bcf\n" * 50, encoding="utf-8")
    (tmp_path / "other.txt").write_text("xyz 中文 ☃\n" * 20, encoding="utf-8")
    assert (
        main(
            [
                "train",
                "-i",
                str(tmp_path / "train.txt"),
                "-o",
                str(tmp_path / "t"),
                "--vocab-size",
                "280",
                "-q",
            ]
        )
        == 0
    )
    args = ["eval", "-t", str(tmp_path / "t"), "-i", str(tmp_path / "other.txt")]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "warning: coverage" in captured.err and "below 98.00%" in captured.err
    assert "'中'(U+4E2D)" in captured.out
    assert main([*args, "--strict"]) == 3


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (
            ["train", "-i", "{d}/missing.txt", "-o", "{d}/t", "--vocab-size", "100"],
            "input not found",
        ),
        (["train", "-i", "{d}/empty.txt", "-o", "{d}/t", "--vocab-size", "100"], "empty corpus"),
        (["train", "-i", "{d}/ok.txt", "-o", "{d}/t", "--vocab-size", "99999"], "larger than"),
        (
            ["train", "-i", "{d}/ok.txt", "-o", "{d}/t", "--vocab-size", "300", "--bogus"],
            "unrecognized arguments: --bogus",
        ),
        (["train", "-i", "{d}/ok.txt", "-o", "{d}/t"], "vocab_size is required"),
        (
            ["train", "-i", "{d}/*.nothing", "-o", "{d}/t", "--vocab-size", "300"],
            "no input files matched",
        ),
        (["eval", "-t", "{d}/nope", "-i", "{d}/ok.txt"], "tokenizer not found"),
        (["eval", "-t", "{d}/corrupt", "-i", "{d}/ok.txt"], "not a valid SentencePiece model"),
        (["export", "-t", "{d}/corrupt"], "not a valid SentencePiece model"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_error(argv, fragment, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "ok.txt").write_text("hello world\nanother line\n" * 10, encoding="utf-8")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "tokenizer.model").write_bytes(b"\xff\xfe not a model" * 100)
    rc = main([a.replace("{d}", str(tmp_path)) for a in argv])
    assert rc != 0
    assert fragment in _one_line_error(capsys)


def test_console_script_runs_as_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mindloom_tokenizer", "export", "-t", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: tokenizer not found: {tmp_path / 'none'}"
