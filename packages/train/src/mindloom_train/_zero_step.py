"""Data parallel with ZeRO-1 as the trainer's compiled step.

Under `parallelism.zero_stage: 1` with dp > 1 (tp = pp = 1, `context.mode: graph`)
`CompiledRunner` keeps its plain data-parallel `TrainStep` (the bucketed `GradReducer`
inside the graph) and hands it a `mindloom_parallel.ZeroShardUpdate`: the fused AdamW
kernel on the parameters this rank owns, AdamW moments for those only, and the owners'
new values shared with every replica by an all-reduce in the same graph. The guards, the
clip and the loss-scale arithmetic are the step's own; a test-only gradient poison enters
before the reduction, so every rank skips together.

Checkpoints are distributed (`layout_state`, `_ckpt_own`): the first replica writes the
weights, each rank the moments it owns, and a resume reads only those blocks. The
gathered form (`checkpoint_shards`: a `ZeroAdamW` whose moment dicts are this step's
tensors gathers them to rank 0, the engine's zero1 files) remains for callers without
the distributed path.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mindloom_train import _checkpoint as ck


def compiled_zero(dims, mode: str) -> bool:
    """Whether a layout runs the compiled ZeRO-1 step: zero_stage 1 over dp > 1 without
    tensor or pipeline parallel, in graph mode (`context.mode: pynative` keeps the engine).
    Under expert parallel the ep step shards the state itself (`_ep_step`)."""
    model_parallel = dims.tp > 1 or dims.pp > 1 or getattr(dims, "ep", 1) > 1
    return dims.zero_stage == 1 and dims.dp > 1 and not model_parallel and mode == "graph"


class CompiledZero:
    """The ZeRO-1 update cell of a compiled data-parallel step and its checkpoint I/O."""

    def __init__(self, params, cfg, runtime, decay_flags, log: Callable[[str], None],
                 step: str = "compiled data parallel + ZeRO-1 (GRAPH_MODE)"):  # fmt: skip
        from mindloom_parallel import ZeroAdamW, ZeroShardUpdate

        g = runtime.groups
        self.groups, self.pcfg, self.params = g, runtime.pcfg, list(params)
        self.names = [p.name for p in self.params]
        self.cell = ZeroShardUpdate(self.params, g.dp, decay_flags, cfg.parallelism.bucket_size_mb)
        # checkpoint I/O only: its moment dicts become this cell's tensors (its own
        # zero-filled ones are dropped here)
        io = ZeroAdamW(self.params, self.names, g, 1, decay_flags)
        if list(io.owned) != list(self.cell.owned):
            raise RuntimeError("ZeRO-1 ownership differs between the step and its checkpoint I/O")
        io.exp_avg = dict(zip(self.cell.owned, self.cell.exp_avg))
        io.exp_avg_sq = dict(zip(self.cell.owned, self.cell.exp_avg_sq))
        self.io = io
        total = sum(self.cell.sizes)
        mine = self.cell.state_values
        log(f"parallel: {g.describe()}; {step}, AdamW "
            f"state for {mine / 1e6:.3f}M of {total / 1e6:.3f}M values on this rank "
            f"({8 * mine / 2**20:.2f} MiB, plain dp {8 * total / 2**20:.2f} MiB)")  # fmt: skip

    def layout_state(self, mcfg):
        """This rank's weights and the moments it owns, by global name, for a distributed
        checkpoint (every replica holds the weights whole; each owner its moments)."""
        from mindloom_train._ckpt_own import LayoutState

        io = self.io
        moments = [(io.exp_avg[i], io.exp_avg_sq[i]) if i in io.exp_avg else None
                   for i in range(len(self.names))]  # fmt: skip
        return LayoutState(mcfg, self.pcfg, self.groups, self.names, self.params, moments)

    def checkpoint_shards(self, mcfg, world: int) -> tuple[dict, dict] | None:
        """Collective over the world: rank 0 gets the weights and the gathered moments
        (the engine's zero1 files and metadata); None elsewhere."""
        from mindloom_train._parallel import chunk_metadata

        shards = self.io.gather_shards(mcfg, self.pcfg,
                                       lambda kind, rank: ck.shard_name(kind, rank, world))  # fmt: skip
        if self.groups.rank != 0:
            return None
        metadata = ck.default_metadata({}, world)
        metadata["tensors"], _ = chunk_metadata(mcfg, self.pcfg, world)
        return shards, metadata

    def load_moments(self, arrays: dict[str, np.ndarray], mcfg) -> None:
        """This rank's owned moments from GLOBAL tensors (a checkpoint of any layout)."""
        want = {f"{k}.{n}" for n in self.names for k in ("exp_avg", "exp_avg_sq")}
        missing = sorted(want - set(arrays))
        if missing:
            raise ck.CheckpointError(f"checkpoint lacks optimizer tensor {missing[0]!r} "
                                     f"({len(missing)} missing)")  # fmt: skip
        self.io.load_moments(arrays, mcfg, self.pcfg)
