"""A pipeline stage is the model itself with parts removed: the stages of any split,
run one after the other in one process, give the whole model's logits (and its loss
gradient path), untied and tied."""

import mindspore as ms
import numpy as np
import pytest
from mindloom_model import Llama, get_preset
from mindloom_parallel import pipeline_stage, stage_layers
from mindspore import Tensor

RNG = np.random.default_rng(0)
TOKENS = Tensor(RNG.integers(0, 256, (2, 16)).astype(np.int32))
# two packed documents per row: the stages must apply the same masks and positions
SEGMENTS = Tensor(np.repeat([[0] * 9 + [1] * 7], 2, 0).astype(np.int32))
POSITIONS = Tensor(np.repeat([list(range(9)) + list(range(7))], 2, 0).astype(np.int32))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [2, 4])
def test_stages_compose_to_the_whole_models_logits(pp, tied):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = get_preset("debug", num_layers=4, tie_embeddings=tied)
    whole = Llama(cfg, seed=7)
    whole.set_train(False)
    want = whole(TOKENS, POSITIONS, SEGMENTS).asnumpy()
    x = TOKENS
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        ids = stage_layers(cfg.num_layers, pp, stage)
        model = pipeline_stage(Llama(cfg, seed=7), ids, first, last)
        model.set_train(False)
        names = [n for n, _ in model.parameters_and_names()]
        assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {str(i) for i in ids}
        assert ("embed.weight" in names) == (first or (last and tied))
        assert ("norm.weight" in names) == last
        assert [p.name for p in model.get_parameters()] == names
        x = model(x, POSITIONS, SEGMENTS)
        assert x.shape == ((2, 16, cfg.vocab_size) if last else (2, 16, cfg.hidden_size))
    np.testing.assert_array_equal(x.asnumpy(), want)


def test_one_stage_over_every_layer_is_the_model_untouched():
    model = Llama(get_preset("debug"))
    layers = model.layers
    assert pipeline_stage(model, [0, 1], True, True) is model and model.layers is layers
