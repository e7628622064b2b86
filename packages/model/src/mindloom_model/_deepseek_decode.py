"""MLA decoding with a KV cache of the compressed latent and the rotated RoPE key.

Shapes: B batch, T new tokens, C = max_seq_len cache slots, L layers, r kv_lora_rank,
dr qk_rope_head_dim, V vocabulary.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindloom_model._deepseek import DeepseekV3

__all__ = ["MLACachedDecoder", "mla_empty_cache"]


class MLACachedDecoder(nn.Cell):
    """tokens [B, T] at positions start..start+T-1 against fixed-size MLA caches.

    The caches hold what MLA exists to keep small: the normalised latent [L, B, C, r]
    and the rotated shared RoPE key [L, B, C, dr] (C = max_seq_len), not per-head keys
    and values; keys and values are expanded from them at each step. Returns logits
    [B, T, V] fp32 and the updated caches. Only the main model decodes (MTP is a
    training objective here).
    """

    def __init__(self, model: DeepseekV3):
        super().__init__(auto_prefix=False)
        self.model = model
        self.slots = Tensor(np.arange(model.config.max_seq_len, dtype=np.int32))  # [C]

    def construct(self, tokens, start, c_cache, r_cache):
        m = self.model
        b, t = tokens.shape
        pos = m.positions[:, :t] + start  # [1, T]
        cos, sin = m.rope(pos)
        allowed = self.slots.expand_dims(0) <= pos.reshape(t, 1)  # [T, C]
        bias = ops.select(
            allowed,
            ops.zeros(allowed.shape, ms.float32),
            ops.full(allowed.shape, -1e9, dtype=ms.float32),
        ).reshape(1, 1, t, -1)
        write = (self.slots.expand_dims(0) == pos.reshape(t, 1)).astype(m.compute_dtype)  # [T, C]
        keep = 1 - write.sum(0).reshape(-1, 1)  # [C, 1]
        scatter = write.transpose(1, 0)  # [C, T]
        x = m.embed(tokens)
        new_c, new_r = [], []
        i = 0
        for layer in m.layers:
            attn = layer.attn
            hn = layer.attn_norm(x)
            q = attn.query(hn, cos, sin)
            c, kr = attn.latent(hn, cos, sin)  # [B, T, r], [B, 1, T, dr]
            cc = c_cache[i] * keep + ops.matmul(scatter, c)  # [B, C, r]; one-hot: exact
            rc = r_cache[i] * keep + ops.matmul(scatter, kr.reshape(b, t, -1))  # [B, C, dr]
            new_c.append(cc)
            new_r.append(rc)
            k, v = attn.expand(cc, rc.expand_dims(1))
            x = x + attn.attend(q, k, v, bias)
            x = x + layer.ffn(x)[0]
            i += 1
        return m.head(m.norm(x)), ops.stack(new_c), ops.stack(new_r)


def mla_empty_cache(model: DeepseekV3, batch: int):
    cfg = model.config
    c = np.zeros((cfg.num_layers, batch, cfg.max_seq_len, cfg.kv_lora_rank), np.float32)
    r = np.zeros((cfg.num_layers, batch, cfg.max_seq_len, cfg.qk_rope_head_dim), np.float32)
    return Tensor(c).astype(model.compute_dtype), Tensor(r).astype(model.compute_dtype)
