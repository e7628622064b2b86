"""The compiled step's optional numerics (issue 18, local norms): per-layer gradient and
parameter norms, update/weight ratio and AdamW moment statistics, against NumPy on the
weights and moments before and after each step.

Like test_train_adamw_reference.py (the same set-up: train_testutil.linear_loss_setup), the
loss is linear in the weights, so the gradient is exactly the tensor fed in; a loss scale
and clipping are active, so unscaling and the order of the weight copy against the
in-place update are both exercised."""

from __future__ import annotations

import numpy as np
import pytest

SCALE, CLIP = 1024.0, 1.0


def test_numerics_per_layer_match_numpy():
    import mindspore as ms
    from mindloom_train import _step as S
    from mindspore import Tensor
    from train_testutil import linear_loss_setup

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    lin = linear_loss_setup()
    params, names, shapes, sizes = lin.params, lin.names, lin.shapes, lin.sizes
    layer_of = {n: int(n.split(".")[1]) for n in names if n.startswith("layers.")}
    assert sorted(set(layer_of.values())) == [0, 1]

    weights = ms.ParameterTuple(params)
    # the runner's pair: the plain step, and the numerics graph it runs at log steps, which
    # updates the same moments (share=); here step 1 is plain, steps 2 and 3 log steps
    plain = S.TrainStep(lin.loss_net, weights, S.decay_flags(params, False))
    step = S.TrainStep(type(lin.loss_net)(), weights, S.decay_flags(params, False), numerics=True,
                       share=plain)  # fmt: skip
    dummy = Tensor(np.zeros(1, np.float32))
    rng = np.random.default_rng(0)
    np_m = [np.zeros(sh) for sh in shapes]  # NumPy's first moment: beta1 0.9, clip CLIP
    for adam_step, mag in enumerate((3.0, 3.0, 0.05), 1):  # clipped twice, then not
        grads = [(rng.standard_normal(s) * mag / np.sqrt(sum(sizes))).astype(np.float32)
                 for s in shapes]  # fmt: skip
        before = [p.asnumpy().copy() for p in params]
        h = S.hyper_vector(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                           adam_step=adam_step, clip=CLIP, spike=None, loss_scale=SCALE)  # fmt: skip
        flat = lin.flat(grads)
        total = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
        clip_f = min(CLIP / (total + 1e-6), 1.0)
        np_m = [0.9 * m + 0.1 * g * clip_f for m, g in zip(np_m, grads, strict=True)]
        if adam_step == 1:
            assert bool(plain(flat, dummy, dummy, dummy, dummy, h)[2].asnumpy())
            continue
        _, _, ok, _, rows = step(flat, dummy, dummy, dummy, dummy, h)
        assert bool(ok.asnumpy())
        got = S.layer_numerics(names, sizes, rows.asnumpy())
        after = [p.asnumpy() for p in params]
        ms_m = [m.asnumpy() for m in step.exp_avg]
        ms_v = [v.asnumpy() for v in step.exp_avg_sq]
        for layer in (0, 1):
            idx = [i for i, n in enumerate(names) if layer_of.get(n) == layer]
            gn = np.sqrt(sum(float((grads[i].astype(np.float64) ** 2).sum()) for i in idx))
            wn = np.sqrt(sum(float((before[i].astype(np.float64) ** 2).sum()) for i in idx))
            un = np.sqrt(sum(float(((after[i] - before[i]).astype(np.float64) ** 2).sum())
                             for i in idx))  # fmt: skip
            n = sum(sizes[i] for i in idx)
            m = sum(float(np.abs(ms_m[i]).sum()) for i in idx) / n
            v = sum(float(np.sqrt(ms_v[i]).sum()) for i in idx) / n
            assert got["grad_norm_layers"][layer] == pytest.approx(gn, rel=1e-5)
            assert got["param_norm_layers"][layer] == pytest.approx(wn, rel=1e-5)
            assert un > 0 and got["update_ratio_layers"][layer] == pytest.approx(un / wn, rel=1e-4)
            assert got["adam_m_layers"][layer] == pytest.approx(m, rel=1e-5)
            want_m = sum(float(np.abs(np_m[i]).sum()) for i in idx) / n  # plain step's too
            assert got["adam_m_layers"][layer] == pytest.approx(want_m, rel=1e-4)
            assert got["adam_sqrt_v_layers"][layer] == pytest.approx(v, rel=1e-5)
        assert len(got["grad_norm_layers"]) == 2


# ---------------------------------------------------------------------------------------
# MaxLogits (monitor.max_logits): the largest attention logit per layer and the fraction
# of tokens whose top output logit exceeds a bound, against a NumPy Llama forward


def _np_rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _np_rope(x, pos, theta):
    # Hugging Face's rotate_half layout: element i pairs with i + Dh/2
    dh = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
    ang = pos[:, None, :, None] * np.concatenate([inv, inv])  # [B, 1, S, Dh]
    rot = np.concatenate([-x[..., dh // 2 :], x[..., : dh // 2]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def numpy_max_logits(w, cfg, tokens, pos, seg):
    """Per layer the max of q.k/sqrt(Dh) over allowed pairs (causal, same document),
    and each token's top output logit [B, S]; float64 throughout."""
    b, s = tokens.shape
    h, kvh, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    allowed = np.tril(np.ones((s, s), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    x = w["embed.weight"][tokens]
    tops = []
    for i in range(cfg.num_layers):
        p = lambda n: w[f"layers.{i}.{n}"]  # noqa: B023,E731
        a = _np_rms(x, p("attn_norm.weight"), cfg.rms_norm_eps)
        q = (a @ p("attn.wq.weight").T).reshape(b, s, h, dh).transpose(0, 2, 1, 3)
        k = (a @ p("attn.wk.weight").T).reshape(b, s, kvh, dh).transpose(0, 2, 1, 3)
        v = (a @ p("attn.wv.weight").T).reshape(b, s, kvh, dh).transpose(0, 2, 1, 3)
        q, k = _np_rope(q, pos, cfg.rope_theta), _np_rope(k, pos, cfg.rope_theta)
        k, v = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh)  # [B, H, S, S]
        tops.append(scores[np.broadcast_to(allowed[:, None], scores.shape)].max())
        scores = np.where(allowed[:, None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, h * dh)
        x = x + o @ p("attn.wo.weight").T
        m = _np_rms(x, p("mlp_norm.weight"), cfg.rms_norm_eps)
        g = m @ p("mlp.w1.weight").T
        x = x + ((g / (1 + np.exp(-g))) * (m @ p("mlp.w3.weight").T)) @ p("mlp.w2.weight").T
    head = w.get("lm_head.weight", w["embed.weight"])
    logits = _np_rms(x, w["norm.weight"], cfg.rms_norm_eps) @ head.T
    return np.array(tops), logits.max(-1)


def test_max_logits_match_numpy_on_a_fixed_batch():
    """Llama: the log step's train graph (TrainStep over LossWithLogitStats, as the runner
    builds it) leaves NumPy's MaxLogits of the weights before its update in the buffer,
    and its loss is LlamaWithLoss's, to the bit."""
    import mindspore as ms
    from mindloom_model import Llama, LlamaWithLoss, get_preset
    from mindloom_train._numerics import loss_with_logit_stats
    from mindloom_train._step import TrainStep, decay_flags, hyper_vector
    from mindspore import Tensor

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    cfg = get_preset("debug", vocab_size=64, init_std=0.3)  # large weights: logits far from 0
    model = Llama(cfg)
    w = {p.name: p.asnumpy().astype(np.float64) for p in model.get_parameters()}
    rng = np.random.default_rng(7)
    b, s = 2, 16
    tokens = rng.integers(0, 64, (b, s)).astype(np.int32)
    labels = rng.integers(0, 64, (b, s)).astype(np.int32)
    # two documents in row 0 (positions restart), one in row 1; the last 3 tokens masked
    seg = np.zeros((b, s), np.int32)
    seg[0, 9:] = 1
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    pos[0, 9:] -= 9
    mask = np.ones((b, s), np.float32)
    mask[1, -3:] = 0.0
    want_tops, top_out = numpy_max_logits(w, cfg, tokens, pos, seg)
    # the bound halfway between two neighbouring top logits near the median: the fraction
    # is neither 0 nor 1 and no token sits within rounding of the bound
    srt = np.sort(top_out.ravel())
    at = int(np.argmax(np.diff(srt[len(srt) // 4 : 3 * len(srt) // 4]))) + len(srt) // 4
    bound = float((srt[at] + srt[at + 1]) / 2)
    want_frac = float(((top_out > bound) * mask).sum() / mask.sum())
    assert 0.1 < want_frac < 0.9, want_frac
    ins = [Tensor(x) for x in (tokens, labels, pos, seg, mask)]
    plain_loss = LlamaWithLoss(model)(*ins).asnumpy()
    net = loss_with_logit_stats(LlamaWithLoss(model), bound)
    weights = ms.ParameterTuple(model.trainable_params())
    step = TrainStep(net, weights, decay_flags(weights, False))
    hyper = hyper_vector(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                         adam_step=1, clip=1.0, spike=None, loss_scale=1.0)  # fmt: skip
    loss, _, ok, _ = step(*ins, hyper)
    assert bool(ok.asnumpy()) and loss.asnumpy() == plain_loss
    moved = model.layers[0].attn.wq.weight.asnumpy()
    assert np.abs(moved - w["layers.0.attn.wq.weight"]).max() > 1e-4  # the update happened
    got = net.stats.asnumpy()
    np.testing.assert_allclose(got[:-1], want_tops, rtol=1e-4)
    assert float(got[-1]) == pytest.approx(want_frac, abs=1e-6)
    assert len(want_tops) == 2 and abs(want_tops[0] - want_tops[1]) > 1e-3


def _np_rope_interleaved(x, pos, theta):
    # DeepSeek's layout (Hugging Face's apply_rotary_pos_emb_interleave): pairs (x0, x1),
    # (x2, x3), ... rotate by one frequency each; the result is laid out [evens', odds']
    dr = x.shape[-1]
    ang = pos[:, None, :, None] / theta ** (np.arange(0, dr, 2, dtype=np.float64) / dr)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], -1)  # fmt: skip


def numpy_mla_max_logits(w, cfg, tokens, pos, seg):
    """DeepSeek-V3 with dense layers before the last: per layer the max of q.k/sqrt(dn+dr)
    over allowed pairs, q from the LoRA'd query, k from the normalised KV latent (the
    no-RoPE part per head) and the one RoPE key shared by all heads; float64."""
    b, s = tokens.shape
    h, dn, dr, dv, r = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)  # fmt: skip
    assert cfg.rope_interleave and not cfg.rope_scaling
    allowed = np.tril(np.ones((s, s), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    x = w["embed.weight"][tokens]
    tops = []
    for i in range(cfg.num_layers):
        p = lambda n: w[f"layers.{i}.{n}"]  # noqa: B023,E731
        a = _np_rms(x, p("attn_norm.weight"), cfg.rms_norm_eps)
        q = _np_rms(a @ p("attn.q_a_proj.weight").T, p("attn.q_a_norm.weight"), 1e-6)
        q = (q @ p("attn.q_b_proj.weight").T).reshape(b, s, h, dn + dr).transpose(0, 2, 1, 3)
        q = np.concatenate(
            [q[..., :dn], _np_rope_interleaved(q[..., dn:], pos, cfg.rope_theta)], -1
        )
        ckv = a @ p("attn.kv_a_proj.weight").T  # [B, S, r + dr]
        c = _np_rms(ckv[..., :r], p("attn.kv_a_norm.weight"), 1e-6)
        k_rope = _np_rope_interleaved(ckv[:, None, :, r:], pos, cfg.rope_theta)  # [B, 1, S, dr]
        kv = (c @ p("attn.kv_b_proj.weight").T).reshape(b, s, h, dn + dv).transpose(0, 2, 1, 3)
        k = np.concatenate([kv[..., :dn], np.broadcast_to(k_rope, (b, h, s, dr))], -1)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dn + dr)  # [B, H, S, S]
        tops.append(scores[np.broadcast_to(allowed[:, None], scores.shape)].max())
        if i == cfg.num_layers - 1:
            break  # the last layer's MoE feeds no attention logit
        scores = np.where(allowed[:, None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = (probs @ kv[..., dn:]).transpose(0, 2, 1, 3).reshape(b, s, h * dv)
        x = x + o @ p("attn.wo.weight").T
        m = _np_rms(x, p("mlp_norm.weight"), cfg.rms_norm_eps)
        g = m @ p("mlp.w1.weight").T
        x = x + ((g / (1 + np.exp(-g))) * (m @ p("mlp.w3.weight").T)) @ p("mlp.w2.weight").T
    return np.array(tops)


def test_mla_max_logits_match_numpy_on_a_fixed_batch():
    """DeepSeek-V3 (MLA): layer 0 dense, layer 1 MoE (its attention logits come before its
    experts, so NumPy needs no router); the over-bound fraction against the model's own
    inference forward (`DeepseekV3.construct`), whose top logits NumPy thresholds."""
    import mindspore as ms
    from mindloom_model import DeepseekV3, get_preset
    from mindloom_train._numerics import logit_stats
    from mindspore import Tensor

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    cfg = get_preset("deepseek-v3-debug", num_layers=2, vocab_size=64, init_std=0.3,
                     num_nextn_predict_layers=0)  # fmt: skip
    model = DeepseekV3(cfg)
    w = {p.name: p.asnumpy().astype(np.float64) for p in model.get_parameters()}
    rng = np.random.default_rng(11)
    b, s = 2, 16
    tokens = rng.integers(0, 64, (b, s)).astype(np.int32)
    seg = np.zeros((b, s), np.int32)
    seg[1, 6:] = 1  # two documents in row 1, positions restart
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    pos[1, 6:] -= 6
    mask = np.ones((b, s), np.float32)
    mask[0, -4:] = 0.0
    want_tops = numpy_mla_max_logits(w, cfg, tokens, pos, seg)
    top_out = model(Tensor(tokens), Tensor(pos), Tensor(seg)).asnumpy().max(-1)
    srt = np.sort(top_out.ravel())
    at = int(np.argmax(np.diff(srt[len(srt) // 4 : 3 * len(srt) // 4]))) + len(srt) // 4
    bound = float((srt[at] + srt[at + 1]) / 2)
    want_frac = float(((top_out > bound) * mask).sum() / mask.sum())
    assert 0.1 < want_frac < 0.9, want_frac
    tops, frac = logit_stats(model, bound)(Tensor(tokens), Tensor(pos), Tensor(seg), Tensor(mask))
    np.testing.assert_allclose(tops.asnumpy(), want_tops, rtol=1e-4)
    assert float(frac.asnumpy()) == pytest.approx(want_frac, abs=1e-6)
    assert len(want_tops) == 2 and abs(want_tops[0] - want_tops[1]) > 1e-3
