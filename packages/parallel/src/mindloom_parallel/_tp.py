"""Tensor and sequence parallelism applied from outside a ``mindloom_model.Llama``.

The model keeps every projection as a small ``Linear`` attribute and reads its head
counts from the attention instance, so TP is attribute assignment (torchtitan-style),
driven by the plan ``mindloom_model.llama_tp_plan()`` ({module path pattern: style}):

- ``wq/wk/wv`` and ``w1/w3``, ``lm_head``: column-parallel, each rank keeps a block of
  output rows (whole heads for attention, so GQA's head grouping stays local);
- ``wo`` and ``w2``: row-parallel, each rank keeps a block of input columns and the
  partial outputs are summed by the region's exit op;
- ``embed``: vocab-parallel, rows ``[r*V/tp, (r+1)*V/tp)``; ids outside are zeroed and
  the partial embeddings summed; the loss is the vocab-parallel cross-entropy below;
- the region entry sits on the norm in front of each region (``attn_norm``, ``mlp_norm``,
  ``norm``), so one collective serves q, k and v (or w1 and w3).

Without sequence parallel the entry is Megatron's *f* (identity forward, all-reduce
backward) and the exit *g* (all-reduce forward, identity backward). With sequence
parallel the residual stream between regions is split along the sequence: the entry is
an all-gather and the exit a reduce-scatter (and back in backward), so norms, dropout and
the residual adds run on S/tp tokens, and the norm weights' gradients are partial sums
that ``ParallelEngine`` all-reduces over the TP group.
"""

from __future__ import annotations

import fnmatch

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindloom_parallel._comm import (
    CopyToTP,
    GatherSeq,
    Group,
    ReduceFromTP,
    ReduceScatterSeq,
    all_reduce_max,
)

__all__ = [
    "VocabParallelLossSum",
    "gather_tp_shards",
    "parallelize_deepseek",
    "parallelize_llama",
    "tp_param_names",
    "vocab_start",
]


def _rows(p: Parameter, r: int, n: int):
    w = p.asnumpy()
    k = w.shape[0] // n
    return w[r * k : (r + 1) * k].copy()


def _cols(p: Parameter, r: int, n: int):
    w = p.asnumpy()
    k = w.shape[1] // n
    return w[:, r * k : (r + 1) * k].copy()


def _linear_like(orig, weight, lin_cls):
    out_f, in_f = weight.shape
    return lin_cls(in_f, out_f, weight, orig.weight.dtype, orig.compute_dtype)


class _EnterNorm(nn.Cell):
    """The model's norm, then the TP region entry (f, or the sequence all-gather)."""

    def __init__(self, norm: nn.Cell, enter: nn.Cell):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        # the model's own normalization code, so the maths is exactly the model's
        self._norm = type(norm).construct
        self.enter = enter

    def construct(self, x):
        return self.enter(self._norm(self, x))


class _EnterMLP(nn.Cell):
    """The model's MLP (its w1 / w3 / w2, replaced by the plan's column and row blocks),
    after the TP region entry: the region is this MLP alone."""

    def __init__(self, mlp: nn.Cell, enter: nn.Cell):
        super().__init__()
        self.w1, self.w2, self.w3 = mlp.w1, mlp.w2, mlp.w3
        self.kernel = mlp.kernel
        self._mlp = type(mlp).construct
        self.enter = enter

    def construct(self, x):
        return self._mlp(self, self.enter(x))


class _RowParallel(nn.Cell):
    """The model's Linear on a column block of its weight, then the region exit."""

    def __init__(self, orig, weight, exit_op: nn.Cell):
        super().__init__()
        out_f, in_f = weight.shape
        self.in_features = in_f
        self.out_features = out_f
        self.compute_dtype = orig.compute_dtype
        self.weight = Parameter(Tensor(weight, orig.weight.dtype), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)
        self._linear = type(orig).construct
        self.exit = exit_op

    def construct(self, x):
        return self.exit(self._linear(self, x))


class _VocabParallelEmbedding(nn.Cell):
    """Rows [start, start + V/tp) of the table; other ids give zeros, summed by the exit."""

    def __init__(self, orig, weight, start: int, exit_op: nn.Cell):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.vocab_start = start
        self.compute_dtype = orig.compute_dtype
        self.weight = Parameter(Tensor(weight, orig.weight.dtype), name="weight")
        self.exit = exit_op

    def construct(self, tokens):
        local = tokens - self.vocab_start
        inside = ops.logical_and(local >= 0, local < self.num_embeddings)
        local = ops.clip_by_value(local, 0, self.num_embeddings - 1)
        x = ops.gather(self.weight, local, 0).astype(self.compute_dtype)
        x = x * inside.expand_dims(-1).astype(x.dtype)
        return self.exit(x)


def vocab_start(model_cfg, tp: Group) -> int:
    """The first vocabulary id of this TP rank's block of the embedding and the logits."""
    return tp.index * (model_cfg.vocab_size // tp.size)


def parallelize_llama(model, pcfg, groups, plan: dict[str, str] | None = None, regions=None):
    """Split ``model`` (a ``mindloom_model.Llama``) in place for ``groups.tp``; returns it.

    ``plan``: {module path pattern: style}, by default ``mindloom_model.llama_tp_plan()``;
    each module whose path matches is replaced (or, for ``local_heads``, adjusted) as its
    style says. Nothing is stored on the model: the vocabulary block of a rank is
    ``vocab_start(model.config, groups.tp)``. ``regions``: an (entry, exit) pair of
    factories of the region cells; None: the engine's (PyNative, timed) ones below
    (``_tp_graph.parallelize_llama_graph`` passes its compiled ones).

    Every rank must pass an identically initialized model (same seed): each keeps its own
    shard of the full weights. ``tp == 1`` leaves the model untouched. Parameter names
    stay the module paths (``layers.0.attn.wq.weight``), now naming local shards; their
    global shapes and split axes are in ``mindloom_parallel.tensor_layout``.
    """
    tp: Group = groups.tp
    if tp.size == 1 or isinstance(model.embed, _VocabParallelEmbedding):  # nothing to do, or done
        return model
    if plan is None:
        from mindloom_model import llama_tp_plan

        plan = llama_tp_plan()
    return _apply_plan(model, plan, tp, bool(pcfg.sequence_parallel), regions)


def parallelize_deepseek(model, pcfg, groups, regions=None):
    """Split a ``mindloom_model.DeepseekV3`` in place for ``groups.tp`` by
    ``mindloom_model.deepseek_tp_plan``: MLA over heads, dense and shared-expert MLPs over
    their width, routed experts, router, vocabulary and MTP projection whole on each rank
    (expert_tp = 1; the routed experts split over ep instead). Sequence parallel is not
    built for this family. The ``partial_grad`` tensors (``tp_param_names``) need
    their gradients summed over tp before the update. Returns the model."""
    from mindloom_model import deepseek_tp_plan

    tp: Group = groups.tp
    if pcfg.sequence_parallel:
        raise ValueError("sequence parallel is not built for family deepseek_v3 (tp only)")
    if tp.size == 1 or model.layers[0].attn.n_heads != model.config.num_heads:  # or done
        return model
    return _apply_plan(model, deepseek_tp_plan(model.config.first_k_dense_replace), tp,
                       False, regions)  # fmt: skip


def _apply_plan(model, plan: dict[str, str], tp: Group, sp: bool, regions):
    n, r = tp.size, tp.index
    lin_cls = type(model.layers[0].attn.wo)
    start = vocab_start(model.config, tp)

    def enter():
        if regions is not None:
            return regions[0]()
        return GatherSeq(tp) if sp else CopyToTP(tp)

    def exit_():
        if regions is not None:
            return regions[1]()
        return ReduceScatterSeq(tp) if sp else ReduceFromTP(tp)

    def apply(style: str, cell):
        if style == "colwise":
            return _linear_like(cell, _rows(cell.weight, r, n), lin_cls)
        if style == "rowwise":
            return _RowParallel(cell, _cols(cell.weight, r, n), exit_())
        if style == "vocab":
            return _VocabParallelEmbedding(cell, _rows(cell.weight, r, n), start, exit_())
        if style == "region_entry":
            return _EnterNorm(cell, enter())
        if style == "mlp_entry":
            return _EnterMLP(cell, enter())
        if style == "local_heads":
            if hasattr(cell, "split_heads"):  # MLA: its fused path's gathers follow the heads
                cell.split_heads(n)
                return None
            cell.n_heads = cell.n_heads // n
            if hasattr(cell, "n_kv_heads"):  # MLA has one latent, no kv heads
                cell.n_kv_heads = cell.n_kv_heads // n
            return None  # adjusted in place
        if style == "partial_grad":
            return None  # whole on every rank; the gradient reducer sums it over tp
        raise ValueError(f"tensor-parallel plan: unknown style {style!r}")

    for path, cell in list(model.cells_and_names()):
        style = next((st for pat, st in plan.items() if fnmatch.fnmatchcase(path, pat)), None)
        if style is None or not path:
            continue
        new = apply(style, cell)
        if new is not None:
            # a child of a replaced cell is found again under the replacement (same names)
            parent, _, attr = path.rpartition(".")
            setattr(model.get_sub_cell(parent) if parent else model, attr, new)
    _rename(model)
    return model


def tp_param_names(model, plan: dict[str, str], styles: tuple[str, ...]) -> list[str]:
    """The parameters of the modules ``plan`` gives one of ``styles``: ("partial_grad",)
    the whole tensors whose gradients are partial sums over the tp ranks; ("colwise",
    "rowwise", "vocab") the split ones."""
    mods = [pat for pat, st in plan.items() if st in styles]
    return [
        name
        for name, _ in model.parameters_and_names()
        if any(fnmatch.fnmatchcase(name.rsplit(".", 1)[0], pat) for pat in mods)
    ]


def gather_tp_shards(arrays: dict, axes: dict[str, int], tp: Group) -> dict:
    """Host side, collective over ``tp``: each array whose key is in ``axes`` (its split
    axis) concatenated over the tp ranks in group order, i.e. the global tensor;
    checkpoint keys of moments (``exp_avg.<name>``) are matched by their parameter name.
    Arrays of unsplit tensors are left out."""
    from mindloom_parallel._comm import all_gather

    out = {}
    for key in sorted(arrays):
        axis = axes.get(_param_of(key))
        if axis is not None:
            out[key] = all_gather(Tensor(arrays[key]), tp, axis, timed=False).asnumpy()
    return out


def slice_tp_shards(arrays: dict, axes: dict[str, int], index: int, size: int) -> dict:
    """``gather_tp_shards``' inverse for one rank: each array whose key is in ``axes`` (moment
    keys matched by their parameter name) cut to block ``index`` of ``size`` on its split
    axis; the others as they are. A tensor the axis cannot split is a ValueError naming it."""
    out = {}
    for key, arr in arrays.items():
        axis = axes.get(_param_of(key))
        if axis is not None and size > 1:
            if arr.ndim <= axis or arr.shape[axis] % size:
                raise ValueError(f"tensor {key!r} has shape {list(arr.shape)}, which tp = "
                                 f"{size} cannot split on axis {axis}")  # fmt: skip
            k = arr.shape[axis] // size
            arr = np.ascontiguousarray(np.take(arr, range(index * k, (index + 1) * k), axis))
        out[key] = arr
    return out


def _param_of(key: str) -> str:
    """The parameter name of a checkpoint key (``exp_avg.<name>`` -> ``<name>``)."""
    head, _, rest = key.partition(".")
    return rest if head in ("exp_avg", "exp_avg_sq") else key


def _rename(model) -> None:
    # a replaced cell's parameters keep short names ("weight"); graph mode wants them unique
    for name, p in model.parameters_and_names():
        p.name = name


class VocabParallelNLL(nn.Cell):
    """Per-token -log p(label) from local-vocab logits [N, V/tp] shifted by a per-row
    constant that is the same on every TP rank; `sum_exp` and `target` sum over the tp
    group (the engine's region cells or the compiled graph's). A label outside this rank's
    slice contributes 0 to the target sum here and its value on the owning rank."""

    def __init__(self, vocab_start: int, sum_exp: nn.Cell, target: nn.Cell):
        super().__init__()
        self.vocab_start = vocab_start
        self.sum_exp = sum_exp
        self.target = target

    def construct(self, shifted, labels):
        v = shifted.shape[-1]
        sum_exp = self.sum_exp(ops.exp(shifted).sum(-1))
        local = labels.reshape(-1).astype(ms.int32) - self.vocab_start
        inside = ops.logical_and(local >= 0, local < v).astype(ms.float32)
        local = ops.clip_by_value(local, 0, v - 1)
        tgt = ops.gather_elements(shifted, 1, local.reshape(-1, 1)).reshape(-1) * inside
        return ops.log(sum_exp) - self.target(tgt)


class VocabParallelLossSum(nn.Cell):
    """sum(nll * loss_mask) over local-vocab logits [B, S, V/tp] (fp32); the same on every
    TP rank. With tp == 1 it is the ordinary cross-entropy sum.
    """

    def __init__(self, group: Group, vocab_start: int):
        super().__init__()
        self.group = group
        self.nll = VocabParallelNLL(vocab_start, ReduceFromTP(group), ReduceFromTP(group))

    def construct(self, logits, labels, loss_mask):
        v = logits.shape[-1]
        flat = logits.reshape(-1, v).astype(ms.float32)
        # any per-row constant stabilizes the exp; the global max is the usual choice
        row_max = ops.stop_gradient(all_reduce_max(ops.amax(flat, -1, keepdims=True), self.group))
        nll = self.nll(flat - row_max, labels)
        return (nll * loss_mask.reshape(-1).astype(ms.float32)).sum()


def tp_replicated_names(model) -> list[str]:
    """Parameters every TP rank holds whole (the norm weights)."""
    return [n for n, _ in model.parameters_and_names() if n.endswith("norm.weight")]
