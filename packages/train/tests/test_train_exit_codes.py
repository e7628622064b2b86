"""The exit-code table: the README's rows are the code's (`_errors.EXIT_TABLE`), and the rows
that no other test file triggers are triggered here (the others are listed in the README's
table, each asserting its exact code)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from mindloom_train import EXIT_TABLE
from mindloom_train._cli import main
from train_testutil import events, one_layer_config, run_config

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_codes() -> set[int]:
    text = README.read_text()
    table = text[text.index("| exit | when |") :]
    table = table[: table.index("\n\n")]
    return {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}


def test_readme_exit_table_has_exactly_the_codes_of_the_code():
    assert _readme_codes() == {0} | {row.code for row in EXIT_TABLE}


def test_row_bad_config_before_the_run_exits_2(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"training": {"train_itres": 5}}))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: config key training.train_itres: ")


def test_row_failed_launch_exits_1(tmp_path, capsys):
    # the run lock is a directory where a file must go: the launcher fails before msrun
    path = tmp_path / "c.yaml"
    run = tmp_path / "run"
    (run / ".launch.lock").mkdir(parents=True)
    path.write_text(yaml.safe_dump({"train_dataset": {"data_prefix": ["x"]},
                                    "run_dir": str(run)}))  # fmt: skip
    assert main(["launch", "--nproc", "1", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: launch: "), err


def test_row_interrupted_twice_exits_130(prepared, tmp_path):
    # SIGTERM asks for a clean stop; a second signal (SIGINT) while stopping gives up. The
    # compiled step stays (MindSpore installs its own SIGINT handler as its first graph
    # runs, which the trainer must override), on one layer: the size changes nothing here
    run = tmp_path / "r"
    cfg = one_layer_config(prepared, run)  # test_train_loop's guard run's graph
    assert run_config(cfg, fault="sigterm@2,sigint@2") == 130
    end = events(run, "end")[-1]
    assert end["exit_code"] == 130 and end["reason"] == "interrupted twice"
