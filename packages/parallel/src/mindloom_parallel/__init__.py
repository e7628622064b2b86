"""mindloom_parallel: data, tensor, sequence and pipeline parallelism under msrun.

See the package README for the API and the layouts.
"""

from mindloom_parallel.__about__ import __version__
from mindloom_parallel._config import ParallelConfig, ParallelConfigError, validate
from mindloom_parallel._groups import Group, ParallelGroups, dp_slice, init_parallel, rank_coords
from mindloom_parallel._launch import (
    EXIT_ORPHANED,
    LaunchError,
    LaunchStopped,
    RunLock,
    guard_worker,
    launch,
    set_parent_death_signal,
)
from mindloom_parallel._layout import (
    TensorSpec,
    assemble_state,
    assemble_tensor,
    layout_metadata,
    rank_state,
    shard_tensor,
    tensor_layout,
)
from mindloom_parallel._pp import one_f_one_b, pipeline_stage, stage_layers

__all__ = [
    "__version__",
    "EXIT_ORPHANED",
    "CommStats",
    "Group",
    "GradReducer",
    "LaunchError",
    "LaunchStopped",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelEngine",
    "ParallelGroups",
    "RunLock",
    "ShardedOptimizer",
    "TensorSpec",
    "assemble_state",
    "assemble_tensor",
    "comm_stats",
    "dp_slice",
    "init_parallel",
    "guard_worker",
    "launch",
    "set_parent_death_signal",
    "layout_metadata",
    "native_collectives",
    "one_f_one_b",
    "parallelize_llama",
    "pipeline_stage",
    "rank_coords",
    "rank_state",
    "shard_tensor",
    "stage_layers",
    "tensor_layout",
    "validate",
    "vocab_start",
]


_LAZY = {
    "CommStats": "_comm",
    "comm_stats": "_comm",
    "native_collectives": "_comm",
    "GradReducer": "_dp",
    "ShardedOptimizer": "_dp",
    "ParallelEngine": "_engine",
    "parallelize_llama": "_tp",
    "vocab_start": "_tp",
}


def __getattr__(name):
    # the MindSpore parts import on first use, so config checks and the launcher stay light
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"mindloom_parallel.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mindloom_parallel' has no attribute {name!r}")
