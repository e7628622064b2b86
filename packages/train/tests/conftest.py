"""Shared fixtures: one small character-level dataset for every training test."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("GLOG_v", "3")
sys.path.insert(0, str(Path(__file__).parent))  # train_testutil


@contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _once_per_run(tmp_path_factory, name: str, build):
    """`build(directory)` once per test run, not once per pytest-xdist worker: under xdist
    the first worker to ask builds it in the directory all workers share (the parent of
    their base temp, unique to this run) while the others wait on a lock, then read its
    JSON result. These are reference runs and inputs nobody writes to; building them twice
    only cost a second compile and training run. Without xdist: a plain mktemp."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent
    result = shared / f"{name}.json"
    with _locked(shared / f"{name}.lock"):
        if not result.exists():
            root = shared / name
            shutil.rmtree(root, ignore_errors=True)  # what a failed build left
            root.mkdir()
            result.write_text(json.dumps(build(root)))
    return json.loads(result.read_text())


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> dict[str, str]:
    """A char tokenizer and train/eval .bin/.idx from the bundled corpus (built once)."""
    return _once_per_run(tmp_path_factory, "prepared", _prepare)


def _prepare(root: Path) -> dict[str, str]:
    from mindloom_train import _data
    from mindloom_train._config import from_dict

    cfg = from_dict(
        {
            "tokenizer": {"train_input": "bundled", "model_type": "char", "vocab_size": None,
                          "special_tokens": False, "path": str(root / "tok")},
            "train_dataset": {"text_input": "bundled", "txt_mode": "file", "append_eos": False,
                              "char_range": [0.0, 0.9], "seq_length": 32},
            "eval_dataset": {"text_input": "bundled", "txt_mode": "file", "append_eos": False,
                             "char_range": [0.9, 1.0], "seq_length": 32},
            "run_dir": str(root),
        },
        check_model=False,
    )  # fmt: skip
    _data.prepare_tokenizer(cfg, lambda m: None)
    tok = str(root / "tok")
    train = _data.prepare_dataset(cfg, cfg.train_dataset, "train", Path(tok), lambda m: None)
    ev = _data.prepare_dataset(cfg, cfg.eval_dataset, "eval", Path(tok), lambda m: None)
    return {"tokenizer": tok, "train": str(train[0]), "eval": str(ev[0])}


@pytest.fixture(scope="session")
def run_a(prepared, tmp_path_factory) -> Path:
    """The reference run: 8 uninterrupted steps, checkpoint at the end."""
    from train_testutil import SCHED, base_config, run_config

    def build(run: Path) -> str:
        assert run_config(base_config(prepared, run, lr_scheduler=SCHED)) == 0
        return str(run)

    return Path(_once_per_run(tmp_path_factory, "run_a", build))
