"""The DeepSeek-V3 family against independent references: transformers' own
DeepseekV3ForCausalLM (torch, CPU) for logits both ways, a NumPy router for routing, the
published DeepSeek-V3 parameter counts, and the uncached forward for the MLA KV cache."""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest
import torch
import transformers
from mindloom_model import (
    DeepseekV3,
    DeepseekV3WithLoss,
    ModelConfig,
    generate,
    get_preset,
    load_hf,
    moe_route_reference,
    save_hf,
    update_expert_bias,
)
from mindloom_model._deepseek import deepseek_num_params, moe_routers

ms.set_context(mode=ms.PYNATIVE_MODE)


def _hf_config(**over):
    base = dict(vocab_size=96, hidden_size=48, intermediate_size=96, moe_intermediate_size=24,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
                qk_nope_head_dim=12, n_group=4, topk_group=2, num_experts_per_tok=2,
                first_k_dense_replace=1, max_position_embeddings=32, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})  # fmt: skip
    base.update(over)
    return transformers.DeepseekV3Config(**base)


def _hf_model(cfg, seed=0, near_tie=False):
    torch.manual_seed(seed)
    m = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:  # non-trivial norm weights so their mapping matters
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for layer in m.model.layers[cfg.first_k_dense_replace :]:
            gate = layer.mlp.gate
            gate.weight.normal_(0, 0.3)
            gate.e_score_correction_bias.copy_(
                0.05 * torch.randn_like(gate.e_score_correction_bias)
            )
            if near_tie:  # experts 0 and 1 score within ~1e-3 of each other on every token
                gate.weight[1] = gate.weight[0] + 1e-3 * torch.randn_like(gate.weight[0])
    return m


def _tokens(cfg, b=2, s=20, seed=1):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, s)).astype(np.int32)


@pytest.mark.interop
@pytest.mark.parametrize(
    "variant",
    ["base", "near_tie", "no_q_lora", "yarn"],
)
def test_logits_match_transformers_both_ways(tmp_path, variant):
    over = {}
    if variant == "no_q_lora":
        over["q_lora_rank"] = None
    if variant == "yarn":
        over["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 8, "beta_fast": 32,
                                   "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}  # fmt: skip
    hcfg = _hf_config(**over)
    hf = _hf_model(hcfg, near_tie=variant == "near_tie")
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    assert isinstance(ours, DeepseekV3)
    tok = _tokens(hcfg)
    with torch.no_grad():
        ref = hf(torch.tensor(tok, dtype=torch.long)).logits.numpy()
    got = ours(ms.Tensor(tok)).asnumpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # and back: our export loads into transformers and gives the same logits
    save_hf(ours, tmp_path / "back")
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        back = again(torch.tensor(tok, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(back, ref, atol=1e-4, rtol=0)
    # config fields with non-default values survive both directions
    cfg_back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg_back["rope_parameters"]["rope_theta"] == hcfg.rope_parameters["rope_theta"]
    assert cfg_back["routed_scaling_factor"] == 2.5 and cfg_back["q_lora_rank"] == hcfg.q_lora_rank


def test_routing_matches_numpy_reference():
    cfg = get_preset("deepseek-v3-debug")
    model = DeepseekV3(cfg)
    router = moe_routers(model)[0]
    rng = np.random.default_rng(3)
    router.weight.set_data(ms.Tensor(rng.normal(0, 0.5, router.weight.shape).astype(np.float32)))
    bias = rng.normal(0, 0.1, cfg.n_routed_experts).astype(np.float32)
    router.expert_bias.set_data(ms.Tensor(bias))
    x = rng.normal(0, 1, (64, cfg.hidden_size)).astype(np.float32)
    idx, w, _ = router(ms.Tensor(x))
    idx, w = idx.asnumpy(), w.asnumpy()
    order = np.argsort(idx, -1)
    ref_ids, ref_w, ref_load = moe_route_reference(x, router.weight.asnumpy(), bias, cfg)
    np.testing.assert_array_equal(np.take_along_axis(idx, order, -1), ref_ids)
    np.testing.assert_allclose(np.take_along_axis(w, order, -1), ref_w, rtol=1e-5)
    # group limit: every token's experts lie in at most topk_group groups
    per = cfg.n_routed_experts // cfg.n_group
    assert max(len(set(row // per)) for row in ref_ids) <= cfg.topk_group
    assert ref_load.sum() == 64 * cfg.num_experts_per_tok


def test_expert_bias_update_follows_the_sign_rule_and_loads_are_counted():
    cfg = get_preset("deepseek-v3-debug", num_nextn_predict_layers=1)
    model = DeepseekV3(cfg)
    loss = DeepseekV3WithLoss(model)
    tok = _tokens(cfg, 2, 16)
    out = loss(ms.Tensor(tok), ms.Tensor(np.roll(tok, -1, 1)))
    loads = out[4].asnumpy()  # [moe layers + mtp, E]
    assert loads.shape == (cfg.num_layers - cfg.first_k_dense_replace + 1, cfg.n_routed_experts)
    assert (loads.sum(1) == tok.size * cfg.num_experts_per_tok).all()
    before = np.stack([r.expert_bias.asnumpy() for r in moe_routers(model)])
    new = update_expert_bias(model, loads, speed=0.01)
    expect = before + 0.01 * np.sign(loads.mean(1, keepdims=True) - loads)
    np.testing.assert_allclose(new, expect, rtol=0, atol=1e-7)
    np.testing.assert_allclose(
        np.stack([r.expert_bias.asnumpy() for r in moe_routers(model)]), expect
    )
    assert all(not r.expert_bias.requires_grad for r in moe_routers(model))


def test_cached_decoding_equals_uncached():
    cfg = get_preset("deepseek-v3-debug", num_layers=2)
    model = DeepseekV3(cfg, seed=5)
    prompt = _tokens(cfg, 2, 5, seed=7)
    a = generate(model, prompt, 6, temperature=0, use_cache=True)  # the compiled decoder
    # uncached greedy decoding picks, at each position, the argmax of the full forward
    # over the tokens so far: one causal forward (PyNative) gives all of them
    ms.set_context(mode=ms.PYNATIVE_MODE)
    full = model(ms.Tensor(a[:, :-1])).asnumpy()
    np.testing.assert_array_equal(full[:, 4:].argmax(-1), a[:, 5:])
    # and the cache path's logits equal the full forward's at every position
    from mindloom_model._deepseek import MLACachedDecoder, mla_empty_cache

    ms.set_context(mode=ms.PYNATIVE_MODE)
    dec = MLACachedDecoder(model)
    c, r = mla_empty_cache(model, 2)
    logits0, c, r = dec(ms.Tensor(a[:, :5]), ms.Tensor(0, ms.int32), c, r)
    steps = [logits0.asnumpy()]
    for t in range(5, 9):
        lg, c, r = dec(ms.Tensor(a[:, t : t + 1]), ms.Tensor(t, ms.int32), c, r)
        steps.append(lg.asnumpy())
    full = model(ms.Tensor(a[:, :9])).asnumpy()
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5)
    assert c.shape[-1] == cfg.kv_lora_rank and r.shape[-1] == cfg.qk_rope_head_dim


def test_mtp_loss_and_hf_round_trip_of_mtp_layers(tmp_path):
    cfg = get_preset("deepseek-v3-debug", num_nextn_predict_layers=2, mtp_loss_weight=0.5)
    model = DeepseekV3(cfg, seed=2)
    tok = _tokens(cfg, 2, 16)
    labels = np.roll(tok, -1, 1)
    loss, main, mtp, aux, _, _ = DeepseekV3WithLoss(model)(ms.Tensor(tok), ms.Tensor(labels))
    assert float(loss) == pytest.approx(float(main) + 0.5 * float(mtp), rel=1e-6)
    assert float(aux) == 0.0
    # MTP layers are written only when asked, and read back into the MTP modules
    save_hf(model, tmp_path / "plain")
    assert (
        json.loads((tmp_path / "plain" / "config.json").read_text())["num_nextn_predict_layers"]
        == 0
    )
    save_hf(model, tmp_path / "mtp", include_mtp=True)
    back = load_hf(tmp_path / "mtp")
    assert back.config.num_nextn_predict_layers == 2
    ours = {p.name: p.asnumpy() for p in model.get_parameters()}
    for p in back.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), ours[p.name], err_msg=p.name)


class _LossOnly(ms.nn.Cell):
    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net = net

    def construct(self, tokens, labels):
        return self.net(tokens, labels)[0]


def test_graph_mode_step_equals_pynative_and_capacity_counts_drops():
    """The capacity dispatch (gathers and segment sums), compiled forward+backward, gives
    the PyNative dropless dispatch's loss and gradients when its capacity holds every
    token, and counts what a small capacity drops. (The compiled dropless dispatch is
    held against transformers in the recompute test below.)"""
    cfg = get_preset("deepseek-v3-debug", num_layers=2)  # one dense, one MoE layer + MTP
    tok = _tokens(cfg, 2, 16)
    labels = np.roll(tok, -1, 1)
    cfgs = {"dropless": cfg,
            "capacity": get_preset("deepseek-v3-debug", num_layers=2, moe_capacity_factor=4.0)}  # fmt: skip
    nets = {k: DeepseekV3WithLoss(DeepseekV3(c, seed=4)) for k, c in cfgs.items()}
    out = {}

    def loss_and_grads(net):
        net.set_train(True)
        params = net.trainable_params()
        loss, grads = ms.value_and_grad(_LossOnly(net), None, params)(
            ms.Tensor(tok), ms.Tensor(labels)
        )
        return float(loss), {p.name: g.asnumpy() for p, g in zip(params, grads)}

    out["dropless"] = loss_and_grads(nets["dropless"])  # PyNative
    ms.set_context(mode=ms.GRAPH_MODE)
    try:  # one compiled forward+backward: the capacity dispatch
        out["capacity"] = loss_and_grads(nets["capacity"])
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert out["capacity"][0] == pytest.approx(out["dropless"][0], rel=1e-6)
    for name, g in out["dropless"][1].items():
        np.testing.assert_allclose(out["capacity"][1][name], g, atol=1e-6, err_msg=name)
    assert np.abs(out["dropless"][1]["layers.1.mlp.experts.w1"]).sum() > 0
    assert np.abs(out["dropless"][1]["layers.1.mlp.gate.weight"]).sum() > 0
    # capacity 0.5 of the even share: at least half of the routed pairs are dropped
    small = DeepseekV3WithLoss(
        DeepseekV3(get_preset("deepseek-v3-debug", num_layers=2, moe_capacity_factor=0.5), seed=4)
    )
    small.set_train(True)
    dropped = float(small(ms.Tensor(tok), ms.Tensor(labels))[5])
    moe_layers = 1 + 1  # the trunk MoE layer and the MTP block
    assert dropped >= moe_layers * 0.5 * tok.size * 2 - 3


class _GradCell(ms.nn.Cell):
    def __init__(self, net, params):
        super().__init__(auto_prefix=False)
        self.net = net
        self.params = ms.ParameterTuple(params)
        self.grad = ms.ops.GradOperation(get_by_list=True)

    def construct(self, tokens, labels):
        return self.net(tokens, labels), self.grad(self.net, self.params)(tokens, labels)


def _torch_loss_and_grads(hf_dir, tok, labels, cfg):
    """transformers' DeepseekV3ForCausalLM (torch autograd) on the same weights: the mean
    CE of its logits and the gradients, renamed to our parameter names (its experts are
    fused: gate_up_proj [E, 2Fm, D] = [w1; w3], down_proj [E, D, Fm] = w2)."""
    from mindloom_model._hf_deepseek import deepseek_hf_names

    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf.train()
    logits = hf(torch.tensor(tok, dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.tensor(labels, dtype=torch.long).reshape(-1)
    )
    loss.backward()
    tg = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}
    grads = {ours: tg[name] for ours, name in deepseek_hf_names(cfg, 0).items() if name in tg}
    f = cfg.moe_intermediate_size
    for i in range(cfg.first_k_dense_replace, cfg.num_layers):
        gate_up = tg[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        grads[f"layers.{i}.mlp.experts.w1"] = gate_up[:, :f]
        grads[f"layers.{i}.mlp.experts.w3"] = gate_up[:, f:]
        grads[f"layers.{i}.mlp.experts.w2"] = tg[f"model.layers.{i}.mlp.experts.down_proj"]
    return float(loss), grads


def test_recompute_gives_the_loss_and_gradients_of_transformers(tmp_path, monkeypatch):
    """recompute="full" in the compiled graph (each layer's MLA, experts and MLP rebuilt
    in the backward) and recompute="none" (PyNative)
    both give transformers' loss and gradients on the same weights; the IR shows both
    layers (the dense one and the MoE one) recomputed."""
    import re

    cfg = get_preset("deepseek-v3-debug", num_layers=2, num_nextn_predict_layers=0)  # HF: no MTP
    model = DeepseekV3(cfg, seed=4)
    save_hf(model, tmp_path / "hf")
    tok = _tokens(cfg, 2, 16)
    labels = np.roll(tok, -1, 1)
    want_loss, want = _torch_loss_and_grads(tmp_path / "hf", tok, labels, cfg)
    assert sorted(want) == sorted(p.name for p in model.trainable_params())

    def loss_and_grads(net):
        net.set_train(True)
        params = net.trainable_params()
        if ms.get_context("mode") == ms.PYNATIVE_MODE:
            loss, grads = ms.value_and_grad(_LossOnly(net), None, params)(
                ms.Tensor(tok), ms.Tensor(labels)
            )
        else:  # one compiled graph of forward and backward, as the train step builds
            loss, grads = _GradCell(_LossOnly(net), params)(ms.Tensor(tok), ms.Tensor(labels))
        return float(loss), {p.name: g.asnumpy() for p, g in zip(params, grads)}

    got = {"none": loss_and_grads(DeepseekV3WithLoss(model))}
    rc = DeepseekV3(get_preset("deepseek-v3-debug", num_layers=2, num_nextn_predict_layers=0,
                               recompute="full"), seed=4)  # fmt: skip
    monkeypatch.setenv("MS_DEV_DUMP_IR_PASSES", "graph_build")  # only the final graph
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_context(save_graphs=1, save_graphs_path=str(tmp_path / "ir"))
    try:
        got["full"] = loss_and_grads(DeepseekV3WithLoss(rc))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE, save_graphs=0)
    for mode, (loss, grads) in got.items():
        assert loss == pytest.approx(want_loss, rel=1e-5), mode
        assert sorted(grads) == sorted(want), mode
        for name, g in grads.items():
            np.testing.assert_allclose(
                g, want[name], rtol=1e-3, atol=2e-6, err_msg=f"{mode} {name}"
            )
    assert np.abs(want["layers.1.mlp.gate.weight"]).sum() > 0  # the router is trained
    ir = "".join(p.read_text(errors="ignore") for p in (tmp_path / "ir").rglob("graph_build*.ir"))
    recomputed = re.findall(r"recompute_Default/\S*?layers-CellList/(\d+)-DecoderLayer", ir)
    assert sorted(set(map(int, recomputed))) == [0, 1]


def test_published_deepseek_v3_sizes():
    cfg = get_preset("deepseek-v3-671b")
    total = deepseek_num_params(cfg, include_mtp=False)
    active = deepseek_num_params(cfg, active=True, include_mtp=False)
    # DeepSeek-V3 technical report: 671B total, 37B activated per token
    assert total / 1e9 == pytest.approx(671, rel=0.002)
    assert active / 1e9 == pytest.approx(37, rel=0.02)
    # with the MTP module (its own embedding and head copies: 2 * V * D) the release is 685B
    release = deepseek_num_params(cfg) + 2 * cfg.vocab_size * cfg.hidden_size
    assert release / 1e9 == pytest.approx(685, rel=0.002)
    assert cfg.flops_per_token(4096) > 6 * active


@pytest.mark.parametrize(
    "over, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in [1, n_routed_experts=8]"),
        ({"n_group": 3}, "n_routed_experts=8 is not divisible by n_group=3"),
        ({"topk_group": 5}, "topk_group=5 must be in [1, n_group=4]"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even (RoPE rotates pairs)"),
        ({"qk_nope_head_dim": 15}, "qk_nope_head_dim=15 must be even"),
        ({"family": "gpt"}, "family must be 'llama' or 'deepseek_v3', found 'gpt'"),
    ],
)
def test_bad_deepseek_config_is_one_line(over, message):
    with pytest.raises(ValueError) as e:
        get_preset("deepseek-v3-debug", **over)
    assert str(e.value) == f"model config: {message}"


def test_hf_directory_errors_name_the_tensor_or_key(tmp_path):
    from mindloom_model import HFFormatError

    model = DeepseekV3(get_preset("deepseek-v3-debug", num_nextn_predict_layers=0))
    save_hf(model, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    raw["model_type"] = "gpt2"
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFFormatError, match="model_type 'gpt2' is not one mindloom reads"):
        load_hf(tmp_path / "d")
    # a config that disagrees with the tensors: experts missing
    raw["model_type"] = "deepseek_v3"
    raw["n_routed_experts"] = 12
    raw["n_group"] = 4
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        HFFormatError,
        match=r"tensor 'model\.layers\.1\.mlp\.gate\.[\w.]+' has shape \[8(, 64)?\], expected \[12(, 64)?\]",
    ):
        load_hf(tmp_path / "d")
    assert isinstance(ModelConfig(family="deepseek_v3", kv_lora_rank=8, qk_nope_head_dim=8,
                                  qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=2), ModelConfig)  # fmt: skip


def test_release_layout_mtp_is_read_and_bad_tensors_are_one_line(tmp_path):
    """A checkpoint in DeepSeek's released layout, written by the `safetensors` package
    (not our codec): the MTP layer model.layers.{L}.* with its own copies of the embedding
    and head (skipped: the model shares its own) is read into our MTP module; an expert
    missing and a mis-shaped MLA projection are each one line naming the tensor."""
    from mindloom_model import HFFormatError
    from safetensors.numpy import load_file, save_file

    cfg = get_preset("deepseek-v3-debug")  # 3 layers + 1 MTP depth
    model = DeepseekV3(cfg, seed=3)
    save_hf(model, tmp_path / "ours", include_mtp=True)
    (src,) = (tmp_path / "ours").glob("*.safetensors")
    tensors = load_file(src)
    mtp = f"model.layers.{cfg.num_layers}."
    assert f"{mtp}eh_proj.weight" in tensors and f"{mtp}mlp.experts.3.up_proj.weight" in tensors
    tensors[f"{mtp}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors[f"{mtp}shared_head.head.weight"] = tensors["lm_head.weight"].copy()

    def directory(name, ts):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((tmp_path / "ours" / "config.json").read_text())
        save_file(ts, str(d / "model.safetensors"))
        return d

    back = load_hf(directory("release", tensors))
    assert back.config.num_nextn_predict_layers == 1
    ours = {p.name: p.asnumpy() for p in model.get_parameters()}
    for p in back.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), ours[p.name], err_msg=p.name)

    missing = {
        k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.5.down_proj.weight"
    }
    with pytest.raises(HFFormatError) as e:
        load_hf(directory("missing", missing))
    assert str(e.value).endswith(
        "missing tensor 'model.layers.2.mlp.experts.5.down_proj.weight' (expected shape [64, 32])"
    )
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    bad = dict(tensors, **{name: np.zeros((39, 64), np.float32)})
    with pytest.raises(HFFormatError) as e:
        load_hf(directory("misshaped", bad))
    assert str(e.value).endswith(f"tensor '{name}' has shape [39, 64], expected [40, 64]")
    assert "\n" not in str(e.value)
