"""Pipeline parallel as compiled stage graphs (`mindloom_parallel.PipelineGraph`).

Under a layout with pp > 1 in `context.mode: graph` the runner is the engine runner's
(`EngineRunner`: the host-side guards, clip and ZeRO-aware AdamW of `_parallel.EngineStep`,
its checkpoint and load paths), with `ParallelEngine` replaced by `PipelineGraph`: each
stage's forward and backward per micro-batch are `ms.jit` graphs, gradients accumulate
inside them, and the 1F1B schedule with its stage-to-stage exchanges runs in Python
between them. The process stays in PyNative mode (the schedule, the exchanges and the
host update are Python); the graphs compile on their first call.

`context.mode: pynative` keeps the fully PyNative `ParallelEngine` (the debug path and
the reference of the equality tests).
"""

from __future__ import annotations

from collections.abc import Callable

from mindloom_train._engine_runner import EngineRunner
from mindloom_train._parallel import EngineStep

__all__ = ["CompiledPPStep", "PPRunner", "compiled_pp"]


def compiled_pp(dims, mode: str) -> bool:
    """Whether a layout runs the compiled pipeline stages: pp > 1 in graph mode, with or
    without tensor / sequence parallel inside a stage (`PipelineGraph` splits each stage
    with the compiled tensor-parallel step's graph region cells)."""
    return dims.pp > 1 and mode == "graph"


class CompiledPPStep(EngineStep):
    """`EngineStep` over `PipelineGraph` instead of `ParallelEngine` (see the module)."""

    ENGINE, OPTIMIZER = "PipelineGraph", "ZeroAdamWGraph"
    DESCRIPTION = ("compiled pipeline parallel (each stage's forward and backward an ms.jit "
                   "graph, 1F1B in Python, AdamW compiled)")  # fmt: skip


class PPRunner(EngineRunner):
    """`EngineRunner` with the compiled pipeline step."""

    def __init__(self, built, cfg, runtime, log: Callable[[str], None]):
        self.cfg, self.rt, self.mcfg = cfg, runtime, built.mcfg
        self.accum = cfg.grad_accum_steps
        self.par = CompiledPPStep(built.model, cfg, runtime.pcfg, runtime.groups, log)
