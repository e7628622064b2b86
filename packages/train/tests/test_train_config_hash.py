"""A run's config hash, its drift hash and its config.yaml are what resume compares with a
checkpoint: they must not move when the config's Python form changes (e.g. the `model`
section becoming a dataclass). The values below were recorded from the code before that
change (commit 851959c, where `model` was a plain dict), so an existing checkpoint keeps
resuming. No MindSpore: validation only."""

from __future__ import annotations

import hashlib

import pytest
import yaml
from mindloom_train._config import dump_config, from_dict
from mindloom_train._schema import drift_hash

# configs/debug.yaml as it was when the values were recorded (the golden run's config)
DEBUG_YAML = """
model:
  preset: debug
  vocab_size: null
tokenizer: {train_input: bundled, model_type: bpe, vocab_size: 512}
train_dataset: {text_input: bundled, doc_range: [0.0, 0.9], seq_length: 32}
eval_dataset: {text_input: bundled, doc_range: [0.9, 1.0], seq_length: 32}
training: {train_iters: 200, global_batch_size: 16, micro_batch_size: 16, eval_interval: 50,
           eval_iters: 10}
optimizer: {beta1: 0.9, beta2: 0.95, weight_decay: 0.1}
lr_scheduler: {type: cosine, lr: 3.0e-3, min_lr: 3.0e-4, warmup_iters: 20}
checkpoint: {save_interval: 100, keep_last: 2}
monitor: {log_interval: 10}
seed: 1234
run_dir: runs/debug
"""

# configs/deepseek-v3-debug.yaml's sections that differ from debug.yaml
DEEPSEEK = {
    "model": {"preset": "deepseek-v3-debug", "vocab_size": None, "mtp_loss_weight": 0.3,
              "moe_bias_update_speed": 0.001, "moe_aux_loss_weight": 0.0},
    "training": {"train_iters": 200, "global_batch_size": 16, "micro_batch_size": 8,
                 "eval_interval": 50, "eval_iters": 10},
    "run_dir": "runs/deepseek-v3-debug",
}  # fmt: skip

DATA = {"train_dataset": {"data_prefix": ["data/train"]}}


def _debug() -> dict:
    return yaml.safe_load(DEBUG_YAML)


# name -> (config dict, check_model); then the recorded (config hash, drift hash, the
# first 16 hex digits of config.yaml's SHA-256)
CASES = {
    "debug.yaml": ((_debug(), True),
                   ("ef7ad8feaf4aff32", "f7c651f57f6c34f4", "1bc8123f96d42da0")),
    "deepseek-v3-debug.yaml": (({**_debug(), **DEEPSEEK}, True),
                               ("21515b5d8e335ac2", "42f49cab3fdaac1a", "78d95b9a277a2d19")),
    "no model section": ((dict(DATA), True),
                         ("12fdcc13e70a70e5", "29705e2bfbbae948", "acb0cd9f52511bd1")),
    "empty model section": (({**DATA, "model": {}}, True),
                            ("dc79705591564dfd", "f66d4dcf301cbfba", "7e779080cb4d7f54")),
    "vocab null + dropout": (
        ({**DATA, "model": {"preset": "debug", "vocab_size": None, "dropout": 0.1}}, True),
        ("2ec7e4339ab36abb", "f8ff46fb8ed3d424", "87c93a70bde55067")),
    # an int where ModelConfig has a float (rms_norm_eps 1 -> 1.0), no preset
    "no preset, full spec": (
        ({**DATA, "model": {"hidden_size": 128, "num_layers": 3, "num_heads": 4,
                            "rms_norm_eps": 1, "tie_embeddings": True}}, True),
        ("7fd91580467c4ac5", "ad514432a75090ef", "9819e9832e5d122e")),
    "init_from_hf, unchecked": (
        ({**DATA, "model": {"init_from_hf": "hf/llama", "vocab_size": None}}, False),
        ("678bb4cede5955a3", "873b0262bcc91a57", "9de8238460e16544")),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_config_and_drift_hashes_equal_the_values_recorded_before(name):
    (data, check_model), recorded = CASES[name]
    cfg = from_dict(data, check_model=check_model)
    text = dump_config(cfg)
    got = (
        cfg.hash(),
        drift_hash(cfg.drift_settings()),
        hashlib.sha256(text.encode()).hexdigest()[:16],
    )
    assert got == recorded
    # and config.yaml, read back, is the same config
    assert from_dict(yaml.safe_load(text), check_model=check_model).hash() == recorded[0]
