"""`EngineRunner`: the step through `_parallel.EngineStep` (the PyNative `ParallelEngine`
under a pipeline / ZeRO-1 layout, or tensor parallel in pynative mode); `_runner` chooses it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mindloom_train import _checkpoint as ck
from mindloom_train._config import Config
from mindloom_train._rankstats import memory_row, rank_fields
from mindloom_train._step_io import StepInputs, StepResult
from mindloom_train._throughput import ThroughputWindow

__all__ = ["EngineRunner"]


class EngineRunner:
    """`_parallel.EngineStep`: forward/backward through ParallelEngine, the update on the
    host; it gathers loss, grad norm and both flags from every rank in one all-gather."""

    def __init__(self, built, cfg: Config, runtime, log: Callable[[str], None]):
        from mindloom_train._parallel import EngineStep

        self.cfg, self.rt, self.mcfg = cfg, runtime, built.mcfg
        self.accum = cfg.grad_accum_steps
        self.par = EngineStep(built.model, cfg, runtime.pcfg, runtime.groups, log)

    def step(self, inp: StepInputs) -> StepResult:
        micro = [next(inp.batches) for _ in range(self.accum)]
        stop, time_up = inp.flags()
        hyper = inp.hyper(**inp.faults, n_micro=self.accum, stop=stop)
        loss, gnorm, ok, stop_any, time_any = self.par.step(
            micro, hyper.asnumpy(), stop=stop, time_up=time_up,
            dropout_keys=self._dropout_keys(inp.step),
        )  # fmt: skip
        if self.rt.world == 1:
            stop_any, time_any = inp.flags()
        m = self.par.rank_metrics
        return StepResult(loss, gnorm, ok, stop_any, time_any, m["comm_s"], m["step_s"])

    def _dropout_keys(self, step: int):
        # the compiled step's keys (CompiledRunner._dropout_key): (seed, step, micro-batch),
        # the micro-batch numbered across data-parallel ranks; the same on every tp/pp rank
        if not self.mcfg.dropout or self.mcfg.family != "llama":
            return None
        from mindloom_model import dropout_key

        first = self.rt.dp_rank * self.accum
        return [dropout_key(self.cfg.seed, step, first + i) for i in range(self.accum)]

    def eval_loss(self, batch: dict[str, np.ndarray]) -> float:
        return self.par.eval_loss(batch)

    def checkpoint_shards(self) -> tuple[dict, dict] | None:
        """Collective: every rank sends its shards, rank 0 writes them all."""
        from mindloom_train._parallel import chunk_metadata

        shards = self.par.gather_shards()
        if self.rt.rank != 0:
            return None
        metadata = ck.default_metadata({}, self.rt.world)
        metadata["tensors"], _ = chunk_metadata(self.mcfg, self.rt.pcfg, self.rt.world)
        return shards, metadata

    def _layout_state(self):
        """This rank's weights and the moments it holds, by global name (`_ckpt_own`)."""
        from mindloom_train._ckpt_own import LayoutState

        opt = self.par.opt
        moments = [(opt.exp_avg[i], opt.exp_avg_sq[i]) if i in opt.exp_avg else None
                   for i in range(len(self.par.names))]  # fmt: skip
        return LayoutState(self.mcfg, self.rt.pcfg, self.rt.groups, self.par.names,
                           self.par.params, moments)  # fmt: skip

    def own_shards(self):
        """The files this rank writes itself (a distributed checkpoint; no gather)."""
        return self._layout_state().own_shards(zero=self.par.opt.sharded)

    def load_plan(self):
        """The blocks this rank reads at resume (balanced loading)."""
        return self._layout_state()

    def load(self, arrays: dict[str, np.ndarray], where: str) -> None:
        self.par.load(arrays, where)

    def load_weights(self, arrays: dict[str, np.ndarray], where: str) -> None:
        self.par.load_weights(arrays)

    def extra_fields(self) -> dict[str, Any]:
        return {}

    def comm_fields(self, window: ThroughputWindow, probe: bool) -> dict[str, Any]:
        """Measured around each collective (the engine runs PyNative), this rank and every rank."""
        from mindloom_parallel import gather_rows

        steps = max(window.steps, 1)
        # (comm, the engine's step time) and this rank's memory row (_rankstats), gathered
        rows = gather_rows([window.comm_s, window.rank_step_s,
                            *memory_row(window.mean_step_time())], self.rt.groups.world)  # fmt: skip
        ranks = [(float(r[0]), float(r[1])) for r in rows]
        share = [c / s if s > 0 else 0.0 for c, s in ranks]
        return {
            "comm_s": ranks[self.rt.rank][0] / steps,
            "comm_share": share[self.rt.rank],
            "comm_s_ranks": [c / steps for c, _ in ranks],
            "comm_share_ranks": share,
            **rank_fields(
                [r[2:] for r in rows], self.cfg.training.global_batch_size / self.rt.dp_size
            ),  # fmt: skip
        }
