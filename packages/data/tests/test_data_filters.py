import random

import pytest
from mindloom_data._filters import (
    GarbledFilter,
    LengthFilter,
    RepeatedCharsFilter,
    RepetitionFilter,
    SymbolFilter,
    TextInfo,
    build_filters,
)

_rng = random.Random(0)
_VOCAB = [
    "".join(_rng.choice("abcdefghij") for _ in range(_rng.randint(3, 8))) for _ in range(3000)
]


def _prose(n, seed=0):
    rng = random.Random(seed)
    words = [rng.choice(_VOCAB) for _ in range(n)]
    sents = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, n, 12)]
    return " ".join(sents)


def _check(f, text):
    return f.check(text, TextInfo(text))


def _all(text):
    for f in build_filters({}):
        r = _check(f, text)
        if r:
            return r
    return None


def test_clean_prose_in_english_and_chinese_passes_every_default_filter():
    assert _all(_prose(300)) is None
    rng = random.Random(1)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 2500)]
    zh = "".join(
        "".join(rng.choice(chars) for _ in range(rng.randint(8, 20))) + rng.choice("，。")
        for _ in range(20)
    )
    assert _all(zh) is None


def test_length_counts_characters_for_chinese():
    f = LengthFilter(min_units=50)
    assert _check(f, "这是一个很短的句子。") == "too_short"
    assert _check(f, "中" * 60) is None  # 60 characters, no spaces: 60 units
    assert _check(f, " ".join(["word"] * 20)) == "too_short"
    assert _check(LengthFilter(max_units=100), _prose(200)) == "too_long"
    assert _check(LengthFilter(max_chars=1000), "x" * 1001) == "too_long"


def test_repeated_character_runs():
    f = RepeatedCharsFilter(run_length=10, max_fraction=0.1)
    assert _check(f, _prose(100) + " " + "!" * 200) == "repeated_chars"
    assert _check(f, _prose(100) + " !!!") is None
    assert _check(RepeatedCharsFilter(max_fraction=0.9), "=" * 50 + _prose(100)) is None


def test_garbled_text():
    f = GarbledFilter(max_ratio=0.01)
    assert _check(f, _prose(100) + "\ufffd" * 30) == "garbled"
    mojibake = "CafÃ© dÃ©jÃ  vu â€™ " * 10
    assert _check(f, _prose(50) + mojibake) == "garbled"
    assert _check(f, _prose(100) + " café déjà vu") is None


def test_symbol_ratio_and_alpha_words():
    f = SymbolFilter()
    assert _check(f, "# " * 20 + _prose(50)) == "symbol_ratio"
    assert _check(f, _prose(50) + " ..." * 20) == "symbol_ratio"
    numbers = " ".join(str(i) for i in range(100)) + " " + _prose(20)
    assert _check(f, numbers) == "few_alpha_units"
    assert _check(f, _prose(100) + " 12 34 -- (c)") is None


def test_repetition_lines_paragraphs_and_ngrams():
    f = RepetitionFilter()
    line = "Click here to subscribe to the newsletter"
    assert _check(f, "\n".join([line] * 5 + [_prose(30, s) for s in range(5)])) == (
        "dup_line_fraction"
    )
    paras = [_prose(40, s) for s in range(4)]
    assert _check(f, "\n\n".join(paras + [paras[0]] * 3)) in {
        "dup_para_fraction",
        "dup_line_fraction",
    }
    assert _check(f, ("the cat " * 200).strip()) == "top_2gram"
    chunk = _prose(12, 7)
    spam = " ".join([_prose(40, 1), chunk, _prose(20, 2), chunk, _prose(20, 3), chunk])
    assert _check(RepetitionFilter(top_ngram={}), spam).startswith("dup_")
    assert _check(f, _prose(400)) is None


def test_build_filters_validates_names_and_keys():
    names = [f.name for f in build_filters({"garbled": False, "length": {"min_units": 5}})]
    assert "garbled" not in names and "length" in names
    with pytest.raises(ValueError, match="unknown filter filters.nope"):
        build_filters({"nope": {}})
    with pytest.raises(ValueError, match="unknown key filters.length.min_word"):
        build_filters({"length": {"min_word": 3}})
