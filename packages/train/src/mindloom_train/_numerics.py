"""The in-graph training numerics of issue 18, computed at log steps only.

- `monitor.numerics` (local norms): per parameter tensor, the gradient, parameter and update
  squared norms and the AdamW moment means, returned by `_step.TrainStep(numerics=True)`;
  `layer_numerics` reduces them per transformer layer.
- `monitor.max_logits` (MaxLogits): the largest attention logit q.k/sqrt(d) of each layer
  over the positions the mask allows, and the fraction of tokens (under the loss mask)
  whose top output logit exceeds `monitor.output_logit_bound`, on the step's last
  micro-batch with the weights before the update. Llama: `LossWithLogitStats`, the loss
  net of the log step's train graph, takes them from the step's own forward (the scores
  from each layer's q/k, the fraction from the logits the loss reads) and leaves them in
  a buffer; DeepSeek-V3 (MLA): `MLALogitStats`, a forward-only graph of its own.

The runner runs these graphs only at the steps whose record is written
(`NumericsFields.wanted`), so a step between two log steps runs exactly the plain step.
"""

from __future__ import annotations

import math

import numpy as np

# columns of TrainStep's numerics output, per parameter tensor
NUMERICS = ("grad_sq", "param_sq", "update_sq", "adam_m_abs_mean", "adam_sqrt_v_mean")


def layer_numerics(names: list[str], sizes: list[int], rows: np.ndarray) -> dict[str, list]:
    """Per transformer layer (tensors named `layers.N.*`), from TrainStep's numerics rows:
    the gradient norm (unscaled, before clipping), the parameter norm before the update,
    the update/weight ratio |w_after - w_before| / |w_before|, and the element-weighted
    mean |m| and mean sqrt(v) of the AdamW moments after it."""
    groups: dict[int, list[int]] = {}
    for i, name in enumerate(names):
        parts = name.split(".")
        if "layers" in parts[:-1]:
            at = parts.index("layers") + 1
            if at < len(parts) and parts[at].isdigit():
                groups.setdefault(int(parts[at]), []).append(i)
    out: dict[str, list] = {"grad_norm_layers": [], "param_norm_layers": [],
                            "update_ratio_layers": [], "adam_m_layers": [],
                            "adam_sqrt_v_layers": []}  # fmt: skip
    for layer in sorted(groups):
        idx = groups[layer]
        r = rows[idx].astype(np.float64)
        n = np.array([sizes[i] for i in idx], np.float64)
        w = math.sqrt(r[:, 1].sum())
        out["grad_norm_layers"].append(math.sqrt(r[:, 0].sum()))
        out["param_norm_layers"].append(w)
        out["update_ratio_layers"].append(math.sqrt(r[:, 2].sum()) / w if w > 0 else math.nan)
        out["adam_m_layers"].append(float((r[:, 3] * n).sum() / n.sum()))
        out["adam_sqrt_v_layers"].append(float((r[:, 4] * n).sum() / n.sum()))
    return out


class NumericsFields:
    """The newest log step's statistics (Tensors, read only when its record is written)
    and their metrics fields. `rows`: TrainStep's numerics rows; `logits`: LogitStats'
    (max attention logit per layer, fraction of tokens over the output bound). The runner
    clears both on steps it computes neither, so a record forced between two log steps
    (a stop signal) carries no stale statistics."""

    def __init__(self, weights, log_interval: int = 1, last_step: int = 0):
        self.names = [p.name for p in weights]
        self.sizes = [int(np.prod(p.shape)) for p in weights]
        self.log_interval = max(1, log_interval)
        self.last_step = last_step
        self.rows = None
        self.logits = None

    def wanted(self, step: int) -> bool:
        """Whether `step`'s record is written on schedule (the trainer's rule)."""
        return step % self.log_interval == 0 or step == self.last_step

    def clear(self) -> None:
        self.rows = self.logits = None

    def fields(self) -> dict[str, list | float]:
        out: dict[str, list | float] = {}
        if self.rows is not None:
            out.update(layer_numerics(self.names, self.sizes, self.rows.asnumpy()))
        if self.logits is not None:
            if isinstance(self.logits, tuple):  # MLALogitStats: (per layer, fraction)
                per_layer, frac = (x.asnumpy() for x in self.logits)
            else:  # LossWithLogitStats' buffer: the per-layer maxima, then the fraction
                got = self.logits.asnumpy()
                per_layer, frac = got[:-1], got[-1]
            out["max_logits"] = [float(x) for x in per_layer]
            out["logits_over_bound_frac"] = float(frac)
        return out


def _logit_stats_cells():
    import mindspore as ms
    from mindloom_model import attention_bias, llama_loss, rope_cos_sin
    from mindspore import nn, ops

    class _Stats(nn.Cell):
        """What both families share: the largest allowed score of one layer, and the
        fraction of masked-in tokens whose top output logit exceeds `bound`."""

        def __init__(self, model, bound: float):
            super().__init__(auto_prefix=False)
            self.model = model
            self.bound = float(bound)
            self.bmm = ops.BatchMatMul(transpose_b=True)

        def _top(self, q, k, mask):
            scores = self.bmm(q, k).astype(ms.float32)  # [B, H, S, S]
            # the mask's -1e9 keeps disallowed pairs out; the row maxima first: a whole-tensor
            # ReduceMax is ~3x slower on the CPU backend (the same value: max is exact)
            return (scores + mask).max(-1).max()

        def _frac(self, x, loss_mask):
            m = self.model
            return self._frac_of(m.head(m.norm(x)), loss_mask)

        def _frac_of(self, logits, loss_mask):
            over = (logits.max(-1) > self.bound).astype(ms.float32)  # logits [B, S, V] fp32
            w = loss_mask.astype(ms.float32)
            return (over * w).sum() / ops.maximum(w.sum(), ops.ones((), ms.float32))

    class LossWithLogitStats(_Stats):
        """Llama: the train step's loss net (LlamaWithLoss's forward, op for op: the same
        loss) that also writes the MaxLogits of that forward into `stats` (a buffer of
        L + 1: the largest attention logit of each layer, then the fraction of masked-in
        tokens whose top output logit exceeds `bound`). The logits are taken from each
        layer's q/k (Attention.qkv, RoPE applied) in the portable layout, so the fused CPU
        attention kernel, which never forms them, needs no change; they carry no gradient.
        Sharing the step's forward, the statistics cost the q/k projections and scores
        once more, not a forward of the whole model."""

        def __init__(self, loss_net, bound: float):
            super().__init__(loss_net.model, bound)
            cfg = loss_net.model.config
            self.n_rep = cfg.num_heads // cfg.num_kv_heads
            self.stats = ms.Parameter(np.zeros(cfg.num_layers + 1, np.float32),
                                      name="max_logits_stats", requires_grad=False)  # fmt: skip

        def _max_logit(self, attn, h, cos, sin, mask):
            q, k, _ = attn.qkv(h, cos, sin, attn.scale)  # q carries 1/sqrt(d), as in attention
            if self.n_rep > 1:
                b, kv, t, dh = k.shape
                k = k.expand_dims(2).broadcast_to((b, kv, self.n_rep, t, dh))
                k = k.reshape(b, kv * self.n_rep, t, dh)
            return self._top(q, k, mask)

        def construct(self, tokens, labels, position_ids=None, segment_ids=None,
                      loss_mask=None, dropout_key=None):  # fmt: skip
            m = self.model
            s = tokens.shape[1]
            cos, sin, bias = m.attention_inputs(position_ids, segment_ids)
            p_cos, p_sin = rope_cos_sin(position_ids, m.inv_freq)  # [B, 1, S, Dh]
            pos = m.positions[0, :s]
            mask = attention_bias(s, segment_ids, pos.expand_dims(1) >= pos.expand_dims(0))
            x = m.embed(tokens)
            if m.embed_dropout is not None:
                x = m.embed_dropout(x, dropout_key)
            tops = ()
            for layer in m.layers:
                top = self._max_logit(layer.attn, layer.attn_norm(x), p_cos, p_sin, mask)
                tops = tops + (ops.stop_gradient(top),)
                x = layer(x, cos, sin, bias, dropout_key)
            logits = m.head(m.norm(x))
            frac = ops.stop_gradient(self._frac_of(logits, loss_mask))
            stats = ops.concat((ops.stack(tops), frac.reshape(1)))
            return ops.depend(
                llama_loss(m, logits, labels, loss_mask), ops.assign(self.stats, stats)
            )

    class MLALogitStats(_Stats):
        """DeepSeek-V3 (MLA): the same outputs. Each layer's logit is q.k * scale with q
        from `MLAttention.query` and k from its latent (`latent`, `expand`: the no-RoPE
        part per head, the one RoPE key shared by all heads), RoPE (YaRN where set) and
        the softmax scale exactly as the attention uses them. MTP depths are not counted
        (they predict further tokens, not the trunk's attention)."""

        def _max_logit(self, attn, h, cos, sin, mask):
            q = attn.query(h, cos, sin) * attn.scale
            k, _ = attn.expand(*attn.latent(h, cos, sin))
            return self._top(q, k, mask)

        def construct(self, tokens, position_ids, segment_ids, loss_mask, dropout_key=None):
            m = self.model
            cos, sin = m.rope(position_ids)
            bias = attention_bias(tokens.shape[1], segment_ids)
            x = m.embed(tokens)
            tops = ()
            for layer in m.layers:
                tops = tops + (self._max_logit(layer.attn, layer.attn_norm(x), cos, sin, bias),)
                x = layer(x, cos, sin, bias)[0]
            return ops.stack(tops), self._frac(x, loss_mask)

    return LossWithLogitStats, MLALogitStats


def loss_with_logit_stats(loss_net, bound: float):
    """Llama: a loss net over `loss_net`'s model (a LlamaWithLoss) that computes the same
    loss and leaves the MaxLogits of its forward in `.stats` (see LossWithLogitStats)."""
    return _logit_stats_cells()[0](loss_net, bound)


def logit_stats(model, bound: float):
    """DeepSeek-V3: an `MLALogitStats` forward over `model` (a DeepseekV3)."""
    return _logit_stats_cells()[1](model, bound)
