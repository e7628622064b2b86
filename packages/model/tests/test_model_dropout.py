"""Counter-based dropout: the compiled masks equal an independent NumPy implementation of the
hash described in mindloom_model._dropout, bit for bit; rate, scaling, gradient, site ids."""

import mindspore as ms
import numpy as np
import pytest
from mindloom_model import CounterDropout, Llama, dropout_key, dropout_site, get_preset
from mindspore import Tensor, nn, ops

# ----------------------------------------------------------------------------- reference
# written from the module docstring with NumPy uint32 arithmetic (wraps mod 2**32)

U = np.uint32


def np_fmix(x):
    x = np.asarray(x, np.uint32).copy()
    with np.errstate(over="ignore"):
        x ^= x >> U(16)
        x *= U(0x85EBCA6B)
        x ^= x >> U(13)
        x *= U(0xC2B2AE35)
        x ^= x >> U(16)
    return x


def np_key(seed, step, micro):
    lo, hi = U(seed & 0xFFFFFFFF), U((seed >> 32) & 0xFFFFFFFF)
    k0 = np_fmix(np_fmix(np_fmix(lo) ^ hi) ^ U(step))
    k1 = np_fmix(k0 ^ U((micro + 0x9E3779B9) & 0xFFFFFFFF))
    return k0, k1


def np_keep(seed, step, micro, site, p, shape):
    k0, k1 = np_key(seed, step, micro)
    a = k0 ^ np_fmix(U(2 * site + 1))
    b = k1 ^ np_fmix(U(2 * site + 2))
    i = np.arange(int(np.prod(shape)), dtype=np.uint32).reshape(shape)
    r = np_fmix(np_fmix(i ^ a) ^ b)
    return r >= U(int(p * 2**32))


class Apply(nn.Cell):
    def __init__(self, drop):
        super().__init__()
        self.drop = drop

    def construct(self, x, key):
        return self.drop(x, key)


CASES = [
    # seed, step, micro, site, p, shape
    (1234, 1, 0, 0, 0.1, (2, 8, 16)),
    (1234, 1, 3, 7, 0.5, (3, 4, 5, 5)),
    (2**40 + 17, 100_000, 1, 4, 0.3, (1, 33)),
    (0, 0, 0, 1, 0.9, (64, 64)),
]


@pytest.mark.parametrize("seed,step,micro,site,p,shape", CASES)
def test_graph_masks_equal_numpy_bit_for_bit(graph_mode, seed, step, micro, site, p, shape):
    key = dropout_key(seed, step, micro)
    assert key.dtype == ms.uint32
    np.testing.assert_array_equal(key.asnumpy(), np.array(np_key(seed, step, micro), np.uint32))
    drop = CounterDropout(p, site)
    net = Apply(drop)
    net.set_train(True)
    x = np.random.default_rng(site).standard_normal(shape).astype(np.float32) + 3.0  # never 0
    y = net(Tensor(x), key).asnumpy()
    keep = np_keep(seed, step, micro, site, p, shape)
    np.testing.assert_array_equal(y != 0, keep)
    scale = np.float32(1.0 / (1.0 - p))
    np.testing.assert_array_equal(y, np.where(keep, x * scale, np.float32(0)))
    # a pure function of the key: the same call redraws the same mask
    np.testing.assert_array_equal(net(Tensor(x), key).asnumpy(), y)


def test_rate_and_scaling_over_many_elements(graph_mode):
    shape = (4, 256, 256)
    ones = Tensor(np.ones(shape, np.float32))
    nets = {}
    for p in (0.1, 0.5):
        net = nets[p] = Apply(CounterDropout(p, 3))
        net.set_train(True)
        y = net(ones, dropout_key(7, 11, 0)).asnumpy()
        n = y.size
        kept = np.count_nonzero(y) / n
        sigma = np.sqrt(p * (1 - p) / n)
        assert abs(kept - (1 - p)) < 5 * sigma, (p, kept)
        assert np.all((y == 0) | (y == np.float32(1 / (1 - p))))
        assert abs(y.mean() - 1.0) < 5 * sigma / (1 - p)  # expectation is preserved
    # neighbouring steps and sites draw unrelated masks: agreement is what chance gives
    # (the p=0.5 net of the loop again: its graph is compiled already)
    net = nets[0.5]
    a = net(ones, dropout_key(7, 11, 0)).asnumpy() != 0
    b = net(ones, dropout_key(7, 12, 0)).asnumpy() != 0
    c = Apply(CounterDropout(0.5, 4))
    c.set_train(True)
    d = c(ones, dropout_key(7, 11, 0)).asnumpy() != 0
    for other in (b, d):
        agree = np.mean(a == other)
        assert abs(agree - 0.5) < 5 * np.sqrt(0.25 / a.size), agree


def test_gradient_is_the_mask_times_scale(graph_mode):
    p, site, shape = 0.25, 2, (3, 7, 9)
    x = Tensor(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
    w = np.random.default_rng(2).standard_normal(shape).astype(np.float32)

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.drop = CounterDropout(p, site)
            self.w = Tensor(w)

        def construct(self, x, key):
            return (self.drop(x, key) * self.w).sum()

    net = Loss()
    net.set_train(True)
    g = ops.GradOperation()(net)(x, dropout_key(5, 6, 1)).asnumpy()
    keep = np_keep(5, 6, 1, site, p, shape)
    np.testing.assert_allclose(g, np.where(keep, w / (1 - p), 0), rtol=1e-6)


def test_inference_is_identity_and_keyless_training_is_stateful():
    x = Tensor(np.ones((4, 64), np.float32))
    drop = CounterDropout(0.5, 0)
    drop.set_train(False)
    np.testing.assert_array_equal(drop(x, dropout_key(1, 1)).asnumpy(), x.asnumpy())
    np.testing.assert_array_equal(drop(x).asnumpy(), x.asnumpy())
    drop.set_train(True)
    a, b = drop(x).asnumpy(), drop(x).asnumpy()  # MindSpore's RNG: two draws differ
    assert not np.array_equal(a, b)


def test_every_dropout_site_in_the_model_is_distinct():
    cfg = get_preset("debug", dropout=0.1)
    model = Llama(cfg)
    sites = [c.site for _, c in model.cells_and_names() if isinstance(c, CounterDropout)]
    assert len(sites) == 1 + 3 * cfg.num_layers
    assert sorted(sites) == list(range(len(sites)))
    assert dropout_site(None) == 0 and dropout_site(1, "mlp_out") == 6
    assert not any(
        isinstance(c, CounterDropout) for _, c in Llama(get_preset("debug")).cells_and_names()
    )


def test_model_forward_is_a_function_of_the_key(graph_mode):
    tokens = Tensor(np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32))
    model = Llama(get_preset("debug", dropout=0.2))
    model.set_train(True)
    k1, k2 = dropout_key(1, 5, 0), dropout_key(1, 6, 0)
    a = model(tokens, None, None, k1).asnumpy()
    np.testing.assert_array_equal(model(tokens, None, None, k1).asnumpy(), a)
    assert np.abs(model(tokens, None, None, k2).asnumpy() - a).max() > 1e-3
    model.set_train(False)
    clean = model(tokens).asnumpy()
    assert np.abs(clean - a).max() > 1e-3
