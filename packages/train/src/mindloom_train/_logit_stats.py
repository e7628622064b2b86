"""The MaxLogits statistics as graph cells (`_numerics` builds them on demand, so that
importing it costs no MindSpore import): the Llama loss net that also writes each layer's
largest attention logit, and the DeepSeek-V3 (MLA) statistics net."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindloom_model import attention_bias, llama_loss, rope_cos_sin
from mindspore import nn, ops

__all__ = ["LossWithLogitStats", "MLALogitStats"]


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
        return ops.depend(llama_loss(m, logits, labels, loss_mask), ops.assign(self.stats, stats))


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
