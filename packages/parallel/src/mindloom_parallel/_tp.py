"""Tensor and sequence parallelism applied from outside a ``mindloom_model.Llama``.

The model keeps every projection as a small ``Linear`` attribute and reads its head
counts from the attention instance, so TP is attribute assignment (torchtitan-style):

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

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from mindloom_parallel._comm import (
    CopyToTP,
    GatherSeq,
    Group,
    ReduceFromTP,
    ReduceScatterSeq,
    all_reduce_max,
)

__all__ = ["parallelize_llama", "VocabParallelLossSum", "COLUMN_PARALLEL", "ROW_PARALLEL"]

COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3", "lm_head", "embed")  # split axis 0 (rows)
ROW_PARALLEL = ("wo", "w2")  # split axis 1 (columns)


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


def parallelize_llama(model, pcfg, groups):
    """Split ``model`` (a ``mindloom_model.Llama``) in place for ``groups.tp``; returns it.

    Every rank must pass an identically initialized model (same seed): each keeps its own
    shard of the full weights. ``tp == 1`` leaves the model untouched. Parameter names
    stay the module paths (``layers.0.attn.wq.weight``), now naming local shards; their
    global shapes and split axes are in ``mindloom_parallel.tensor_layout``.
    """
    if getattr(model, "_ml_tp", None) is not None:
        return model
    tp: Group = groups.tp
    n, r = tp.size, tp.index
    sp = bool(pcfg.sequence_parallel)
    cfg = model.config
    vocab_local = cfg.vocab_size // n
    model._ml_tp = {"group": tp, "vocab_start": r * vocab_local, "sp": sp}
    if n == 1:
        return model
    lin_cls = type(model.layers[0].attn.wq)

    def enter():
        return GatherSeq(tp) if sp else CopyToTP(tp)

    def exit_():
        return ReduceScatterSeq(tp) if sp else ReduceFromTP(tp)

    for layer in model.layers:
        a, m = layer.attn, layer.mlp
        layer.attn_norm = _EnterNorm(layer.attn_norm, enter())
        for name in ("wq", "wk", "wv"):
            orig = getattr(a, name)
            setattr(a, name, _linear_like(orig, _rows(orig.weight, r, n), lin_cls))
        a.wo = _RowParallel(a.wo, _cols(a.wo.weight, r, n), exit_())
        a.n_heads = a.n_heads // n
        a.n_kv_heads = a.n_kv_heads // n
        layer.mlp_norm = _EnterNorm(layer.mlp_norm, enter())
        for name in ("w1", "w3"):
            orig = getattr(m, name)
            setattr(m, name, _linear_like(orig, _rows(orig.weight, r, n), lin_cls))
        m.w2 = _RowParallel(m.w2, _cols(m.w2.weight, r, n), exit_())
    emb = model.embed
    model.embed = _VocabParallelEmbedding(emb, _rows(emb.weight, r, n), r * vocab_local, exit_())
    model.norm = _EnterNorm(model.norm, enter())
    if not cfg.tie_embeddings:
        # local logits [B, S, V/tp]; the head ties to model.embed's local rows when tied
        model.lm_head = _linear_like(model.lm_head, _rows(model.lm_head.weight, r, n), lin_cls)
    _rename(model)
    return model


def _rename(model) -> None:
    # a replaced cell's parameters keep short names ("weight"); graph mode wants them unique
    for name, p in model.parameters_and_names():
        p.name = name


class VocabParallelLossSum(nn.Cell):
    """sum(nll * loss_mask) over local-vocab logits [B, S, V/tp] (fp32); the same on every
    TP rank. With tp == 1 it is the ordinary cross-entropy sum.
    """

    def __init__(self, group: Group, vocab_start: int):
        super().__init__()
        self.group = group
        self.vocab_start = vocab_start
        self.sum_exp = ReduceFromTP(group)
        self.target = ReduceFromTP(group)

    def construct(self, logits, labels, loss_mask):
        v = logits.shape[-1]
        flat = logits.reshape(-1, v).astype(ms.float32)
        # any per-row constant stabilizes the exp; the global max is the usual choice
        row_max = ops.stop_gradient(all_reduce_max(ops.amax(flat, -1, keepdims=True), self.group))
        shifted = flat - row_max
        sum_exp = self.sum_exp(ops.exp(shifted).sum(-1))
        local = labels.reshape(-1).astype(ms.int32) - self.vocab_start
        inside = ops.logical_and(local >= 0, local < v).astype(ms.float32)
        local = ops.clip_by_value(local, 0, v - 1)
        tgt = ops.gather_elements(shifted, 1, local.reshape(-1, 1)).reshape(-1) * inside
        nll = ops.log(sum_exp) - self.target(tgt)
        return (nll * loss_mask.reshape(-1).astype(ms.float32)).sum()


def tp_replicated_names(model) -> list[str]:
    """Parameters every TP rank holds whole (the norm weights)."""
    return [n for n, _ in model.parameters_and_names() if n.endswith("norm.weight")]
