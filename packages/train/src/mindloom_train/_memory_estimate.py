"""The estimate itself (`_memory`): per-rank bytes for the most-loaded rank of a layout,
the verdict against the device, and what would make a run fit."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from mindloom_model import cpu_kernels_buildable

from mindloom_train._memory_activations import (
    cpu_graph_intermediates,
    cpu_kernel_graph_intermediates,
    deepseek_blocks,
    layer_activation_bytes,
    llama_block,
)
from mindloom_train._memory_advice import _suggestions
from mindloom_train._memory_devices import (
    _BYTES,
    COMPILE_CPU_FIXED,
    COMPILE_CPU_KERNELS_FIXED,
    COMPILE_CPU_KERNELS_PER_LAYER,
    COMPILE_CPU_PER_LAYER,
    FRAGMENTATION_SHARE,
    RUNTIME_CPU_BYTES,
    RUNTIME_CPU_MSRUN_EXTRA,
    RUNTIME_GPU_BYTES,
    MiB,
    Policy,
    _cfg_error,
    resolve_device,
)
from mindloom_train._memory_params import _expert_split, _stage_param_sizes

# ---------------------------------------------------------------------------------------
# the estimate


@dataclass
class Estimate:
    components: dict[str, int]  # bytes per rank, most-loaded rank
    total: int
    usable: int
    device: str
    device_note: str
    layout: dict[str, Any]
    per_layer_activation: int
    stage_activations: list[int]  # per pipeline stage
    stage_totals: list[int]
    notes: list[str] = field(default_factory=list)
    suggestions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def verdict(self) -> str:
        return "fits" if self.fits else "does not fit"

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["verdict"] = self.verdict
        d["fits"] = self.fits
        return d


def _model_config(cfg, vocab_size: int | None):
    """ModelConfig of the run (any family: the estimate covers deepseek_v3 too)."""
    from mindloom_model import ModelConfig, get_preset

    from mindloom_train._modelcfg import _DTYPE, _RECOMPUTE, _overrides

    if vocab_size is None and cfg.model.get("vocab_size") is None:
        vocab_size = _tokenizer_vocab(cfg)
    over = _overrides(cfg.model, vocab_size, cfg.train_dataset.seq_length)
    over["compute_dtype"] = _DTYPE[cfg.precision.compute_dtype]
    if cfg.recompute.mode != "none":
        over["recompute"] = _RECOMPUTE[cfg.recompute.mode]
        over["recompute_layers"] = list(cfg.recompute.layers)
    try:
        preset = cfg.model.get("preset")
        return get_preset(preset, **over) if preset else ModelConfig(**over)
    except (ValueError, TypeError) as exc:
        raise _cfg_error(f"config key model: {exc}") from None


def _tokenizer_vocab(cfg) -> int | None:
    """The vocabulary of the run's tokenizer: the one at tokenizer.path when it is there,
    else the size the run would train (tokenizer.vocab_size; null: the preset's)."""
    path = cfg.tokenizer.path
    if path and os.path.isdir(path):
        try:
            from mindloom_tokenizer import Tokenizer

            return Tokenizer.load(path).vocab_size
        except Exception:  # an unreadable tokenizer is the run's error to report, not ours
            pass
    return cfg.tokenizer.vocab_size


def _zero_max_share(sizes: list[int], dp: int, even: bool) -> int:
    if dp <= 1:
        return sum(sizes)
    if even:
        return math.ceil(sum(sizes) / dp)
    from mindloom_parallel import zero_owners

    load = [0] * dp
    for size, owner in zip(sizes, zero_owners(sizes, dp)):
        load[owner] += size
    return max(load)


def _static_bytes(sizes, policy: Policy, dp, zero, accum_micro, expert: int = 0,
                  edp: int = 1) -> dict[str, float]:  # fmt: skip
    """`expert`: the values of `sizes` that are this rank's routed expert blocks (expert
    parallel), whose ZeRO-1 state splits over the expert-data-parallel group `edp`."""
    n = sum(sizes)
    shard = _zero_max_share(sizes, dp, policy.even_shards) if zero else n
    if zero and expert:  # dense over dp, the expert blocks over edp (an even split)
        shard = _zero_max_share([n - expert], dp, True) + _zero_max_share([expert], edp, True)
    per = {"parameters": policy.param, "gradients": policy.grad, "master weights": policy.master,
           "optimizer states": policy.moments}  # fmt: skip
    key = {"parameters": "params", "gradients": "grads", "master weights": "master",
           "optimizer states": "moments"}  # fmt: skip
    out = {name: (shard if key[name] in policy.sharded else n) * b for name, b in per.items()}
    out["gradients"] += (n * policy.accum) if accum_micro > 1 else 0
    return out


@dataclass(frozen=True)
class _Layout:
    """The degrees the estimate uses (one process: everything 1) and the micro-batches
    alive at once."""

    world: int
    dp: int
    tp: int
    pp: int
    zero: bool
    sp: bool
    micro: int
    engine: bool  # the PyNative engine's step (tp, pp or ZeRO-1) rather than the compiled one
    ep: int = 1  # expert parallel: each rank holds E/ep routed experts


def _layout(cfg, mcfg, nproc: int | None) -> _Layout:
    p = cfg.parallelism
    world = nproc or cfg.world_size
    if world == 1:
        dp = tp = pp = ep = 1  # one process trains the whole model (parallelism needs msrun)
        zero, sp = False, False
    else:
        dp, tp, pp, zero, sp = p.dp, p.tp, p.pp, p.zero_stage == 1, p.sequence_parallel
        ep = p.ep
        if dp * tp * pp != world:
            raise _cfg_error(
                f"config parallelism: dp*tp*pp = {dp * tp * pp} does not match {world} ranks"
            )
    if mcfg.num_layers % pp:
        raise _cfg_error(f"config parallelism: pp={pp} does not divide {mcfg.num_layers} layers")
    if ep > 1 and (dp % ep or mcfg.n_routed_experts % ep):
        raise _cfg_error(f"config parallelism: ep={ep} must divide dp={dp} and the "
                         f"{mcfg.n_routed_experts} routed experts")  # fmt: skip
    engine = world > 1 and (tp > 1 or pp > 1 or zero)
    if engine and pp == 1 and cfg.context.mode == "graph":
        engine = False  # tp, tp + ZeRO-1, dp + ZeRO-1: compiled steps (_tp_step, _zero_step)
    micro = p.micro_batch_num if (p.micro_batch_num > 1 or pp > 1) else cfg.grad_accum_steps
    if not engine:
        micro = cfg.grad_accum_steps
    return _Layout(world, dp, tp, pp, zero, sp, micro, engine, ep)


@dataclass(frozen=True)
class _Activations:
    """What one stage's activation bytes depend on."""

    mcfg: Any
    lay: _Layout
    b: int  # micro-batch size
    s: int  # sequence length
    c: int  # bytes of the compute dtype
    inv_dense: list
    inv_moe: list
    recomputed: frozenset
    cpu_graph: bool  # MindSpore's CPU backend, compiled step (one process or plain dp)
    kernels: bool = False  # with the fused CPU kernels (model.kernels: auto, fp32)

    def stage(self, st: int) -> tuple[float, int]:
        """(activation bytes, micro-batches in flight) of pipeline stage `st`."""
        from mindloom_parallel import stage_layers

        mcfg, lay, b, s, c = self.mcfg, self.lay, self.b, self.s, self.c
        layers = stage_layers(mcfg.num_layers, lay.pp, st)
        in_flight = min(lay.pp - st, lay.micro) if lay.pp > 1 else 1
        act = 0.0
        recompute_work = 0.0
        for i in layers:
            moe = mcfg.family != "llama" and i >= mcfg.first_k_dense_replace
            inv = self.inv_moe if moe else self.inv_dense
            full = layer_activation_bytes(inv, b, s, lay.tp, lay.sp)
            if i in self.recomputed and self.cpu_graph:
                # the CPU graph keeps every intermediate to the step's end: a recomputed
                # layer's forward is kept twice, nothing is freed (Llama: op outputs below)
                act += 2 * full
            elif i in self.recomputed:
                act += layer_activation_bytes(inv, b, s, lay.tp, lay.sp, "full")
                recompute_work = max(recompute_work, full)  # rebuilt one layer at a time
            else:
                act += full
        # the [B, 1, S, S] fp32 attention bias (segment ids: one per sample) and its masks
        mask = 6 * b * s * s
        act = act * in_flight + mask + recompute_work
        if st == lay.pp - 1:
            # final norm (fp32 copy + head input), fp32 logits, the loss's exp (kept for its
            # backward) and the gradient of the logits; a 16-bit head adds its own output
            # (DeepSeek-V3 keeps the vocabulary whole under tp: deepseek_tp_plan)
            n_tok = b * s
            v_local = mcfg.vocab_size / (lay.tp if mcfg.family == "llama" else 1)
            depths = 1 + (mcfg.num_nextn_predict_layers if mcfg.family != "llama" else 0)
            head = n_tok * mcfg.hidden_size * (4 + c) + 3 * 4 * n_tok * v_local
            if c != 4:
                head += c * n_tok * v_local
            act += head * depths
        # backward transient: the gradient of a layer's largest saved tensor, twice
        largest = max(x.bytes(b, s, lay.tp, lay.sp) for x in self.inv_dense + self.inv_moe)
        act += 2 * largest
        if self.kernels:  # implies the Llama CPU graph (see estimate)
            layer, head = cpu_kernel_graph_intermediates(mcfg, b, s)
            act = layer * len(layers) + head
        elif self.cpu_graph and mcfg.family == "llama":
            act = mask
            for i in layers:
                act += cpu_graph_intermediates(mcfg, b, s, i in self.recomputed)[0]
            act += cpu_graph_intermediates(mcfg, b, s, False)[1]
        return act, in_flight


def _communication(cfg, mcfg, lay: _Layout, sizes, policy: Policy, act, in_flight, n_tok, c):
    """Communication buffers: what lives during the backward (TP region all-reduces,
    pipeline send/recv) adds to the activations; what lives at the optimizer step, after
    the backward freed the activations (the gradient buckets' concatenation and its
    all-reduced copy; ZeRO-1's flat vector of the owners' new values and its all-reduce),
    counts only where it exceeds them."""
    comm = 0.0
    if lay.tp > 1:
        comm += 2 * n_tok * mcfg.hidden_size * c
    if lay.pp > 1:
        comm += 2 * in_flight * n_tok * mcfg.hidden_size * c
    step_comm = 0.0
    if lay.dp > 1:
        step_comm += 2 * min(cfg.parallelism.bucket_size_mb * MiB, sum(sizes) * policy.grad)
    if lay.zero and lay.dp > 1:
        step_comm = max(step_comm, 2 * sum(sizes) * policy.param)
    return comm + max(0.0, step_comm - act)


def _layout_json(lay: _Layout, b: int, s: int, mcfg, recomputed, worst: int, cdt: str) -> dict:
    """The estimate's `layout`: what it assumed about the run."""
    return {
        "world": lay.world, "dp": lay.dp, "tp": lay.tp, "pp": lay.pp,
        "zero_stage": int(lay.zero), "sequence_parallel": lay.sp, "ep": lay.ep,
        "micro_batch_size": b, "seq_length": s, "micro_batches": lay.micro,
        "recompute": mcfg.recompute, "recompute_layers": sorted(recomputed),
        "most_loaded_stage": worst, "compute_dtype": cdt,
        "param_dtype": mcfg.param_dtype, "num_params": mcfg.num_params(),
        "family": mcfg.family,
    }  # fmt: skip


def _block_inventories(mcfg, c: int, notes: list[str]):
    """(dense block, MoE block, number of MoE layers): the per-layer activation inventories."""
    if mcfg.family == "llama":
        inv = llama_block(mcfg, c)
        return inv, inv, 0
    inv_dense, inv_moe = deepseek_blocks(mcfg, c)
    notes.append("deepseek_v3: per-stage parameters split evenly; MoE activations at even load")
    return inv_dense, inv_moe, mcfg.num_layers - mcfg.first_k_dense_replace


def _recomputed_layers(mcfg) -> set:
    if mcfg.recompute == "full":
        return set(range(mcfg.num_layers))
    if mcfg.recompute == "selected":
        return set(mcfg.recompute_layers)
    return set()


def _kernel_graph(mcfg, cdt: str, cpu_graph: bool) -> bool:
    """The compiled CPU step runs the fused kernels (use_cpu_kernels; measured for Llama)."""
    return (cpu_graph and mcfg.family == "llama" and mcfg.kernels == "auto"
            and cdt == "float32" and mcfg.param_dtype == "float32"
            and cpu_kernels_buildable())  # fmt: skip


def _default_runtime_bytes(is_cpu: bool, world: int) -> int:
    """The framework's own resident memory: the CPU process (more under msrun) or a device's."""
    if not is_cpu:
        return RUNTIME_GPU_BYTES
    return RUNTIME_CPU_BYTES + (RUNTIME_CPU_MSRUN_EXTRA if world > 1 else 0)


def _add_fixed(comps: dict, runtime_bytes: int, n_layers: int, cpu_graph: bool,
               pp_graphs: bool, kernels: bool = False) -> None:  # fmt: skip
    """A stage's fragmentation reserve, runtime and (CPU) graph compiler bytes."""
    comps["fragmentation reserve"] = FRAGMENTATION_SHARE * sum(comps.values())
    comps["runtime"] = runtime_bytes
    if kernels:  # implies cpu_graph
        comps["graph compiler"] = (COMPILE_CPU_KERNELS_FIXED
                                   + COMPILE_CPU_KERNELS_PER_LAYER * n_layers)  # fmt: skip
    elif cpu_graph:
        comps["graph compiler"] = COMPILE_CPU_FIXED + COMPILE_CPU_PER_LAYER * n_layers
    elif pp_graphs:
        comps["graph compiler"] = 2 * COMPILE_CPU_PER_LAYER * n_layers


def estimate(
    cfg,
    *,
    nproc: int | None = None,
    device: str | None = None,
    vocab_size: int | None = None,
    mcfg=None,
    runtime_bytes: int | None = None,
    ranks_per_host: int | None = None,
    suggest: bool = True,
) -> Estimate:
    """The per-rank estimate of `cfg` on `nproc` ranks (default: the layout's world)."""
    from mindloom_parallel import stage_layers

    if mcfg is None:
        mcfg = _model_config(cfg, vocab_size)
    lay = _layout(cfg, mcfg, nproc)
    dname, usable, ddesc, is_cpu = resolve_device(cfg, device, ranks_per_host or lay.world)
    notes: list[str] = []
    # compute dtype: the CPU backend has no 16-bit MatMul, the trainer computes in fp32
    cdt = mcfg.compute_dtype if not is_cpu else "float32"
    c = _BYTES[cdt]
    policy = Policy(param=_BYTES[mcfg.param_dtype], grad=_BYTES[mcfg.param_dtype])
    b, s = cfg.training.micro_batch_size, cfg.train_dataset.seq_length
    stages = _stage_param_sizes(mcfg, lay.tp, lay.pp)
    local_expert = _expert_split(mcfg, lay.ep, lay.pp, stages, notes)
    inv_dense, inv_moe, n_moe = _block_inventories(mcfg, c, notes)
    recomputed = _recomputed_layers(mcfg)
    cpu_graph = is_cpu and cfg.context.mode == "graph" and not lay.engine
    # pp in graph mode (_pp_step.compiled_pp, tp inside a stage included): the engine
    # runner's schedule over two compiled graphs per stage, the forward and the backward
    # (with its recomputed forward); each holds the stage's layers in the graph compiler
    # (pp2 debug: peaks 577 and 593 MiB against 569 estimated, 469 without this term)
    pp_graphs = is_cpu and lay.engine and lay.pp > 1 and cfg.context.mode == "graph"
    kernels = _kernel_graph(mcfg, cdt, cpu_graph)
    acts = _Activations(mcfg, lay, b, s, c, inv_dense, inv_moe, frozenset(recomputed), cpu_graph,
                        kernels)  # fmt: skip
    stage_act, stage_tot, comps_by_stage = [], [], []
    for st in range(lay.pp):
        act, in_flight = acts.stage(st)
        comps = _static_bytes(stages[st], policy, lay.dp, lay.zero, lay.micro,
                              local_expert[st], lay.dp // lay.ep)  # fmt: skip
        comps["activations"] = act
        comps["communication buffers"] = _communication(
            cfg, mcfg, lay, stages[st], policy, act, in_flight, b * s, c
        )
        comps_by_stage.append(comps)
        stage_act.append(int(act))
    if runtime_bytes is None:
        runtime_bytes = _default_runtime_bytes(is_cpu, lay.world)
    for st, comps in enumerate(comps_by_stage):
        n_layers = len(stage_layers(mcfg.num_layers, lay.pp, st))
        _add_fixed(comps, runtime_bytes, n_layers, cpu_graph, pp_graphs, kernels)
        stage_tot.append(int(sum(comps.values())))
    worst = max(range(lay.pp), key=lambda i: stage_tot[i])
    components = {k: int(v) for k, v in comps_by_stage[worst].items()}
    if is_cpu and cdt != mcfg.compute_dtype:
        notes.append(f"CPU: compute in float32 (no {mcfg.compute_dtype} MatMul)")
    if kernels:
        per_layer = cpu_kernel_graph_intermediates(mcfg, b, s)[0]
    else:
        per_layer = layer_activation_bytes(inv_moe if n_moe else inv_dense, b, s, lay.tp, lay.sp)
    est = Estimate(
        components=components,
        total=int(sum(components.values())),
        usable=int(usable),
        device=dname,
        device_note=ddesc,
        layout=_layout_json(lay, b, s, mcfg, recomputed, worst, cdt),
        per_layer_activation=int(per_layer),
        stage_activations=stage_act,
        stage_totals=stage_tot,
        notes=notes,
    )
    if suggest and not est.fits:
        est.suggestions = _suggestions(cfg, est, nproc=lay.world, device=device, mcfg=mcfg,
                                       runtime_bytes=runtime_bytes, ranks_per_host=ranks_per_host,
                                       estimate=estimate)  # fmt: skip
    return est
