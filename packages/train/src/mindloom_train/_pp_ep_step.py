"""Pipeline parallel for DeepSeek-V3 (`parallelism.pp > 1`, family deepseek_v3, graph
mode), with or without expert parallel inside data parallel.

The runner is the compiled pipeline's (`_pp_step.PPRunner`: `EngineStep`'s host-side
guards, clipping and compiled AdamW, 1F1B in Python) over
`mindloom_parallel.MoEPipelineGraph` instead of `PipelineGraph`: each stage's MoE layers
(and, on the last stage, the head and the MTP blocks) are compiled stage graphs with the
ep exchange inside, dense gradients reduced over dp, expert blocks over the
expert-data-parallel group, the embedding's two copies (first stage, and the last stage's
MTP blocks) summed. What this module adds for the MoE:

- the balancing bias: after an applied update every stage moves its routers' biases by the
  loads of the whole global batch (`MoEPipelineGraph.update_bias`), as the one-process
  step does in its graph;
- the metrics: the MoE fields of `_moe.MoEWindow` over all routers (each stage's rows
  summed over the pipeline at a log step), the tokens each rank sends and receives, the
  exchange probe (`_ep_step.EPTraffic`);
- checkpoints: every rank writes its own blocks (`MoEStageState`: a stage's dense tensors
  by its first data-parallel replica, each expert block by the first rank of its
  expert-data-parallel group, the global expert offset as the chunk's), so the files
  hold the one-process tensors and any layout, one process included, resumes them; a
  load reads only this rank's blocks.

Not here: tensor parallel inside a stage and ZeRO-1 (refused in `_modelcfg`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mindloom_train._engine_runner import EngineRunner
from mindloom_train._parallel import EngineStep

__all__ = ["MoEPPRunner", "MoEPPStep", "MoEStageState"]


class MoEPPStep(EngineStep):
    """`EngineStep` over `MoEPipelineGraph`; the biases move after an applied update."""

    ENGINE, OPTIMIZER = "MoEPipelineGraph", "ZeroAdamWGraph"
    DESCRIPTION = ("compiled pipeline parallel for DeepSeek-V3 (each stage's MoE forward and "
                   "backward an ms.jit graph with the ep exchange inside, 1F1B in Python, "
                   "AdamW compiled)")  # fmt: skip

    def step(self, micro_batches, hyper, *, stop: bool, time_up: bool, dropout_keys=None):
        out = super().step(micro_batches, hyper, stop=stop, time_up=time_up,
                           dropout_keys=dropout_keys)  # fmt: skip
        if out[2]:  # every rank agrees on ok (EngineStep's gather)
            self.engine.update_bias()
        return out


@dataclass(frozen=True)
class _Spec:
    global_shape: tuple


class MoEStageState:
    """One rank's tensors of a DeepSeek-V3 pipeline stage (global names): what it writes
    into a distributed checkpoint and the blocks it reads back (`_ckpt_dist`'s `own_shards`
    / `load_plan` protocol, as `_ckpt_own.LayoutState` for Llama)."""

    def __init__(self, engine, opt, shapes: dict[str, tuple], trainable: set[str], groups):
        from mindloom_parallel import expert_block, is_expert_param

        self.groups = groups
        self.layout = {n: _Spec(tuple(s)) for n, s in shapes.items()}
        self.trainable = trainable
        mcfg = engine.cfg
        self.start, self.count = expert_block(mcfg.n_routed_experts, engine.pcfg.ep,
                                              engine.ep.index)  # fmt: skip
        self.first_expert_replica = engine.edp.index == 0
        self.is_expert = is_expert_param
        # (name, parameter, (exp_avg, exp_avg_sq) or None): the stage's weights, then its
        # routers' biases (not trained: no moments)
        self.tensors = [(n, p, (opt.exp_avg[i], opt.exp_avg_sq[i]))
                        for i, (n, p) in enumerate(zip(engine.param_names, engine.params))]  # fmt: skip
        self.tensors += [(b.name, b, None) for b in engine.biases]
        # the embedding's copy on the last stage (read by the MTP blocks) is the first's
        self.skip = {"embed.weight"} if not groups.is_first_stage else set()
        self.ep = engine.pcfg.ep

    def _box(self, name: str) -> tuple[tuple, tuple]:
        shape = self.layout[name].global_shape
        if self.is_expert(name):
            return (self.start,) + (0,) * (len(shape) - 1), (self.count,) + tuple(shape[1:])
        return (0,) * len(shape), tuple(shape)

    def own_shards(self):
        from mindloom_train._ckpt_files import shard_name
        from mindloom_train._ckpt_own import OwnShards

        g = self.groups
        out = OwnShards()
        mfile = shard_name("model", g.rank, g.world_size)
        ofile = shard_name("optim", g.rank, g.world_size)
        for name, p, moments in self.tensors:
            expert = self.is_expert(name)
            writes = self.first_expert_replica if expert else g.dp_rank == 0
            if name in self.skip or not writes:
                continue
            self._add(out, mfile, name, name, np.asarray(p.asnumpy(), np.float32), expert)
            for prefix, m in zip(("exp_avg.", "exp_avg_sq."), moments or ()):
                self._add(out, ofile, prefix + name, name, m.asnumpy(), expert)
        return out

    def _add(self, out, fname: str, key: str, name: str, arr: np.ndarray, expert: bool) -> None:
        off, shape = self._box(name)
        if tuple(arr.shape) != shape:
            raise ValueError(f"{key}: local shape {list(arr.shape)} != its block {list(shape)}")
        out.files.setdefault(fname, {})[key] = arr
        entry = out.tensors.setdefault(key, {
            "file": fname, "dtype": str(arr.dtype),
            "global_shape": list(self.layout[name].global_shape),
            "split": {"ep_axis": 0, "ep": self.ep} if expert else None, "chunks": [],
        })  # fmt: skip
        entry["chunks"].append({"file": fname, "key": key, "offset": list(off),
                                "shape": list(shape)})  # fmt: skip

    def expected_names(self) -> set[str]:
        """Every tensor a checkpoint of this model holds: weights, biases, moments."""
        return set(self.layout) | {p + n for n in self.trainable
                                   for p in ("exp_avg.", "exp_avg_sq.")}  # fmt: skip

    def boxes(self, weights_only: bool = False) -> dict[str, tuple]:
        out = {}
        for name, _, moments in self.tensors:
            out[name] = self._box(name)
            if moments is not None and not weights_only:
                out["exp_avg." + name] = out["exp_avg_sq." + name] = out[name]
        return out

    def held_bytes(self, weights_only: bool = False) -> int:
        return sum(4 * int(np.prod(s)) for _, s in self.boxes(weights_only).values())

    def load(self, arrays: dict[str, np.ndarray], weights_only: bool = False) -> None:
        import mindspore as ms
        from mindspore import ops

        for name, p, moments in self.tensors:
            ops.assign(p, ms.Tensor(arrays[name], p.dtype))
            if moments is not None and not weights_only:
                for prefix, m in zip(("exp_avg.", "exp_avg_sq."), moments):
                    ops.assign(m, ms.Tensor(np.asarray(arrays[prefix + name], np.float32)))


class MoEPPRunner(EngineRunner):
    """`EngineRunner` with `MoEPPStep`, the MoE metrics and the per-rank checkpoints."""

    def __init__(self, built, cfg, runtime, log: Callable[[str], None]):
        from mindloom_parallel import stage_routers

        from mindloom_train._ep_step import EPTraffic
        from mindloom_train._moe import MoEWindow

        self.cfg, self.rt, self.mcfg = cfg, runtime, built.mcfg
        self.accum = cfg.grad_accum_steps
        model = built.model
        # the whole model's tensors, before the stage cut: a checkpoint holds them all
        shapes = {p.name: tuple(p.shape) for p in model.get_parameters()}
        trainable = {p.name for p in model.trainable_params()}
        self.par = MoEPPStep(model, cfg, runtime.pcfg, runtime.groups, log)
        eng, g, pcfg = self.par.engine, runtime.groups, runtime.pcfg
        if pcfg.micro_batch_num != self.accum:
            raise ValueError(f"micro_batch_num {pcfg.micro_batch_num} != the trainer's "
                             f"{self.accum} micro-batches per step")  # fmt: skip
        self.state = MoEStageState(eng, self.par.opt, shapes, trainable, g)
        cfgm = self.mcfg
        self.n_routers = sum(stage_routers(cfgm, pcfg.pp, s) for s in range(pcfg.pp))
        # this stage's rows in the model's router order (trunk MoE layers, then MTP)
        self.row0 = sum(stage_routers(cfgm, pcfg.pp, s) for s in range(g.pp_rank))
        self.window = MoEWindow(self.n_routers, cfgm.n_routed_experts,
                                cfgm.moe_aux_loss_weight > 0)  # fmt: skip
        self._run = _JitRun()
        self.traffic = EPTraffic(cfgm, pcfg, g, eng.ep, eng.edp, eng.model,
                                 cfg.training.micro_batch_size, cfg.train_dataset.seq_length,
                                 self.accum)  # fmt: skip
        log(f"parallel: pipeline stage {g.pp_rank} of {pcfg.pp}: layers "
            f"{list(eng.layer_ids)}, {len(eng.routers)} routers; expert parallel ep={pcfg.ep} "
            f"(ep rank {eng.ep.index}, experts {self.state.start}-"
            f"{self.state.start + self.state.count - 1}), expert-data-parallel "
            f"{eng.edp.size}")  # fmt: skip

    def step(self, inp):
        res = super().step(inp)
        eng = self.par.engine
        head = np.asarray(eng.last_head, np.float64)
        n = self.accum * self.rt.pcfg.dp  # micro-batches of the global batch
        w = float(self.mcfg.moe_aux_loss_weight)
        e = self.mcfg.n_routed_experts
        loads = np.zeros((self.n_routers, e))
        r = len(eng.routers)
        loads[self.row0 : self.row0 + r] = eng.last_loads
        bal = head[2] / w if w > 0 else head[2]
        self.window.add(np.concatenate([[head[0] / n, head[1] / n, bal / n, head[3]],
                                        loads.reshape(-1)]))  # fmt: skip
        if r:
            self.traffic.add_step(eng.last_local_loads, eng.last_loads)
        return res

    def extra_fields(self) -> dict:
        """The MoE fields over every router: each stage's rows (loads, biases) summed over
        the pipeline (a log step: every rank is here)."""
        from mindloom_parallel import sum_over_group

        eng = self.par.engine
        biases = np.zeros(self.window.shape, np.float32)
        for i, b in enumerate(eng.biases):
            biases[self.row0 + i] = b.asnumpy()
        loads, biases = sum_over_group([self.window.loads.astype(np.float32), biases],
                                       self.rt.groups.pp)  # fmt: skip
        self.window.loads = loads.astype(np.float64)
        out = self.window.fields(biases)
        self.window.reset()
        return out

    def comm_fields(self, window, probe: bool) -> dict:
        out = super().comm_fields(window, probe)
        out.update(self.traffic.exchange_fields(self._run, window.mean_step_time(), probe))
        return out

    def checkpoint_shards(self):  # pragma: no cover - the distributed path writes these
        raise NotImplementedError("DeepSeek-V3 pipeline checkpoints are written per rank")

    def own_shards(self):
        return self.state.own_shards()

    def load_plan(self):
        return self.state


class _JitRun:
    """`graphs.run`'s signature for `EPTraffic.exchange_fields`: the probe cell compiled
    (the process runs PyNative here, where a waiting collective spins a core)."""

    def __init__(self):
        self._graphs: dict = {}

    def run(self, name: str, cell, *args):
        graph = self._graphs.get(name)
        if graph is None:
            graph = self._graphs[name] = _jit_cell(cell)
        return graph(*args)


def _jit_cell(cell):
    import mindspore as ms
    from mindspore import nn

    class Jit(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.inner = cell

        @ms.jit
        def construct(self, *args):
            return self.inner(*args)

    return Jit()
