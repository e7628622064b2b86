import numpy as np
import pytest
from mindloom_model import Llama, ModelConfig, get_preset, preset_names
from mindspore import Tensor


def test_presets_exist_and_match_the_issue():
    assert preset_names() == [
        "debug",
        "shakespeare-char",
        "17m",
        "llama-1b",
        "llama2-7b",
        "deepseek-v3-debug",
        "deepseek-v3-small",
        "deepseek-v3-671b",
    ]
    sc = get_preset("shakespeare-char")
    assert (sc.num_layers, sc.num_heads, sc.hidden_size, sc.max_seq_len, sc.vocab_size) == (
        4,
        4,
        128,
        64,
        65,
    )
    m17 = get_preset("17m")
    assert (m17.num_layers, m17.hidden_size, m17.num_heads, m17.max_seq_len, m17.vocab_size) == (
        6,
        384,
        6,
        256,
        8000,
    )
    assert 16e6 < m17.num_params() < 18e6
    b1 = get_preset("llama-1b")
    assert (
        b1.hidden_size,
        b1.num_layers,
        b1.num_heads,
        b1.ffn_hidden_size,
        b1.vocab_size,
        b1.max_seq_len,
    ) == (1024, 24, 16, 4096, 32000, 2048)
    assert b1.compute_dtype == "bfloat16"
    # Llama-2-7B's published parameter count
    assert get_preset("llama2-7b").num_params() == 6_738_415_616


def test_unknown_preset_is_one_line():
    with pytest.raises(ValueError, match="unknown model preset 'nope'") as e:
        get_preset("nope")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(hidden_size=64, num_heads=5), "num_heads=5 does not divide hidden_size=64"),
        (
            dict(hidden_size=64, num_heads=4, num_kv_heads=3),
            "num_kv_heads=3 does not divide num_heads=4",
        ),
        (dict(recompute="some"), "recompute must be"),
        (dict(recompute="selected", recompute_layers=[5]), "recompute_layers entry 5"),
        (dict(compute_dtype="int8"), "compute_dtype must be one of"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
    ],
)
def test_bad_config_is_one_clear_line(kwargs, needle):
    with pytest.raises(ValueError) as e:
        ModelConfig(**kwargs)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="unknown key 'hiden_size'"):
        get_preset("debug", hiden_size=3)


@pytest.mark.parametrize("tied", [False, True])
def test_num_params_matches_the_real_model(tied):
    cfg = get_preset("debug", tie_embeddings=tied)
    model = Llama(cfg)
    real = sum(p.size for p in model.get_parameters())
    assert cfg.num_params() == real
    emb = model.embed.weight.size
    assert cfg.num_params(include_embeddings=False) == real - emb
    assert hasattr(model, "lm_head") is not tied


def test_flops_per_token_formula():
    cfg = get_preset("17m")
    n = cfg.num_params(include_embeddings=False)
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 256
    assert cfg.flops_per_token(256) == 6 * n + attn
    tied = get_preset("shakespeare-char")
    # the tied head is still a matmul: counted once in the FLOPs
    head = tied.vocab_size * tied.hidden_size
    assert (
        tied.flops_per_token(64)
        == 6 * (tied.num_params(include_embeddings=False) + head) + 12 * 4 * 4 * 32 * 64
    )


def test_forward_shapes_and_dtype():
    model = Llama(get_preset("debug"))
    tokens = Tensor(np.zeros((2, 16), np.int32))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    assert str(logits.dtype) == "Float32"


def test_parameter_names_follow_the_contract():
    names = [p.name for p in Llama(get_preset("debug")).get_parameters()]
    assert names[:10] == [
        "embed.weight",
        "layers.0.attn_norm.weight",
        "layers.0.attn.wq.weight",
        "layers.0.attn.wk.weight",
        "layers.0.attn.wv.weight",
        "layers.0.attn.wo.weight",
        "layers.0.mlp_norm.weight",
        "layers.0.mlp.w1.weight",
        "layers.0.mlp.w2.weight",
        "layers.0.mlp.w3.weight",
    ]
    assert names[-2:] == ["norm.weight", "lm_head.weight"]


def test_config_presets_and_codec_import_no_mindspore():
    # a fresh interpreter: this test process has MindSpore loaded already
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import mindloom_model as m\n"
        "cfgs = [m.get_preset(n) for n in m.preset_names()]\n"
        "cfgs.append(m.ModelConfig.from_dict({'num_layers': 3}))\n"
        "assert all(c.num_params() > 0 and c.flops_per_token() > 0 for c in cfgs)\n"
        "m.SafetensorsError, m.read_safetensors, m.write_safetensors\n"
        "print('mindspore' in sys.modules, len(cfgs))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", str(len(preset_names()) + 1)], out.stderr
    # and the MindSpore names still resolve on first use
    code = "import sys, mindloom_model as m; m.Llama; print('mindspore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"], out.stderr


@pytest.mark.parametrize("tied", [False, True])
def test_tp_plan_names_the_models_modules(tied):
    # the plan is data the parallel package applies by module path: every pattern must
    # name a module of the model (the head only when it is not tied), every projection
    # must be named, and every style must be one the applier knows
    from fnmatch import fnmatchcase

    from mindloom_model import TP_STYLES, llama_tp_plan

    model = Llama(get_preset("debug", tie_embeddings=tied))
    paths = [p for p, _ in model.cells_and_names() if p]
    plan = llama_tp_plan()
    unmatched = {pat for pat in plan if not any(fnmatchcase(p, pat) for p in paths)}
    assert unmatched == ({"lm_head"} if tied else set())
    assert set(plan.values()) <= set(TP_STYLES)
    weights = [n.rsplit(".", 1)[0] for n, p in model.parameters_and_names() if p.ndim == 2]
    uncovered = [w for w in weights if not any(fnmatchcase(w, pat) for pat in plan)]
    assert uncovered == []


def test_deepseek_tp_plan_splits_heads_and_shared_experts_and_keeps_the_rest_whole():
    # issue 17 (expert_tp = 1): every pattern names a module of a DeepseekV3 with a dense
    # layer, MoE layers and an MTP block; the matrices it leaves whole are exactly the
    # vocabulary, the router, the routed experts and the MTP projection; the MLA
    # down-projections are partial_grad, and mlp_norm is a region entry only on the dense
    # layer (an entry there on a MoE layer would add the routed experts' gradient tp times)
    from fnmatch import fnmatchcase

    from mindloom_model import TP_STYLES, DeepseekV3, deepseek_tp_plan

    model = DeepseekV3(get_preset("deepseek-v3-debug", num_layers=3, first_k_dense_replace=1))
    paths = [p for p, _ in model.cells_and_names() if p]
    plan = deepseek_tp_plan(1)
    assert set(plan.values()) <= set(TP_STYLES)
    assert {pat for pat in plan if not any(fnmatchcase(p, pat) for p in paths)} == {
        "layers.*.attn.q_proj", "mtp.*.block.attn.q_proj"}  # q_lora_rank is set  # fmt: skip

    def style(path):
        return next((st for pat, st in plan.items() if fnmatchcase(path, pat)), None)

    whole = sorted({n.rsplit(".", 1)[0] for n, p in model.parameters_and_names()
                    if p.ndim >= 2 and style(n.rsplit(".", 1)[0]) is None})  # fmt: skip
    assert whole == sorted(["embed", "lm_head", "mtp.0.eh_proj"]
                           + [f"{b}.mlp.{m}" for b in ("layers.1", "layers.2", "mtp.0.block")
                              for m in ("gate", "experts")])  # fmt: skip
    assert [p for p in paths if style(p) == "region_entry" and "mlp_norm" in p] == [
        "layers.0.mlp_norm"]  # fmt: skip
    assert sorted(p for p in paths if style(p) == "partial_grad") == sorted(
        f"{b}.attn.{m}" for b in ("layers.0", "layers.1", "layers.2", "mtp.0.block")
        for m in ("q_a_proj", "q_a_norm", "kv_a_proj", "kv_a_norm"))  # fmt: skip
