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
- checkpoints: every rank writes its own blocks (`_ckpt_moe.MoELayoutState`: a stage's
  dense tensors by its first data-parallel replica, each expert block by the first rank
  of its expert-data-parallel group, at its global expert offset), so the files hold the
  one-process tensors and any layout, one process included, resumes them; a load reads
  only this rank's blocks.

Not here: tensor parallel inside a stage and ZeRO-1 (refused in `_modelcfg`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mindloom_train._engine_runner import EngineRunner
from mindloom_train._parallel import EngineStep

__all__ = ["MoEPPRunner", "MoEPPStep", "stage_state"]


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


def stage_state(engine, opt, shapes: dict, trainable: set, groups):
    """A pipeline stage's `MoELayoutState`: its weights with their AdamW moments, then its
    routers' biases (no moments); the embedding's copy on the last stage is the first's."""
    from mindloom_parallel import expert_block

    from mindloom_train._ckpt_moe import MoELayoutState, MoESplit

    ep = engine.pcfg.ep
    start, count = expert_block(engine.cfg.n_routed_experts, ep, engine.ep.index)
    tensors = [(n, p, (opt.exp_avg[i], opt.exp_avg_sq[i]))
               for i, (n, p) in enumerate(zip(engine.param_names, engine.params))]  # fmt: skip
    tensors += [(b.name, b, None) for b in engine.biases]
    split = MoESplit({}, 0, 1, start, count, ep, engine.edp.index == 0)
    skip = frozenset() if groups.is_first_stage else frozenset({"embed.weight"})
    return MoELayoutState(groups, tensors, shapes, trainable, split, skip)


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
        self.state = stage_state(eng, self.par.opt, shapes, trainable, g)
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
            f"(ep rank {eng.ep.index}, experts {self.state.split.expert_start}-"
            f"{self.state.split.expert_start + self.state.split.expert_count - 1}), "
            f"expert-data-parallel "
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

    def checkpoint_metadata(self) -> dict:
        from mindloom_parallel import expert_metadata

        return {"expert_parallel": expert_metadata(self.mcfg, self.rt.pcfg)}

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
