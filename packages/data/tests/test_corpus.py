from mindloom_data import bundled_corpus


def test_bundled_corpus_is_shakespeare():
    path = bundled_corpus()
    text = path.read_text(encoding="utf-8")
    assert len(text) > 1_000_000
    assert text.startswith("First Citizen:")
