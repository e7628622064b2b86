"""One training step, two ways, chosen once per run.

`CompiledRunner`: the compiled step of `_step.py` (one process, plain data parallel with
the gradient all-reduce inside the graph, ZeRO-1, tensor parallel with its collectives
inside the graph: `_tp_step`, expert parallel: `_ep_step`). `EngineRunner`:
`_parallel.EngineStep`, the PyNative `ParallelEngine` (`context.mode: pynative`), and as
`_pp_step.PPRunner` the compiled pipeline stages. Both also own the model state's way in
and out of a checkpoint and their evaluation forward.

The stop rule both follow, and what the loop hands a runner, are in `_step_io`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mindloom_train import _checkpoint as ck
from mindloom_train._config import Config
from mindloom_train._engine_runner import EngineRunner
from mindloom_train._runner_comm import CompiledComm
from mindloom_train._step_io import (  # noqa: F401  (re-exported: the loop's import path)
    StepInputs,
    StepResult,
    StepRunner,
    _decode_flags,
    _encode_flags,
    load_params,
    tensors,
)


class CompiledRunner(CompiledComm):
    """`_step.TrainStep`, or for several micro-batches `AccumStep` for each and
    `UpdateStep`; `EvalStep`."""

    def __init__(self, built, cfg: Config, runtime, log: Callable[[str], None]):
        import mindspore as ms

        from mindloom_train import _step
        from mindloom_train._graph_cache import make_compile_cache
        from mindloom_train._moe import MoEEvalNet, MoELossNet, MoEStepParts, MoEWindow

        self.cfg, self.rt = cfg, runtime
        built = self._split(built, cfg, runtime, log)
        self.model, self.mcfg = built.model, built.mcfg
        # every graph below is called through graphs.run (see _graph_cache)
        self.graphs = make_compile_cache(cfg, runtime, built.mcfg, log)
        self.params, self.buffers = built.params, built.buffers
        self.accum = cfg.grad_accum_steps
        p = cfg.parallelism
        if runtime.groups is None and (
            p.tp > 1 or p.pp > 1 or p.dp > 1 or p.zero_stage or p.ep > 1
        ):
            log(
                f"parallel: one process (no msrun); parallelism dp={p.dp} tp={p.tp} pp={p.pp} "
                f"ep={p.ep} zero_stage={p.zero_stage} applies under `mindloom launch`"
            )
        weights = ms.ParameterTuple(self.params)
        flags = _step.decay_flags(self.params, cfg.optimizer.decay_embeddings)
        self.comm_probe, self._probe_grads, self._last_comm = None, None, None
        # test-only (MINDLOOM_FAULT=slow_comm): the next probe starts this fraction of the
        # mean step time late, inside its timer
        self.comm_delay = 0.0
        dp_size = runtime.dp_size
        grad_red, loss_red, eval_red, norm_red = self._reducers(runtime, p)
        self.zero = self._zero(cfg, runtime, flags, log)
        self.moe_parts, self.moe_window = None, None
        eval_net = built.loss_net
        if isinstance(built.loss_net, MoELossNet) and self.zero is not None:
            from mindloom_train._config import ConfigError

            raise ConfigError("config parallelism: family deepseek_v3 trains under plain data "
                              "parallel only (zero_stage is not wired for MoE yet)")  # fmt: skip
        if isinstance(built.loss_net, MoELossNet):  # DeepSeek-V3: stats, bias update, main CE
            dp_name = runtime.groups.dp.name if runtime.groups is not None and dp_size > 1 else None
            self.moe_parts = MoEStepParts(self.model, dp_name, dp_size, self.ep is not None)
            self.moe_window = MoEWindow(self.moe_parts.n_routers, self.moe_parts.e,
                                        self.mcfg.moe_aux_loss_weight > 0)  # fmt: skip
            eval_net = MoEEvalNet(self.model)
        zero_cell = self.zero.cell if self.zero is not None else None
        if self.ep is not None:  # ZeRO-1 under ep: dense over dp, experts over edp
            zero_cell = self.ep.zero
        self.train_step = _step.TrainStep(
            built.loss_net, weights, flags, self.accum, grad_red, loss_red, moe=self.moe_parts,
            norm_reducer=norm_red, zero=zero_cell,
        )  # fmt: skip
        if self.tp is not None:
            self.tp.attach(self.train_step, flags, self.zero)
        if self.ep is not None:
            self.ep.attach(self.train_step)
        self._init_stats(cfg, built, weights, log)
        # several micro-batches: each one is an AccumStep, then the UpdateStep (the
        # TrainStep's update on the buffers, its state shared); `train_step` itself is then
        # compiled only as the fused last micro-batch of a numerics log step (stats_step)
        self.accum_step = self.update_step = None
        if self.accum > 1:
            self.accum_step = _step.AccumStep(built.loss_net, weights, self.train_step.acc,
                                              moe=self.moe_parts)  # fmt: skip
            self.update_step = self.train_step.sibling(_step.UpdateStep)
        self.eval_step = _step.EvalStep(eval_net, eval_red)

    def _split(self, built, cfg: Config, runtime, log):
        """Tensor parallel (Llama): the model split in place, and the loss net, parameters
        and reducers are the compiled TP step's (_tp_step); expert parallel and DeepSeek-V3's
        tensor parallel: the model split in place (_ep_step). Returns the built model to
        train."""
        self.tp = self.ep = None
        if getattr(runtime, "compiled_tp", False):
            from mindloom_train._tp_step import CompiledTP

            self.tp = CompiledTP(built, cfg, runtime, log)
            built = self.tp.built
        if getattr(runtime, "compiled_ep", False):
            from mindloom_train._ep_step import CompiledEP

            self.ep = CompiledEP(built, cfg, runtime, log)
            built = self.ep.built
        return built

    def _zero(self, cfg: Config, runtime, flags, log):
        """ZeRO-1's owned-shard update inside the step (_zero_step), or None."""
        if getattr(runtime, "compiled_zero", False):
            from mindloom_train._zero_step import CompiledZero

            return CompiledZero(self.params, cfg, runtime, flags, log)
        if self.tp is not None and cfg.parallelism.zero_stage == 1 and runtime.dp_size > 1:
            # tp + ZeRO-1: the same owned-shard update on this rank's local shards, over
            # its data-parallel group (every rank of it holds the same tp slices)
            from mindloom_train._zero_step import CompiledZero

            return CompiledZero(self.params, cfg, runtime, flags, log,
                                "ZeRO-1 in the compiled tensor-parallel step")  # fmt: skip
        return None

    def _init_stats(self, cfg: Config, built, weights, log) -> None:
        """monitor.numerics / monitor.max_logits, at log steps only (`NumericsFields.wanted`):
        `stats_step` is a second graph of the same update (the same weights, moments and
        buffers), with the numerics and, for Llama, a loss net that also leaves the
        MaxLogits of its forward in a buffer; DeepSeek-V3's MaxLogits is a forward of its
        own. Every other step runs the plain `train_step`. Expert parallel: the numerics
        rows of the expert blocks are combined over the ep group (`_ep_step`)."""
        from mindloom_train._numerics import NumericsFields, logit_stats, loss_with_logit_stats

        mon = cfg.monitor
        self.numerics = self.stats_step = self.logit_stats = self.logit_buffer = None
        if not (mon.numerics or mon.max_logits):
            return
        if self.tp is not None or (self.ep is not None and self.ep.tp.size > 1):
            log("monitor: numerics and max_logits are not computed under tensor parallel")
            return
        if self.zero is not None or (self.ep is not None and self.ep.zero is not None):
            # moments of the owned parameters only: not wired yet
            log("monitor: numerics and max_logits are not computed under ZeRO-1")
            return
        self.numerics = NumericsFields(weights, mon.log_interval, cfg.training.train_iters)
        if self.ep is not None:  # each expert row will be the whole tensor's (step())
            self.numerics.sizes = self.ep.global_sizes(self.numerics.sizes)
        loss_net = built.loss_net
        if mon.max_logits and self.mcfg.family == "llama":
            loss_net = loss_with_logit_stats(built.loss_net, mon.output_logit_bound)
            self.logit_buffer = loss_net.stats
        # DeepSeek-V3 draws MindSpore's stateful dropout masks: a second forward would
        # draw some too and move the training run's masks, so not with dropout there
        elif mon.max_logits and self.ep is not None:
            log("monitor: max_logits is not computed under expert parallel (each rank's "
                "micro-batch differs from one process's last one)")  # fmt: skip
        elif mon.max_logits and not self.mcfg.dropout:
            self.logit_stats = logit_stats(self.model, mon.output_logit_bound)
        elif mon.max_logits:
            log("monitor: max_logits is not computed for deepseek_v3 with dropout")
        if mon.numerics or self.logit_buffer is not None:
            self.stats_step = self.train_step.sibling(loss_net=loss_net, numerics=mon.numerics)

    def _log_step_stats(self, step: int, batch, dkey) -> bool:
        """At a log step: DeepSeek-V3's logit statistics of `batch` (weights before the
        update); True when the stats step should run this step."""
        if self.numerics is None:
            return False
        self.numerics.clear()
        if not self.numerics.wanted(step):
            return False
        if self.logit_stats is not None:
            t = tensors(batch)
            self.numerics.logits = self.graphs.run("logit_stats", self.logit_stats,
                                                   t[0], t[2], t[3], t[4], dkey)  # fmt: skip
        return self.stats_step is not None

    def _dropout_key(self, step: int, micro: int):
        # masks are a function of (seed, step, micro-batch): a resume that restores the step
        # redraws them exactly; each data-parallel rank gets its own micro-batch numbers
        if not self.mcfg.dropout or self.mcfg.family != "llama":
            return None  # DeepSeek-V3 still draws MindSpore's stateful dropout masks
        from mindloom_model import dropout_key

        return dropout_key(self.cfg.seed, step, self.rt.dp_rank * self.accum + micro)

    def step(self, inp: StepInputs) -> StepResult:
        from mindspore import Tensor

        from mindloom_train._step import H_STOP

        prev_sum = 0.0
        for micro_i in range(self.accum - 1):
            batch = next(inp.batches)
            dkey = self._dropout_key(inp.step, micro_i)
            out = self.graphs.run("accum_step", self.accum_step, *tensors(batch), inp.hyper(), dkey)
            prev_sum += float(out.asnumpy())
        batch = next(inp.batches)
        several = self.rt.world > 1
        stop, time_up = inp.flags() if several else (False, False)
        hyper = inp.hyper(**inp.faults, prev_loss_sum=prev_sum, n_micro=self.accum, stop=stop)
        if several:  # both flags through the step's one all-reduce (see _encode_flags)
            h = hyper.asnumpy().copy()
            # averaged over the world (dp-only: the dp group; tensor parallel: every rank)
            h[H_STOP] = _encode_flags(stop, time_up, self.rt.world)
            hyper = Tensor(h)
        dkey = self._dropout_key(inp.step, self.accum - 1)
        with_numerics = self._log_step_stats(inp.step, batch, dkey)
        if with_numerics:
            outs = self.graphs.run("stats_step", self.stats_step, *tensors(batch), hyper, dkey)
        elif self.update_step is None:
            outs = self.graphs.run("train_step", self.train_step, *tensors(batch), hyper, dkey)
        else:
            last = self.graphs.run(
                "accum_step", self.accum_step, *tensors(batch), inp.hyper(), dkey
            )
            outs = self.graphs.run("update_step", self.update_step, last, hyper)
        loss_t, gnorm_t, ok_t, stop_t, *moe_t = outs
        if with_numerics and self.cfg.monitor.numerics:  # the last output; read at the record
            *moe_t, self.numerics.rows = moe_t
            if self.ep is not None:  # every rank is here (a log step): collective over ep
                self.numerics.rows = self.ep.combine_numerics(self.numerics.rows.asnumpy())
        if with_numerics and self.logit_buffer is not None:
            self.numerics.logits = self.logit_buffer
        if moe_t:
            self.moe_window.add(moe_t[0].asnumpy())
            if self.ep is not None:
                from mindloom_train._moe import N_SCALARS

                self.ep.add_step(self.moe_parts.local_loads.asnumpy(),
                                 moe_t[0].asnumpy()[N_SCALARS:])  # fmt: skip
        loss, gnorm = float(loss_t.asnumpy()), float(gnorm_t.asnumpy())
        ok = bool(ok_t.asnumpy())
        if several:
            stop, time_up = _decode_flags(float(stop_t.asnumpy()), self.rt.world)
        else:
            stop, time_up = inp.flags()
        return StepResult(loss, gnorm, ok, stop, time_up)

    def eval_loss(self, batch: dict[str, np.ndarray]) -> float:
        return float(self.graphs.run("eval_step", self.eval_step, *tensors(batch)).asnumpy())

    def _model_arrays(self) -> dict[str, np.ndarray]:
        import mindspore as ms

        return {
            p.name: p.astype(ms.float32).asnumpy() if p.dtype != ms.float32 else p.asnumpy()
            for p in self.params + self.buffers
        }

    def checkpoint_shards(self) -> tuple[dict, dict] | None:
        """(shards, metadata) on the rank that writes; None elsewhere (the data-parallel
        replicas are identical, rank 0 writes them). Tensor parallel: collective, every
        rank's shards to rank 0 (the engine path's files)."""
        if self.tp is not None:
            return self.tp.checkpoint_shards(self.rt.world)
        if self.zero is not None:
            return self.zero.checkpoint_shards(self.mcfg, self.rt.world)
        if self.rt.rank != 0:
            return None
        opt = {p.name: p.asnumpy() for p in (*self.train_step.exp_avg, *self.train_step.exp_avg_sq)}
        shards = {
            ck.shard_name("model", 0, 1): self._model_arrays(),
            ck.shard_name("optim", 0, 1): opt,
        }
        return shards, ck.default_metadata(shards, self.rt.world)

    def checkpoint_metadata(self) -> dict:
        """What metadata.json records of the layout beyond the tensors' chunks."""
        return self.ep.checkpoint_metadata() if self.ep is not None else {}

    def own_shards(self):
        """Tensor parallel, ZeRO-1 and DeepSeek-V3's ep / tp: the files this rank writes
        itself (a distributed checkpoint). Plain data parallel keeps `checkpoint_shards`: rank 0, the first
        replica, holds and writes everything, with nothing gathered."""
        if self.ep is not None:  # DeepSeek-V3 under ep / tp (_ckpt_moe)
            return self.ep.layout_state(self.buffers).own_shards()
        if self.zero is not None:
            return self.zero.layout_state(self.mcfg).own_shards(zero=True)
        return self.tp.layout_state(self.train_step).own_shards(zero=False) if self.tp else None

    def load_plan(self):
        """Tensor parallel and ZeRO-1: the blocks this rank reads at resume (balanced
        loading: ZeRO-1 reads the weights and only the moments it owns)."""
        if self.ep is not None:
            return self.ep.layout_state(self.buffers)
        if self.zero is not None:
            return self.zero.layout_state(self.mcfg)
        return self.tp.layout_state(self.train_step) if self.tp is not None else None

    def load(self, arrays: dict[str, np.ndarray], where: str) -> None:
        if self.tp is not None:
            return self.tp.load(arrays, where)
        opt_names = ("exp_avg.", "exp_avg_sq.")
        weights = {k: v for k, v in arrays.items() if not k.startswith(opt_names)}
        load_params(self.params + self.buffers, weights, where)
        if self.zero is not None:
            return self.zero.load_moments(arrays, self.mcfg)
        opt_params = [*self.train_step.exp_avg, *self.train_step.exp_avg_sq]
        load_params(opt_params, {k: v for k, v in arrays.items() if k.startswith(opt_names)}, where)

    def load_weights(self, arrays: dict[str, np.ndarray], where: str) -> None:
        if self.tp is not None:
            return self.tp.load_weights(arrays, where)
        load_params(self.params, arrays, where)

    def extra_fields(self) -> dict[str, Any]:
        if self.moe_parts is None:
            return {}
        from mindloom_train._moe import moe_bias_values

        out = self.moe_window.fields(moe_bias_values(self.model))
        self.moe_window.reset()
        return out


def make_runner(built, cfg: Config, runtime, log: Callable[[str], None]) -> StepRunner:
    """The one place the step path is chosen."""
    if getattr(runtime, "compiled_pp", False):
        from mindloom_train._moe import is_moe

        if is_moe(built.mcfg):  # DeepSeek-V3's stages (MoE, MTP, ep inside dp)
            from mindloom_train._pp_ep_step import MoEPPRunner

            return MoEPPRunner(built, cfg, runtime, log)
        from mindloom_train._pp_step import PPRunner

        return PPRunner(built, cfg, runtime, log)
    if runtime.use_engine:
        return EngineRunner(built, cfg, runtime, log)
    return CompiledRunner(built, cfg, runtime, log)
