"""mindloom_parallel: data, tensor, sequence and pipeline parallelism and ZeRO-1 under msrun.

See the package README for the API and the layouts.
"""

from mindloom_parallel.__about__ import __version__
from mindloom_parallel._config import ParallelConfig, ParallelConfigError, ParallelDims, validate
from mindloom_parallel._groups import (
    PROCESS_COMMUNICATORS,
    Communicators,
    Group,
    ParallelGroups,
    coords_rank,
    dp_slice,
    init_parallel,
    rank_coords,
)
from mindloom_parallel._launch import (
    EXIT_ORPHANED,
    LaunchError,
    LaunchStopped,
    RunLock,
    guard_worker,
    launch,
    mark_run_ended,
    set_parent_death_signal,
)
from mindloom_parallel._layout import (
    TensorSpec,
    assemble_state,
    assemble_tensor,
    expert_metadata,
    layout_metadata,
    rank_state,
    rank_tensor_names,
    shard_tensor,
    tensor_layout,
)
from mindloom_parallel._pp import one_f_one_b, pipeline_stage, stage_layers
from mindloom_parallel._zero import adamw_scalars, chunk_metadata, zero_owners

__all__ = [
    "__version__",
    "EPGradReducer",
    "EPNormSquare",
    "EPZeroShardUpdate",
    "GatherSeqGraph",
    "ReduceScatterSeqGraph",
    "ep_group_ranks",
    "ep_traffic",
    "expert_block",
    "expert_metadata",
    "expert_parallel",
    "gather_experts",
    "init_expert_groups",
    "is_expert_param",
    "MoEPipelineGraph",
    "deepseek_stage",
    "moe_bias_step",
    "stage_routers",
    "EXIT_ORPHANED",
    "PROCESS_COMMUNICATORS",
    "CommRecorder",
    "CommStats",
    "Communicators",
    "Group",
    "GradReducer",
    "LaunchError",
    "LaunchStopped",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelDims",
    "ParallelEngine",
    "ParallelGroups",
    "PipelineGraph",
    "RunLock",
    "TensorSpec",
    "TPGradReducer",
    "TPLlamaWithLoss",
    "TPNormSquare",
    "ZeroAdamW",
    "ZeroAdamWGraph",
    "ZeroShardUpdate",
    "adamw_scalars",
    "assemble_state",
    "assemble_tensor",
    "chunk_metadata",
    "coords_rank",
    "dp_slice",
    "gather_rows",
    "guard_worker",
    "mark_run_ended",
    "init_parallel",
    "launch",
    "layout_metadata",
    "native_collectives",
    "one_f_one_b",
    "parallelize_llama",
    "parallelize_llama_graph",
    "pipeline_stage",
    "rank_coords",
    "rank_state",
    "rank_tensor_names",
    "set_parent_death_signal",
    "shard_tensor",
    "stage_layers",
    "tensor_layout",
    "validate",
    "vocab_start",
    "zero_owners",
]


_LAZY = {
    "EPGradReducer": "_ep",
    "EPNormSquare": "_ep",
    "EPZeroShardUpdate": "_ep",
    "ep_group_ranks": "_ep",
    "ep_traffic": "_ep",
    "expert_block": "_ep",
    "expert_parallel": "_ep",
    "gather_experts": "_ep",
    "init_expert_groups": "_ep",
    "is_expert_param": "_ep",
    "MoEPipelineGraph": "_pp_ep",
    "deepseek_stage": "_pp_ep",
    "moe_bias_step": "_pp_ep",
    "stage_routers": "_pp_ep",
    "GatherSeqGraph": "_tp_graph",
    "ReduceScatterSeqGraph": "_tp_graph",
    "CommRecorder": "_comm",
    "CommStats": "_comm",
    "native_collectives": "_comm",
    "GradReducer": "_dp",
    "ParallelEngine": "_engine",
    "PipelineGraph": "_pp_graph",
    "parallelize_llama": "_tp",
    "parallelize_llama_graph": "_tp_graph",
    "TPGradReducer": "_tp_graph",
    "TPLlamaWithLoss": "_tp_graph",
    "TPNormSquare": "_tp_graph",
    "ZeroAdamW": "_zero",
    "ZeroAdamWGraph": "_pp_graph",
    "ZeroShardUpdate": "_zero_graph",
    "gather_rows": "_zero",
    "vocab_start": "_tp",
}


def __getattr__(name):
    # the MindSpore parts import on first use, so config checks and the launcher stay light
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"mindloom_parallel.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mindloom_parallel' has no attribute {name!r}")
