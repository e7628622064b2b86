"""Compiled training: GRAPH_MODE equals PyNative, recompute, init, dropout, precision, loss."""

import logging
import re

import mindloom_model._llama as L
import mindspore as ms
import numpy as np
import pytest
from mindloom_model import Llama, LlamaWithLoss, causal_lm_loss, get_preset
from mindspore import Tensor, nn, ops

rng = np.random.default_rng(0)
B, S = 2, 16
TOKENS = rng.integers(0, 256, (B, S + 1)).astype(np.int32)
SEG = np.array([[0] * 6 + [1] * 10, [0] * 16], np.int32)
POS = np.array([list(range(6)) + list(range(10)), list(range(16))], np.int32)
MASK = np.ones((B, S), np.float32)
MASK[0, 5] = 0.0  # the EOS-to-next-document label does not count
INPUTS = [Tensor(TOKENS[:, :-1]), Tensor(TOKENS[:, 1:]), Tensor(POS), Tensor(SEG), Tensor(MASK)]


class GradCell(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.params = net.trainable_params()
        self.grad = ops.GradOperation(get_by_list=True)

    def construct(self, *args):
        return self.net(*args), self.grad(self.net, self.params)(*args)


def pynative_loss_and_grads(net):
    old = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        loss, grads = ms.value_and_grad(net, None, net.trainable_params())(*INPUTS)
        return loss.asnumpy(), [g.asnumpy() for g in grads]
    finally:
        ms.set_context(mode=old)


def compiled_loss_and_grads(net, save_graphs_to=None):
    old = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    if save_graphs_to:
        ms.set_context(save_graphs=1, save_graphs_path=str(save_graphs_to))
    try:
        loss, grads = GradCell(net)(*INPUTS)
        return loss.asnumpy(), [g.asnumpy() for g in grads]
    finally:
        ms.set_context(mode=old, save_graphs=0)


@pytest.fixture(scope="module")
def reference():
    """PyNative loss and grads of the debug model (recompute none), computed once."""
    return pynative_loss_and_grads(LlamaWithLoss(Llama(get_preset("debug"))))


def assert_same(a, b, tol=1e-5):
    np.testing.assert_allclose(a[0], b[0], rtol=tol, atol=tol)
    assert len(a[1]) == len(b[1])
    for ga, gb in zip(a[1], b[1], strict=True):
        np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=tol)


def test_graph_mode_gives_the_same_loss_and_grads_as_pynative(reference, tmp_path, monkeypatch):
    monkeypatch.setenv("MS_DEV_DUMP_IR_PASSES", "graph_build")  # dump only the final graph
    compiled = compiled_loss_and_grads(
        LlamaWithLoss(Llama(get_preset("debug"))), save_graphs_to=tmp_path
    )
    assert_same(compiled, reference)
    assert all(np.abs(g).sum() > 0 for g in compiled[1])  # every parameter is trained
    assert recomputed_layers(tmp_path) == []  # recompute="none"


def recomputed_layers(ir_dir):
    """Layer indices whose Linear MatMuls the compiled graph recomputes in the backward pass."""
    text = "".join(p.read_text(errors="ignore") for p in ir_dir.glob("graph_build*.ir"))
    return sorted(
        {
            int(m)
            for m in re.findall(
                r"recompute_Default/\S*?layers-CellList/(\d+)-Block/\S*?-Linear/MatMul", text
            )
        }
    )


@pytest.mark.parametrize(("mode", "layers", "want"), [("full", [], [0, 1]), ("selected", [1], [1])])
def test_recompute_is_honoured_in_compiled_mode_and_changes_nothing(
    reference, tmp_path, monkeypatch, mode, layers, want
):
    monkeypatch.setenv("MS_DEV_DUMP_IR_PASSES", "graph_build")
    cfg = get_preset("debug", recompute=mode, recompute_layers=layers)
    assert L.recompute_layer_ids(cfg) == want
    compiled = compiled_loss_and_grads(LlamaWithLoss(Llama(cfg)), save_graphs_to=tmp_path)
    assert recomputed_layers(tmp_path) == want
    assert_same(compiled, reference)


def test_compiled_train_step_learns(graph_mode):
    net = LlamaWithLoss(Llama(get_preset("debug")))
    step = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), 3e-3))
    losses = [float(step(*INPUTS).asnumpy()) for _ in range(15)]
    assert losses[0] == pytest.approx(np.log(256), rel=0.05)  # init predicts ~uniform
    assert losses[-1] < losses[0] - 1.0


def test_causal_lm_loss_matches_numpy_and_ignores_masked_labels():
    logits = rng.standard_normal((2, 5, 7)).astype(np.float32) * 3
    labels = rng.integers(0, 7, (2, 5)).astype(np.int32)
    mask = np.array([[1, 1, 0, 1, 1], [1, 0, 0, 0, 1]], np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    want = (nll * mask).sum() / mask.sum()
    got = causal_lm_loss(Tensor(logits), Tensor(labels), Tensor(mask)).asnumpy()
    assert got == pytest.approx(want, rel=1e-5)
    big = logits * 1000  # exp would overflow without the max shift
    big_logp = big - big.max(-1, keepdims=True)
    big_logp -= np.log(np.exp(big_logp).sum(-1, keepdims=True))
    big_want = (
        -np.take_along_axis(big_logp, labels[..., None], -1)[..., 0] * mask
    ).sum() / mask.sum()
    got_big = causal_lm_loss(Tensor(big), Tensor(labels), Tensor(mask)).asnumpy()
    assert np.isfinite(got_big) and got_big == pytest.approx(big_want, rel=1e-5)
    all_ones = causal_lm_loss(Tensor(logits), Tensor(labels), None).asnumpy()
    assert all_ones == pytest.approx(nll.mean(), rel=1e-5)
    labels[mask == 0] = -100  # padding labels under a zero mask change nothing
    assert causal_lm_loss(Tensor(logits), Tensor(labels), Tensor(mask)).asnumpy() == pytest.approx(
        want, rel=1e-5
    )


# ----------------------------------------------------------------------------- init


def weights(model):
    return {p.name: p.asnumpy() for p in model.get_parameters()}


def test_init_is_deterministic_under_a_seed():
    a, b = weights(Llama(get_preset("debug"), seed=7)), weights(Llama(get_preset("debug"), seed=7))
    c = weights(Llama(get_preset("debug"), seed=8))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["layers.0.attn.wq.weight"], c["layers.0.attn.wq.weight"])


def test_init_scales():
    cfg = get_preset(
        "debug",
        num_layers=8,
        hidden_size=128,
        num_heads=4,
        ffn_hidden_size=256,
        embed_init_std=1.0,
        head_init_std=0.05,
    )
    w = weights(Llama(cfg))
    out_std = 0.02 / np.sqrt(2 * 8)
    for i in (0, 7):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
            assert w[f"layers.{i}.{name}.weight"].std() == pytest.approx(0.02, rel=0.05)
        for name in ("attn.wo", "mlp.w2"):
            assert w[f"layers.{i}.{name}.weight"].std() == pytest.approx(out_std, rel=0.05)
        assert np.all(w[f"layers.{i}.attn_norm.weight"] == 1.0)
    assert w["embed.weight"].std() == pytest.approx(1.0, rel=0.05)
    assert w["lm_head.weight"].std() == pytest.approx(0.05, rel=0.05)
    assert abs(w["embed.weight"].mean()) < 0.02


# ----------------------------------------------------------------------------- dropout


def test_dropout_is_active_in_training_only():
    tokens = INPUTS[0]
    model = Llama(get_preset("debug", dropout=0.3))
    plain = Llama(get_preset("debug"))
    model.set_train(True)
    a, b = model(tokens).asnumpy(), model(tokens).asnumpy()
    assert np.abs(a - b).max() > 1e-3
    model.set_train(False)
    plain.set_train(False)
    np.testing.assert_allclose(
        model(tokens).asnumpy(), plain(tokens).asnumpy(), rtol=1e-6, atol=1e-6
    )


# ----------------------------------------------------------------------------- precision


def test_bf16_falls_back_to_fp32_on_cpu_and_says_so_once(caplog):
    L._low_precision_ok.pop("bfloat16", None)
    with caplog.at_level(logging.WARNING, logger="mindloom_model"):
        m1 = Llama(get_preset("debug", compute_dtype="bfloat16"))
        m2 = Llama(get_preset("debug", compute_dtype="bfloat16"))
    notes = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert len(notes) == 1 and "computing in float32" in notes[0]
    assert m1.compute_dtype == ms.float32 == m2.layers[0].attn.wq.compute_dtype
    ref = Llama(get_preset("debug"))
    np.testing.assert_array_equal(m1(INPUTS[0]).asnumpy(), ref(INPUTS[0]).asnumpy())


def test_fp16_compute_keeps_fp32_master_weights_norms_and_logits():
    model = Llama(get_preset("debug", compute_dtype="float16"))
    ref = Llama(get_preset("debug"))
    assert model.compute_dtype == ms.float16
    assert all(p.dtype == ms.float32 for p in model.get_parameters())  # master weights
    x = model.embed(INPUTS[0])
    assert x.dtype == ms.float16
    assert model.layers[0].attn.wq(x).dtype == ms.float16
    logits = model(INPUTS[0])
    assert logits.dtype == ms.float32
    np.testing.assert_allclose(logits.asnumpy(), ref(INPUTS[0]).asnumpy(), atol=2e-2)
    loss = causal_lm_loss(logits, INPUTS[1], INPUTS[4])
    assert loss.dtype == ms.float32
