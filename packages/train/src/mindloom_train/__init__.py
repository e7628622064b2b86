"""mindloom_train: see the package README.

The public API. Names load lazily (PEP 562), so `import mindloom_train` and validating a
config stay cheap: MindSpore is imported only by what runs a model.
"""

from __future__ import annotations

import importlib
from typing import Any

from mindloom_train.__about__ import __version__

# public name -> the private module that defines it
_EXPORTS: dict[str, str] = {
    # running
    "Trainer": "_trainer",
    "train": "_trainer",
    "TrainState": "_state",
    "main": "_cli",
    # configs
    "Config": "_config",
    "load_config": "_config",
    "from_dict": "_config",
    "dump_config": "_config",
    "build_model_config": "_modelcfg",
    # errors and exit codes
    "ConfigError": "_errors",
    "DataInputError": "_errors",
    "CheckpointError": "_errors",
    "TrainError": "_errors",
    "CommandError": "_errors",
    "EXIT_TABLE": "_errors",
    "classify": "_errors",
    # checkpoints
    "Checkpoint": "_checkpoint",
    "open_checkpoint": "_checkpoint",
    "read_tracker": "_checkpoint",
    "load_model": "_generate",
    "sample_text": "_generate",
    # data preparation of a config (tokenizer, tokenized prefixes)
    "prepare_tokenizer": "_data",
    "prepare_dataset": "_data",
    "tokenizer_dir": "_data",
    "data_contract": "_data",
    # the compiled step, for benchmarks and experiments outside the trainer
    "TrainStep": "_step",
    "decay_flags": "_step",
    "hyper_vector": "_step",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mindloom_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mindloom_train.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
