"""Shared fixtures: one small character-level dataset for every training test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GLOG_v", "3")
sys.path.insert(0, str(Path(__file__).parent))  # train_testutil


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> dict[str, str]:
    """A char tokenizer and train/eval .bin/.idx from the bundled corpus (built once)."""
    from mindloom_train import _data
    from mindloom_train._config import from_dict

    root = tmp_path_factory.mktemp("prepared")
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
    return {"tokenizer": tok, "train": train[0], "eval": ev[0]}


@pytest.fixture(scope="session")
def run_a(prepared, tmp_path_factory) -> Path:
    """The reference run: 8 uninterrupted steps, checkpoint at the end."""
    from train_testutil import SCHED, base_config, run_config

    run = tmp_path_factory.mktemp("run_a")
    assert run_config(base_config(prepared, run, lr_scheduler=SCHED)) == 0
    return run
