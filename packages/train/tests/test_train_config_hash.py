"""A run's config hash, its drift hash and its config.yaml are what resume compares with a
checkpoint: they must not move when the config's Python form changes (e.g. the `model`
section becoming a dataclass). The values below were recorded from the code before that
change (commit 851959c, where `model` was a plain dict), so an existing checkpoint keeps
resuming. No MindSpore: validation only.

The drift hashes (what resume compares) are still the values of 851959c. The config hashes
and config.yaml digests were recorded again at the merge that added the `monitor`
(max_logits, output_logit_bound, health.padding, health.max_logit_floor) and `profiler`
(warmup_steps, profile_memory, with_stack, ranks) keys: new keys with defaults appear in
every resolved config, so both move by design; `ModelSection` had been shown to give the
851959c values before that merge. Recorded again when `context.compile_cache` and
`context.compile_cache_dir` were added (the same reason; the drift hashes did not move), and
again when `parallelism.ep` was added (expert parallel, session 11; the drift hashes did
not move: a checkpoint of an earlier run still resumes)."""

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
                   ("a7e4199c9cb36495", "f7c651f57f6c34f4", "2e216895ab9c97f1")),
    "deepseek-v3-debug.yaml": (({**_debug(), **DEEPSEEK}, True),
                               ("48b5f854f31dd0fd", "42f49cab3fdaac1a", "c0a5f6d27405780b")),
    "no model section": ((dict(DATA), True),
                         ("d091c47eb09fd63d", "29705e2bfbbae948", "b3b2e8d71083d2b4")),
    "empty model section": (({**DATA, "model": {}}, True),
                            ("aec8b0ad2c525ac6", "f66d4dcf301cbfba", "8068ba750bb1c69c")),
    "vocab null + dropout": (
        ({**DATA, "model": {"preset": "debug", "vocab_size": None, "dropout": 0.1}}, True),
        ("56a9d860d49a6102", "f8ff46fb8ed3d424", "63f6647849458257")),
    # an int where ModelConfig has a float (rms_norm_eps 1 -> 1.0), no preset
    "no preset, full spec": (
        ({**DATA, "model": {"hidden_size": 128, "num_layers": 3, "num_heads": 4,
                            "rms_norm_eps": 1, "tie_embeddings": True}}, True),
        ("dc87af016203c386", "ad514432a75090ef", "707b2693d1436cb9")),
    "init_from_hf, unchecked": (
        ({**DATA, "model": {"init_from_hf": "hf/llama", "vocab_size": None}}, False),
        ("6561ed8c96de5a82", "873b0262bcc91a57", "82db38a848c689d2")),
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
