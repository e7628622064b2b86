"""Expert and tensor parallel (DeepSeek-V3, `parallelism.ep > 1` and / or `tp > 1`) as
the trainer's compiled step.

`CompiledRunner` keeps its `TrainStep` / `AccumStep` / `EvalStep` graphs; this module hands
it what changes: with tp > 1 the model split in place by `deepseek_tp_plan`
(`mindloom_parallel.parallelize_deepseek_graph`: MLA over heads, dense and shared-expert
MLPs over their width, routed experts, router and vocabulary whole); the model's routed
experts split in place over the ep group (`mindloom_parallel.expert_parallel`, with the
exchange cells inside each MoE layer; the ep group is the ranks of one tp index); the
gradient reducer (the MLA down-projections' partial gradients summed over tp, dense
tensors averaged over dp, expert blocks over the expert-data-parallel group only, scaled
by 1/dp), the global gradient norm (tp shards over tp, expert blocks over ep), the
exchange probe for `comm_fields`, and the token traffic per rank. The MoE stats (global
expert loads, the bias update) are `_moe.MoEStepParts`' data-parallel sums as before (the
tp ranks of a replica see the same tokens).

Checkpoints are written per rank (`_ckpt_moe.MoELayoutState`): each block once in the
world, the tp shards at their tp offset and the expert blocks at their global expert
offset, so they read back as the one-process tensors; a load reads only this rank's
blocks, so ep2, tp2 x ep2 and one process resume each other's checkpoints.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import mindspore as ms
import numpy as np
from mindspore import nn, ops


def compiled_ep(dims) -> bool:
    """Expert parallel (with or without ZeRO-1, with or without tensor parallel) without
    pipeline parallel (refused for deepseek_v3 in `_modelcfg`). DeepSeek-V3 under tp > 1
    with ep = 1 runs here too: `_build` switches it over once the family is known."""
    return getattr(dims, "ep", 1) > 1 and dims.pp == 1


class EPTraffic:
    """An expert-parallel rank's token traffic (token-slots sent and received per step,
    from its own and the global loads) and the exchange probe timed at log steps; the
    compiled step (`CompiledEP`) and the pipeline stages (`_pp_ep_step`) share it."""

    def __init__(self, mcfg, pcfg, groups, ep, edp, model, micro_batch_size: int,
                 seq_length: int, accum: int):  # fmt: skip
        self.mcfg, self.pcfg, self.groups, self.ep, self.edp = mcfg, pcfg, groups, ep, edp
        self.exchange = ExchangeProbe(ep, model, micro_batch_size, seq_length, accum)
        self._sent = self._received = 0.0
        self._steps = 0
        self.last = None

    def add_step(self, local_loads: np.ndarray, global_loads: np.ndarray) -> None:
        from mindloom_parallel import ep_traffic

        e = self.mcfg.n_routed_experts  # the stats hold [routers * E] flat
        sent, received = ep_traffic(np.reshape(local_loads, (-1, e)),
                                    np.reshape(global_loads, (-1, e)), self.pcfg.ep,
                                    self.ep.index)  # fmt: skip
        if self.edp.size > 1:
            received = float("nan")  # the dp sums mix other ep groups' slots
        self._sent += sent
        self._received += received
        self._steps += 1

    def traffic(self) -> tuple[float, float]:
        """Mean token-slots sent / received per step since the last call (this rank)."""
        n = max(self._steps, 1)
        out = (self._sent / n, self._received / n)
        self._sent = self._received = 0.0
        self._steps = 0
        return out

    def exchange_fields(self, graphs, step_time: float, probe: bool) -> dict:
        """At log steps every rank reaches (`probe`): the exchange probe timed and every
        rank's (exchange s, sent, received) gathered; other records repeat the last."""
        from mindloom_parallel import gather_rows

        sent, received = self.traffic()
        if not probe and self.last is not None:
            return {**self.last, "ep_tokens_sent": sent, "ep_tokens_received": _num(received)}
        t0 = time.perf_counter()
        graphs.run("ep_exchange", self.exchange.cell, self.exchange.inputs)[0].asnumpy()
        took = time.perf_counter() - t0
        rows = gather_rows([took, sent, received, step_time], self.groups.world)
        share = [min(1.0, float(r[0] / r[3])) if r[3] > 0 else 0.0 for r in rows]
        self.last = {
            "ep_exchange_s": took,
            "ep_exchange_share": share[self.groups.rank],
            "ep_exchange_s_ranks": [float(r[0]) for r in rows],
            "ep_exchange_share_ranks": share,
            "ep_tokens_sent_ranks": [float(r[1]) for r in rows],
            "ep_tokens_received_ranks": [_num(r[2]) for r in rows],
        }
        return {**self.last, "ep_tokens_sent": sent, "ep_tokens_received": _num(received)}


class CompiledEP(EPTraffic):
    """The split model and the graph cells of a compiled expert-parallel step."""

    def __init__(self, built, cfg, runtime, log: Callable[[str], None]):
        from mindloom_parallel import GradReducer, is_expert_param

        from mindloom_train import _step

        g, pcfg = runtime.groups, runtime.pcfg
        self.groups, self.pcfg, self.mcfg, self.cfg = g, pcfg, built.mcfg, cfg
        self.tp = g.tp
        params = self._split(built.model)
        self.names = [p.name for p in params]
        self.expert_names = [n for n in self.names if is_expert_param(n)]
        self.built = dataclasses.replace(built, params=params)
        dense = [p for p in params if not is_expert_param(p.name)]
        self._reducers(params, dense)
        self.params = params
        self.train_step = None
        # ZeRO-1: dense AdamW state over dp, expert state over the expert-data-parallel
        # group (with dp == ep: this rank alone, so no replica of it anywhere)
        self.zero = None
        if pcfg.zero_stage == 1:
            from mindloom_parallel import EPZeroShardUpdate

            flags = _step.decay_flags(params, cfg.optimizer.decay_embeddings)
            self.zero = EPZeroShardUpdate(params, g.dp, self.edp, flags, pcfg.bucket_size_mb)
        # the exchange in a graph of its own (see exchange_fields), and the step's whole
        # communication (the exchange + the dense buckets) for the runner's comm_probe
        EPTraffic.__init__(self, built.mcfg, pcfg, g, self.ep, self.edp, built.model,
                           cfg.training.micro_batch_size, cfg.train_dataset.seq_length,
                           cfg.grad_accum_steps)  # fmt: skip
        probe_dp = GradReducer(dense, g.dp, pcfg.bucket_size_mb, mean=True)
        self.comm_probe = StepCommProbe(self.exchange, probe_dp)
        self.comm_inputs = self.exchange.inputs + tuple(
            ms.Tensor(np.zeros(p.shape, np.float32)) for p in dense
        )
        self.ep_index = self.ep.index
        self._log_layout(params, log)

    def _split(self, model) -> list:
        """The model split in place: by `deepseek_tp_plan` over tp (when tp > 1), its routed
        experts over the ep group; its trainable parameters after."""
        from mindloom_model import deepseek_tp_plan
        from mindloom_parallel import (
            expert_parallel,
            init_expert_groups,
            parallelize_deepseek_graph,
            tp_param_names,
        )

        g, pcfg = self.groups, self.pcfg
        if self.tp.size > 1:
            parallelize_deepseek_graph(model, pcfg, g)
            model.set_train(True)  # the cells the split added start in inference mode
        self.ep, self.edp = init_expert_groups(g.rank, pcfg)
        expert_parallel(model, self.ep)
        plan = deepseek_tp_plan(self.mcfg.first_k_dense_replace)
        # name -> the axis its tp shards split (none under tp = 1: nothing was split)
        self.tp_axis = {} if self.tp.size == 1 else {
            **{n: 0 for n in tp_param_names(model, plan, ("colwise",))},
            **{n: 1 for n in tp_param_names(model, plan, ("rowwise",))},
        }  # fmt: skip
        self._partial = set(tp_param_names(model, plan, ("partial_grad",)))
        return list(model.trainable_params())

    def _reducers(self, params: list, dense: list) -> None:
        """The gradient, loss, evaluation and norm reducers of the step."""
        from mindloom_parallel import (
            EPGradReducer,
            EPNormSquare,
            GradReducer,
            TPEPNormSquare,
            TPGradReducer,
            is_expert_param,
        )

        from mindloom_train import _step

        g, pcfg, names = self.groups, self.pcfg, self.names
        dp_red = GradReducer(dense, g.dp, pcfg.bucket_size_mb, mean=True)
        self.grad_reducer = EPGradReducer(names, pcfg.dp, self.edp, dp_red)
        self.loss_reducer = _step.MeanOver(g.dp.name, g.dp.size)
        self.eval_reducer = _step.MeanOver(g.dp.name, g.dp.size)
        self.norm_reducer = EPNormSquare(names, self.ep)
        if self.tp.size == 1:
            return
        self.grad_reducer = TPGradReducer(params, names, g, False, self.grad_reducer,
                                          partial=tuple(n in self._partial for n in names))  # fmt: skip
        self.norm_reducer = TPEPNormSquare([n in self.tp_axis for n in names],
                                           [is_expert_param(n) for n in names], self.tp, self.ep)  # fmt: skip
        # the loss is the same on every tp rank: a world mean is the data-parallel mean
        # and carries every rank's stop flags (see _runner._encode_flags)
        self.loss_reducer = _step.MeanOver(g.world.name, g.world.size)
        self.eval_reducer = _step.MeanOver(g.world.name, g.world.size)

    def _log_layout(self, params: list, log: Callable[[str], None]) -> None:
        from mindloom_parallel import is_expert_param

        g, pcfg = self.groups, self.pcfg
        n_exp = sum(int(np.prod(p.shape)) for p in params if is_expert_param(p.name))
        tp = ""
        if self.tp.size > 1:
            tp = (f"; tensor parallel tp={self.tp.size} (deepseek_tp_plan: {len(self.tp_axis)} "
                  f"tensors split, vocabulary and routed experts whole)")  # fmt: skip
        log(f"parallel: {g.describe()}; expert parallel ep={pcfg.ep} (ep rank {self.ep.index}, "
            f"experts {self._block()}), expert-data-parallel {self.edp.size}{tp}; "
            f"{len(params)} local tensors, {n_exp / 1e6:.3f}M expert values here")  # fmt: skip
        if self.zero is not None:
            z = self.zero
            log(f"parallel: ZeRO-1 under expert parallel: AdamW state for "
                f"{z.dense.state_values} dense + {z.expert.state_values} expert of this "
                f"rank's {sum(z.sizes)} values ({8 * z.state_values / 2**20:.2f} MiB; dense "
                f"over dp={pcfg.dp}, expert blocks over expert-data-parallel "
                f"{self.edp.size})")  # fmt: skip

    def _block(self) -> str:
        from mindloom_parallel import expert_block

        start, count = expert_block(self.mcfg.n_routed_experts, self.pcfg.ep, self.ep.index)
        return f"{start}-{start + count - 1}"

    def attach(self, train_step) -> None:
        self.train_step = train_step

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_metadata(self) -> dict:
        """metadata.json's record of the split: `expert_parallel` (which ep rank held which
        experts), and under tp `tensor_parallel`."""
        from mindloom_parallel import expert_metadata

        meta = {"expert_parallel": expert_metadata(self.mcfg, self.pcfg)}
        if self.tp.size > 1:
            meta["tensor_parallel"] = {"tp": self.tp.size, "plan": "deepseek_tp_plan",
                                       "tensors": "split ones as chunks at their tp offset"}  # fmt: skip
        return meta

    def layout_state(self, buffers: list):
        """This rank's tensors for the distributed checkpoint (`_ckpt_moe`): the weights
        with their moments (the step's, or under ZeRO-1 the ones this rank owns), then the
        routers' biases."""
        from mindloom_parallel import expert_block, is_expert_param

        from mindloom_train._ckpt_moe import MoELayoutState, MoESplit

        e, tp = self.mcfg.n_routed_experts, self.tp.size
        if self.zero is None:
            ts = self.train_step
            moments = list(zip(ts.exp_avg, ts.exp_avg_sq))
        else:
            held = dict(zip(self.zero.owned, zip(self.zero.exp_avg, self.zero.exp_avg_sq)))
            moments = [held.get(i) for i in range(len(self.params))]
        tensors = [(n, p, m) for n, p, m in zip(self.names, self.params, moments)]
        tensors += [(b.name, b, None) for b in buffers]
        shapes = {}
        for name, p, _ in tensors:
            shape = list(p.shape)
            if is_expert_param(name):
                shape[0] = e
            if name in self.tp_axis:
                shape[self.tp_axis[name]] *= tp
            shapes[name] = tuple(shape)
        start, count = expert_block(e, self.pcfg.ep, self.ep.index)
        split = MoESplit(self.tp_axis, self.tp.index, tp, start, count, self.pcfg.ep,
                         self.edp.index == 0, zero=self.zero is not None)  # fmt: skip
        return MoELayoutState(self.groups, tensors, shapes, set(self.names), split)

    # ------------------------------------------------------------------ metrics

    def global_sizes(self, sizes: list[int]) -> list[int]:
        """Per local tensor (the step's order), its values in the whole model."""
        from mindloom_parallel import is_expert_param

        return [n * self.pcfg.ep if is_expert_param(name) else n
                for name, n in zip(self.names, sizes)]  # fmt: skip

    def combine_numerics(self, rows: np.ndarray) -> np.ndarray:
        """TrainStep's numerics rows [tensors, 5] of this rank -> the whole tensors' (host,
        collective over the ep group): an expert block's squared norms (gradient, weight,
        update) summed over the ep ranks, its mean |m| and mean sqrt(v) averaged (equal
        blocks); the dense rows are the same on every rank and kept."""
        from mindloom_parallel import gather_rows, is_expert_param

        rows = np.asarray(rows, np.float32)
        every = gather_rows(rows.reshape(-1), self.ep).reshape(self.ep.size, *rows.shape)
        expert = np.array([is_expert_param(n) for n in self.names])
        out = rows.astype(np.float64)
        out[expert, :3] = every[:, expert, :3].astype(np.float64).sum(0)
        out[expert, 3:] = every[:, expert, 3:].astype(np.float64).mean(0)
        return out


def _num(v) -> float | None:
    """metrics.jsonl holds no NaN: an unknown count is null."""
    v = float(v)
    return None if np.isnan(v) else v


class _ExchangeCell(nn.Cell):
    def __init__(self, ep_group, reps: int, d: int):
        super().__init__()
        from mindloom_parallel import GatherSeqGraph, ReduceScatterSeqGraph

        self.gather = GatherSeqGraph(ep_group)
        self.scatter = ReduceScatterSeqGraph(ep_group)
        self.reps, self.d = reps, d

    def construct(self, bufs):
        rows, out = bufs[0], bufs[1]
        for _ in range(self.reps):  # chained, as the layers run one after another
            big = self.gather(rows)  # the dispatch [1, ep N, D + 2k]
            out = self.scatter(big[:, :, : self.d])  # the combine [1, N, D]
            dy = self.gather(out)  # the combine's backward
            rows = ops.depend(self.scatter(big), dy)  # the dispatch's backward
        return rows, out


class ExchangeProbe:
    """The step's expert-parallel exchange in a graph of its own: per micro-batch and MoE
    layer, the same cells on the same bytes as the step, forward (gather of the [N, D + 2k]
    rows, the combine's all-reduce of [ep N, D]) and backward (the reduce-scatter of the
    rows' gradient, the all-gather of the output gradient)."""

    def __init__(self, ep_group, model, micro_batch_size: int, seq_length: int, accum: int):
        cfg = model.config
        n, d, k = micro_batch_size * seq_length, cfg.hidden_size, cfg.num_experts_per_tok
        routers = sum(1 for layer in model.layers if layer.is_moe) + sum(
            1 for m in model.mtp if m.block.is_moe
        )
        self.cell = _ExchangeCell(ep_group, accum * routers, d)
        self.inputs = (ms.Tensor(np.zeros((1, n, d + 2 * k), np.float32)),
                       ms.Tensor(np.zeros((1, n, d), np.float32)))  # fmt: skip


class StepCommProbe(nn.Cell):
    """The runner's `comm_probe`: the exchange, then the dense data-parallel buckets."""

    def __init__(self, exchange: ExchangeProbe, dp_reducer):
        super().__init__()
        self.exchange = exchange.cell
        self.dp = dp_reducer

    def construct(self, bufs):
        a = self.exchange(bufs[:2])
        return a + self.dp(bufs[2:])
