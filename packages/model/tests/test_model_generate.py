"""Generation with a KV cache: greedy equals recomputation, sampling filters, stopping.

Every compiled graph is compiled once per input shape on the shared model, so the tests use
the same few shapes: prompts of PROMPT's (2, 5), single-token decode steps (2, 1), the
uncached forward at the full context (2, 32), and the re-read of half a context (2, 16)."""

import mindspore as ms
import numpy as np
import pytest
from mindloom_model import Llama, generate, get_preset
from mindloom_model._generate import sample_next
from mindspore import Tensor


@pytest.fixture(scope="module")
def model():
    # a larger init makes the argmax sensitive to every bit of context
    return Llama(get_preset("debug", init_std=0.2, embed_init_std=1.0), seed=5)


PROMPT = np.random.default_rng(2).integers(0, 256, (2, 5))


def greedy_by_recomputation(model, prompt, n):
    """Re-run the whole sequence (eagerly, no cache) and take the argmax, token by token."""
    old = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        ids = np.array(prompt, np.int32)
        for _ in range(n):
            logits = model(Tensor(ids)).asnumpy()
            ids = np.concatenate([ids, logits[:, -1].argmax(-1)[:, None].astype(np.int32)], 1)
        return ids
    finally:
        ms.set_context(mode=old)


def test_kv_cache_greedy_equals_no_cache_argmax(model):
    n = 12  # 5 + 12 tokens stay inside the 32-token context
    cached = generate(model, PROMPT, n, temperature=0)
    assert cached.shape == (2, 17)
    np.testing.assert_array_equal(cached[:, :5], PROMPT)
    np.testing.assert_array_equal(cached, greedy_by_recomputation(model, PROMPT, n))
    np.testing.assert_array_equal(
        cached, generate(model, PROMPT, n, temperature=0, use_cache=False)
    )
    assert len(set(cached[0, 5:].tolist())) > 3  # not a degenerate repetition


def test_cached_decoder_logits_equal_the_full_forward(model, graph_mode):
    # the cache path runs the model's own Block forward; a prompt of 5, then 5 single
    # tokens, each step's logits against the uncached model over the whole prefix (run at
    # the full context, right-padded: causal attention keeps the padding out of the prefix)
    from mindloom_model._generate import _decoder, _empty_cache

    ids = np.random.default_rng(4).integers(0, 256, (2, 10)).astype(np.int32)
    model.set_train(False)
    padded = np.zeros((2, model.config.max_seq_len), np.int32)
    padded[:, :10] = ids
    want = model(Tensor(padded)).asnumpy()[:, :10]
    dec = _decoder(model)
    kc, vc = _empty_cache(model, 2)
    logits, kc, vc = dec(Tensor(ids[:, :5]), Tensor(0, ms.int32), kc, vc)
    got = [logits.asnumpy()]
    for p in range(5, 10):
        logits, kc, vc = dec(Tensor(ids[:, p : p + 1]), Tensor(p, ms.int32), kc, vc)
        got.append(logits.asnumpy())
    np.testing.assert_allclose(np.concatenate(got, 1), want, rtol=0, atol=2e-5)


def test_generation_past_the_context_window_keeps_going(model):
    out = generate(model, PROMPT, 40, temperature=0)
    assert out.shape == (2, 45)
    assert out.min() >= 0 and out.max() < 256


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    a = generate(model, PROMPT, 8, temperature=1.0, seed=3)
    b = generate(model, PROMPT, 8, temperature=1.0, seed=3)
    np.testing.assert_array_equal(a, b)
    greedy = generate(model, PROMPT, 8, temperature=0)
    np.testing.assert_array_equal(
        generate(model, PROMPT, 8, temperature=1.5, top_k=1, seed=4), greedy
    )
    np.testing.assert_array_equal(
        generate(model, PROMPT, 8, temperature=1.0, top_p=1e-6, seed=4), greedy
    )


def test_eos_stops_and_pads(model):
    first = generate(model, PROMPT, 1, temperature=0)[0, -1]
    out = generate(model, PROMPT, 6, temperature=0, eos_id=int(first))
    assert out[0, 5] == first and np.all(out[0, 5:] == first)


def test_sample_next_filters():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = np.concatenate([sample_next(logits, rng, top_k=2) for _ in range(300)])
    assert set(draws.tolist()) == {0, 1}
    draws = np.concatenate([sample_next(logits, rng, top_p=0.75) for _ in range(300)])
    assert set(draws.tolist()) == {0, 1}  # 0.5 < 0.75 <= 0.8: the two most likely
    draws = np.concatenate([sample_next(logits, rng, top_p=0.81) for _ in range(300)])
    assert set(draws.tolist()) == {0, 1, 2}
    draws = np.concatenate([sample_next(logits, rng, temperature=1.0) for _ in range(2000)])
    assert np.bincount(draws, minlength=4) / 2000 == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.04)
    assert sample_next(logits, rng, temperature=0)[0] == 0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [(dict(temperature=-1), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=1.5), "top_p")],
)
def test_bad_sampling_arguments(model, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        generate(model, PROMPT, 2, **kwargs)
