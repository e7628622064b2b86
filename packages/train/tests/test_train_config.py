"""Config parsing and validation: one line naming the key and the value, before anything heavy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from mindloom_train._cli import main
from mindloom_train._config import (
    ConfigError,
    LRSchedulerConfig,
    dump_config,
    from_dict,
    load_config,
)
from mindloom_train._schedule import lr_at


def _write(tmp_path, text: str):
    p = tmp_path / "run.yaml"
    if "train_dataset" not in text:  # every run needs training data
        text += "train_dataset: {data_prefix: [data/train]}\n"
    p.write_text(text)
    return p


def test_defaults_and_yaml_number_spellings(tmp_path):
    p = _write(tmp_path, "lr_scheduler: {lr: 1e-3, min_lr: 1.0e-4}\ntraining: {grad_clip: 1}\n")
    cfg = load_config(p)
    assert cfg.lr_scheduler.lr == 1e-3 and isinstance(cfg.training.grad_clip, float)
    assert cfg.save_path.name == "checkpoints"
    # the resolved config round-trips through YAML to the same hash
    again = from_dict(yaml.safe_load(dump_config(cfg)))
    assert again.hash() == cfg.hash()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("trainng: {}\n", "config key trainng: unknown key"),
        ("training: {train_iter: 3}\n", "config key training.train_iter: unknown key"),
        (
            "training: {train_iters: ten}\n",
            "config key training.train_iters: expected an integer, got 'ten'",
        ),
        ("training: {train_iters: true}\n", "training.train_iters: expected an integer"),
        ("training: {train_iters: 0}\n", "training.train_iters: must be >= 1, got 0"),
        ("checkpoint: {keep_last: 1}\n", "checkpoint.keep_last: must be >= 2, got 1"),
        ("checkpoint: {async_save: maybe}\n", "checkpoint.async_save"),
        ("parallelism: {comm_timeout_s: 0}\n", "parallelism.comm_timeout_s: must be > 0, got 0"),
        ("parallelism: {first_step_timeout_s: -1}\n", "parallelism.first_step_timeout_s"),
        ("training: {global_batch_size: 6, micro_batch_size: 4}\n", "training.global_batch_size"),
        ("lr_scheduler: {lr: 1.0e-3, min_lr: 0.1}\n", "lr_scheduler.min_lr"),
        ("lr_scheduler: {type: cosin}\n", "lr_scheduler.type: expected one of"),
        ("context: {mode: eager}\n", "context.mode"),
        ("model: {preset: nope}\n", "nope"),
        ("model: {hidden_size: 65, num_heads: 4, preset: debug}\n", "hidden_size"),
        ("model: {compute_dtype: float16}\n", "precision.compute_dtype"),
        ("train_dataset: {text_input: x.txt, data_prefix: [a]}\n", "exactly one"),
        ("train_dataset: {char_range: [0.5, 0.2]}\n", "train_dataset.char_range"),
        ("optimizer: {beta2: 1.5}\n", "optimizer.beta2"),
    ],
)
def test_bad_configs_are_one_line_naming_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, text))
    msg = str(exc.value)
    assert needle in msg
    assert "\n" not in msg


def test_python_object_tags_are_refused(tmp_path):
    p = _write(tmp_path, "seed: !!python/object/apply:os.system ['touch /tmp/mindloom-pwned']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)


def test_overrides_are_type_checked(tmp_path):
    p = _write(tmp_path, "training: {train_iters: 10}\n")
    cfg = load_config(p, ["training.train_iters=25", "lr_scheduler.lr=2e-3", "eval_dataset=null"])
    assert cfg.training.train_iters == 25 and cfg.lr_scheduler.lr == 2e-3
    with pytest.raises(ConfigError, match="training.train_iters: expected an integer, got 'many'"):
        load_config(p, ["training.train_iters=many"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(p, ["training.train_iters"])
    with pytest.raises(ConfigError, match="training.nope: unknown key"):
        load_config(p, ["training.nope=1"])


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    p = _write(tmp_path, "training: {train_iters: -1}\n")
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: config key training.train_iters") and "\n" not in err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["train", str(p), "--bogus"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def _sched(**kw) -> LRSchedulerConfig:
    return LRSchedulerConfig(**kw)


def test_warmup_cosine_matches_nanogpt():
    s = _sched(type="cosine", lr=1e-3, min_lr=1e-4, warmup_iters=100, decay_iters=2000)

    def nanogpt(it):  # karpathy/nanoGPT train.py get_lr
        if it < 100:
            return 1e-3 * (it + 1) / (100 + 1)
        if it > 2000:
            return 1e-4
        ratio = (it - 100) / (2000 - 100)
        return 1e-4 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1e-3 - 1e-4)

    for it in [0, 1, 50, 99, 100, 101, 500, 1000, 1999, 2000, 2500]:
        assert lr_at(it, s, 2000) == pytest.approx(nanogpt(it), rel=1e-12, abs=1e-15)


def test_linear_constant_and_wsd():
    lin = _sched(type="linear", lr=1.0, min_lr=0.1, warmup_iters=0, decay_iters=10)
    assert [round(lr_at(i, lin, 10), 6) for i in (0, 5, 10, 20)] == [1.0, 0.55, 0.1, 0.1]
    const = _sched(type="constant", lr=0.5, warmup_iters=4)
    assert lr_at(1, const, 100) == pytest.approx(0.2) and lr_at(50, const, 100) == 0.5
    wsd = _sched(type="wsd", lr=1.0, min_lr=0.0, warmup_iters=10, wsd_decay_fraction=0.2)
    vals = [lr_at(i, wsd, 100) for i in range(100)]
    assert vals[5] < 1.0 and all(v == 1.0 for v in vals[10:80])
    assert vals[80] == 1.0 and vals[90] == pytest.approx(0.5) and vals[99] < 0.06
    assert lr_at(100, wsd, 100) == 0.0


CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_recipe_validates(path):
    cfg = load_config(path)
    from mindloom_model import preset_names

    assert cfg.model.get("preset") in preset_names()


def test_a_recipe_per_model_preset():
    from mindloom_model import preset_names

    presets = {load_config(p, check_model=False).model.get("preset") for p in CONFIGS}
    # deepseek-v3-671b is the published configuration, for accounting and memory
    # estimates only: it is never instantiated, so it has no recipe
    trainable = set(preset_names()) - {"deepseek-v3-671b"}
    assert trainable <= presets


def test_an_unknown_family_is_one_config_error(tmp_path):
    from mindloom_train._config import ConfigError
    from mindloom_train._modelcfg import build_model_config

    cfg = load_config(CONFIGS[0], ["model.family=gpt_neox"], check_model=False)
    with pytest.raises(ConfigError, match=r"family must be 'llama' or 'deepseek_v3'.*gpt_neox"):
        build_model_config(cfg, 256)
