"""Counter-based dropout: masks are a pure function of (seed, step, micro-batch, site, element).

MindSpore's dropout kernels keep their random state inside the compiled kernel, where
``ms.get_rng_state`` cannot see it, so a resumed run drew different masks. Here every mask
bit is a hash of a key and the element's index, computed with uint32 ops inside the
compiled graph (uint32 multiplication wraps modulo 2**32 by definition, so no masking is
needed; the CPU backend has Mul, BitwiseXor and RightShift for uint32). A resumed run that
feeds the same (seed, step, micro-batch) key draws the same masks, bit for bit (no
random state has to be saved: the key is the config seed and the restored step).

The hash (the NumPy reference in the tests re-implements it from this description):

    fmix(x)     = murmur3's 32-bit finalizer: x ^= x >> 16; x *= 0x85EBCA6B;
                  x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16   (all mod 2**32)
    step key    k0 = fmix(fmix(fmix(seed_lo) ^ seed_hi) ^ step)
                k1 = fmix(k0 ^ (micro_batch + 0x9E3779B9))
    site words  a = k0 ^ fmix(2*site + 1),  b = k1 ^ fmix(2*site + 2)
    element i   r = fmix(fmix(i ^ a) ^ b)      (i = row-major index in the tensor)
    keep        r >= floor(p * 2**32);   y = x * keep / (1 - p)

The key enters before and between the two rounds, so two sites (or steps) are not shifted
copies of one stream. Not cryptographic; uniform enough for masks (tests check the rate).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

__all__ = ["CounterDropout", "dropout_key", "dropout_site"]

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN = 0x9E3779B9

# site ids: the embedding output is 0; layer i owns 1 + 3*i (attention probabilities),
# 2 + 3*i (attention branch output) and 3 + 3*i (MLP/MoE branch output)
_SITES_PER_LAYER = 3
_WHICH = {"attn_probs": 0, "attn_out": 1, "mlp_out": 2}


def dropout_site(layer: int | None, which: str = "embed") -> int:
    """The site id of a dropout in the model: ``dropout_site(None)`` for the embedding."""
    if layer is None:
        return 0
    return 1 + _SITES_PER_LAYER * layer + _WHICH[which]


def _fmix(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 13
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def _key_words(seed: int, step: int, micro_batch: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    k0 = _fmix(_fmix(_fmix(seed & _M32) ^ (seed >> 32)) ^ (step & _M32))
    k1 = _fmix(k0 ^ ((micro_batch + _GOLDEN) & _M32))
    return k0, k1


def dropout_key(seed: int, step: int, micro_batch: int = 0) -> Tensor:
    """The uint32[2] key of one forward: run seed, optimizer step, micro-batch index.

    Pass it as ``dropout_key`` to ``Llama``/``LlamaWithLoss``; the same three numbers give
    the same masks in every process.
    """
    return Tensor(np.array(_key_words(seed, step, micro_batch), np.uint32))


def _u32(v: int) -> Tensor:
    return Tensor(np.uint32(v & _M32))


class CounterDropout(nn.Cell):
    """Dropout whose mask is a hash of ``key`` (see ``dropout_key``), ``site`` and the index.

    ``construct(x, key=None)``: in inference mode the identity; in training mode with a key,
    the counter-based mask; without a key (the DeepSeek-V3 family, a caller that passes
    none) MindSpore's stateful dropout, as before, which does not resume bit-exactly.
    """

    def __init__(self, p: float, site: int):
        super().__init__()
        if not 0.0 < p < 1.0:
            raise ValueError(f"dropout p must be in (0, 1), found {p!r}")
        self.p = p
        self.site = site
        self.site_a = _u32(_fmix(2 * site + 1))
        self.site_b = _u32(_fmix(2 * site + 2))
        self.threshold = _u32(int(p * 2**32))
        self.scale = 1.0 / (1.0 - p)
        self.c1, self.c2 = _u32(_C1), _u32(_C2)
        self.s16, self.s13 = _u32(16), _u32(13)
        self.shr = ops.RightShift()
        self.stateful = nn.Dropout(p=p)

    def _fmix(self, x):
        x = ops.bitwise_xor(x, self.shr(x, self.s16))
        x = x * self.c1
        x = ops.bitwise_xor(x, self.shr(x, self.s13))
        x = x * self.c2
        return ops.bitwise_xor(x, self.shr(x, self.s16))

    def keep_mask(self, key, shape):
        """bool mask of `shape` for this site under `key` (True = kept)."""
        a = ops.bitwise_xor(key[0], self.site_a)
        b = ops.bitwise_xor(key[1], self.site_b)
        n = 1
        for d in shape:
            n *= d
        idx = ops.arange(0, n, dtype=ms.int32).astype(ms.uint32).reshape(shape)
        r = self._fmix(ops.bitwise_xor(self._fmix(ops.bitwise_xor(idx, a)), b))
        return r >= self.threshold

    def construct(self, x, key=None):
        if not self.training:
            return x
        if key is None:
            return self.stateful(x)
        keep = ops.stop_gradient(self.keep_mask(key, x.shape).astype(x.dtype))
        return x * keep * self.scale
