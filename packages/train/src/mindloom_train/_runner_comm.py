"""The compiled step's communication (`_runner.CompiledRunner`'s part): the reducers a
layout's step runs inside its graph, the probe that times the same collectives in a graph
of their own, and the step record's `comm_*` and per-rank fields."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mindloom_train._rankstats import memory_row, rank_fields
from mindloom_train._throughput import ThroughputWindow

__all__ = ["CompiledComm"]


class CompiledComm:
    """Mixed into `CompiledRunner`, whose `graphs`, `params`, `tp`, `ep`, `cfg` and `rt` it
    reads; it owns `comm_probe`, `_probe_grads`, `_last_comm` and `comm_delay`."""

    def _reducers(self, runtime, p) -> tuple:
        """(gradient, loss, evaluation, norm) reducers of the layout's step, None where one
        process needs none; the comm probe compiled and warmed up here, where every rank
        passes at the same time."""
        import mindspore as ms

        from mindloom_train import _step

        grad_red = loss_red = eval_red = norm_red = None
        if self.tp is not None:
            grad_red, loss_red = self.tp.grad_reducer, self.tp.loss_reducer
            eval_red, norm_red = self.tp.eval_reducer, self.tp.norm_reducer
            # the step's collectives in a graph of their own (see _probe_comm)
            self.comm_probe, self._probe_grads = self.tp.probe.cell, self.tp.probe.inputs
            self.graphs.run("comm_probe", self.comm_probe, self._probe_grads)[0].asnumpy()
        elif self.ep is not None:
            grad_red, loss_red = self.ep.grad_reducer, self.ep.loss_reducer
            eval_red, norm_red = self.ep.eval_reducer, self.ep.norm_reducer
            self.comm_probe, self._probe_grads = self.ep.comm_probe, self.ep.comm_inputs
            self.graphs.run("comm_probe", self.comm_probe, self._probe_grads)[0].asnumpy()
            ex = self.ep.exchange
            self.graphs.run("ep_exchange", ex.cell, ex.inputs)[0].asnumpy()
        elif runtime.groups is not None and runtime.dp_size > 1:
            from mindloom_parallel import GradReducer

            dp = runtime.groups.dp
            grad_red = GradReducer(self.params, dp, p.bucket_size_mb, mean=True)
            loss_red = _step.MeanOver(dp.name, dp.size)
            eval_red = _step.MeanOver(dp.name, dp.size)
            # The step's all-reduce runs inside the compiled graph, where the host cannot
            # time it; this probe is the same reducer (same buckets, group and bytes) in
            # a graph of its own, timed at deterministic log steps (see comm_fields).
            # Compiled and warmed up here, where every rank passes at the same time.
            self.comm_probe = GradReducer(self.params, dp, p.bucket_size_mb, mean=True)
            self._probe_grads = tuple(ms.Tensor(np.zeros(q.shape, np.float32)) for q in self.params)
            self.graphs.run("comm_probe", self.comm_probe, self._probe_grads)[0].asnumpy()
        return grad_red, loss_red, eval_red, norm_red

    def comm_fields(self, window: ThroughputWindow, probe: bool) -> dict[str, Any]:
        """The compiled data-parallel step holds its all-reduce inside the graph, where it
        cannot be timed; `comm_probe` (the same reducer on the same bytes, its own graph)
        is timed instead, only at log steps every rank reaches (`probe`): a log forced by
        a signal on one rank must not start a collective the others never join; such a
        record repeats the last probe. One process: 0."""
        if self.rt.world == 1:
            return {"comm_s": 0.0, "comm_share": 0.0, "comm_s_ranks": [0.0],
                    "comm_share_ranks": [0.0],
                    **rank_fields([memory_row(window.mean_step_time())],
                                  self.cfg.training.global_batch_size)}  # fmt: skip
        if self.comm_probe is None:
            return {"comm_s": None, "comm_share": None, "comm_s_ranks": None,
                    "comm_share_ranks": None}  # fmt: skip
        if probe or self._last_comm is None:
            self._last_comm = self._probe_comm(window)
        if self.ep is not None:  # the exchange's own probe and the tokens per rank
            return {
                **self._last_comm,
                **self.ep.exchange_fields(
                    self.graphs, window.mean_step_time(), probe or self.ep.last is None
                ),
            }
        return self._last_comm

    def _probe_comm(self, window: ThroughputWindow) -> dict[str, Any]:
        from mindloom_parallel import gather_rows

        t0 = time.perf_counter()
        if self.comm_delay:
            time.sleep(self.comm_delay * window.mean_step_time())
        self.graphs.run("comm_probe", self.comm_probe, self._probe_grads)[0].asnumpy()
        comm = time.perf_counter() - t0
        # the same all-gather carries each rank's memory and step time (_rankstats)
        rows = gather_rows([comm, *memory_row(window.mean_step_time())], self.rt.groups.world)
        ranks = [(r[0], r[4]) for r in rows]
        share = [min(1.0, float(c) / float(s)) if s > 0 else 0.0 for c, s in ranks]
        return {
            "comm_s": comm,
            "comm_share": share[self.rt.rank],
            "comm_s_ranks": [float(c) for c, _ in ranks],
            "comm_share_ranks": share,
            **rank_fields(
                [r[1:] for r in rows], self.cfg.training.global_batch_size / self.rt.dp_size
            ),  # fmt: skip
        }
