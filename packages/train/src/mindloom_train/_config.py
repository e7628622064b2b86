"""The run configuration: one YAML file parsed into dataclasses and validated up front.

Everything here is cheap (no MindSpore import) so that a bad config is refused in well
under a second, before any data is read or any worker is started. The parts, imported in
one direction: `_schema` (the dataclasses) <- `_parse` (YAML and `--set` -> dataclasses)
<- `_modelcfg` (the model section) <- `_checks` (the rules) <- this module (the entry
points).
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from mindloom_train._checks import validate
from mindloom_train._errors import ConfigError
from mindloom_train._parse import (
    MAX_ECHO,
    _build,
    _coerce,
    apply_overrides,
    read_yaml,
    show,
)
from mindloom_train._schema import (
    CheckpointConfig,
    Config,
    ContextConfig,
    DatasetConfig,
    LRSchedulerConfig,
    ModelSection,
    MonitorConfig,
    OptimizerConfig,
    ParallelismConfig,
    PrecisionConfig,
    ProfilerConfig,
    RecomputeConfig,
    TokenizerConfig,
    TrainingConfig,
    drift_hash,
)

__all__ = [
    "MAX_ECHO",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ContextConfig",
    "DatasetConfig",
    "LRSchedulerConfig",
    "ModelSection",
    "MonitorConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "PrecisionConfig",
    "ProfilerConfig",
    "RecomputeConfig",
    "TokenizerConfig",
    "TrainingConfig",
    "_coerce",
    "apply_overrides",
    "drift_hash",
    "dump_config",
    "from_dict",
    "load_config",
    "msrun_world_size",
    "read_yaml",
    "show",
    "validate",
]


def from_dict(
    data: dict[str, Any], *, check_model: bool = True, world_size: int | None = None
) -> Config:
    """`world_size`: the ranks the run has (launcher: --nproc x --nnodes; a worker: msrun's
    count); a `parallelism` section without `dp` then gets world / (tp*pp)
    (mindloom_parallel's rule). None (one process): `dp` keeps its default, 1."""
    cfg = _build(Config, data, "")
    section = data.get("parallelism") if isinstance(data, dict) else None
    if world_size is not None and "dp" not in (section or {}):
        from mindloom_parallel import ParallelConfigError, ParallelDims

        raw = dict(section or {})
        try:
            cfg.parallelism.dp = ParallelDims.from_section(raw, world_size).dp
        except ParallelConfigError as exc:
            raise ConfigError(f"config parallelism: {exc}") from None
    return validate(cfg, check_model=check_model)


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: list[str] | None = None,
    *,
    check_model: bool = True,
    world_size: int | None = None,
) -> Config:
    """Read, override (`section.key=value`) and validate a config; ConfigError if bad.
    `world_size`: see `from_dict` (how `parallelism.dp` is derived when not given)."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    return from_dict(data, check_model=check_model, world_size=world_size)


def msrun_world_size() -> int | None:
    """The worker count msrun exports to each worker (MS_WORKER_NUM, or RANK_SIZE); None
    for a process started on its own."""
    for key in ("MS_WORKER_NUM", "RANK_SIZE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)
