"""The `model` section: a preset plus ModelConfig fields, checked against mindloom_model."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from mindloom_train._errors import ConfigError
from mindloom_train._parse import MAX_ECHO, _coerce, show
from mindloom_train._schema import Config, ModelSection

# Owned by other sections so that one knob never has two places.
_ELSEWHERE = {
    "compute_dtype": "precision.compute_dtype",
    "recompute": "recompute.mode",
    "recompute_layers": "recompute.layers",
}
_EXTRA = set(ModelSection.EXTRA)
_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_RECOMPUTE = {"none": "none", "full": "full", "selected": "selected"}


def _model_fields() -> dict[str, Any]:
    from mindloom_model import ModelConfig

    return typing.get_type_hints(ModelConfig)


def validate_section(model: ModelSection) -> None:
    """Every key of the section against ModelConfig (its overrides coerced to their
    types in place), then the preset with those overrides."""
    hints = _model_fields()
    for key, value in model.items():
        if key in _ELSEWHERE:
            raise ConfigError(f"config key model.{key}: set it as {_ELSEWHERE[key]} instead")
        if key in _EXTRA:
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"config key model.{key}: expected a string, got {show(value)}")
            continue
        if key == "vocab_size" and value is None:
            continue  # the tokenizer's
        if key not in hints:
            known = ", ".join(sorted(set(hints) - set(_ELSEWHERE) | _EXTRA))
            name = key if isinstance(key, str) and len(key) <= MAX_ECHO else show(key)
            raise ConfigError(f"config key model.{name}: unknown key (known: {known})")
        model.overrides[key] = _coerce(f"model.{key}", value, hints[key])
    # without a preset, a full spec is fine: the dataclass defaults fill the rest
    preset = model.preset
    if preset is not None:
        from mindloom_model import get_preset

        try:
            get_preset(preset, **_overrides(model, vocab_size=None, seq_length=None))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"config key model: {exc}") from None


def _overrides(model: ModelSection, vocab_size: int | None, seq_length: int | None) -> dict:
    out = {k: v for k, v in model.items() if k not in _EXTRA}  # the overrides, as given
    if out.get("vocab_size") is None:
        out.pop("vocab_size", None)
        if vocab_size is not None:
            out["vocab_size"] = vocab_size
    if "max_seq_len" not in out and seq_length is not None:
        out["max_seq_len"] = seq_length
    return out


def build_model_config(cfg: Config, vocab_size: int | None):
    """The ModelConfig of a run: preset + section + precision/recompute + tokenizer vocab."""
    from mindloom_model import ModelConfig, get_preset

    over = _overrides(cfg.model, vocab_size, cfg.train_dataset.seq_length)
    over["compute_dtype"] = _DTYPE[cfg.precision.compute_dtype]
    if cfg.recompute.mode != "none":
        over["recompute"] = _RECOMPUTE[cfg.recompute.mode]
        over["recompute_layers"] = list(cfg.recompute.layers)
    over.setdefault("init_seed", cfg.seed)
    if over.get("family", _preset_family(cfg)) == "deepseek_v3":
        _check_deepseek_layout(cfg)
    try:
        preset = cfg.model.preset
        mcfg = get_preset(preset, **over) if preset else ModelConfig(**over)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"config key model: {exc}") from None
    if mcfg.max_seq_len < cfg.train_dataset.seq_length:
        raise ConfigError(
            f"config key model.max_seq_len: {mcfg.max_seq_len} is shorter than "
            f"train_dataset.seq_length {cfg.train_dataset.seq_length}"
        )
    return mcfg


def _check_deepseek_layout(cfg: Config) -> None:
    """The layouts the MoE layers run on: the compiled data / tensor / expert-parallel step
    (ZeRO-1 under ep > 1) and the compiled pipeline stages (pp > 1 with dp and ep, tp = 1,
    no ZeRO-1). Refused here, so `mindloom launch` stops before the tokenizer or any
    worker."""
    p = cfg.parallelism
    if cfg.context.mode != "graph":
        raise ConfigError(f"config key context.mode: {cfg.context.mode} is not supported for "
                          f"family deepseek_v3 (its steps are compiled); use graph")  # fmt: skip
    if p.pp > 1:
        for key, value in (("tp", p.tp), ("zero_stage", p.zero_stage)):
            if value != (1 if key == "tp" else 0):
                raise ConfigError(
                    f"config key parallelism.{key}: {value} is not supported for family "
                    f"deepseek_v3 with parallelism.pp = {p.pp} (its pipeline stages run data "
                    f"and expert parallel); use {1 if key == 'tp' else 0}"
                )
    elif p.zero_stage != 0 and p.ep <= 1:
        raise ConfigError(
            f"config key parallelism.zero_stage: {p.zero_stage} is not supported for family "
            f"deepseek_v3 without expert parallel (ZeRO-1 runs under parallelism.ep > 1); use 0"
        )


def _preset_family(cfg: Config) -> str:
    from mindloom_model import get_preset

    preset = cfg.model.preset
    try:
        return get_preset(preset).family if preset else "llama"
    except (ValueError, TypeError):
        return "llama"  # the preset's own error comes next, from build_model_config


def model_shape(mcfg) -> dict[str, Any]:
    """The fields a checkpoint must agree on to be loaded into this model."""
    d = dataclasses.asdict(mcfg)
    keys = [
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "ffn_hidden_size",
        "tie_embeddings",
    ]
    if d.get("family", "llama") != "llama":
        # added only for other families, so Llama checkpoints keep their recorded shape
        keys += ["family", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                 "moe_intermediate_size", "first_k_dense_replace", "num_nextn_predict_layers"]  # fmt: skip
    return {k: d[k] for k in keys if k in d}
