import pytest
from mindloom_data._normalize import MissingExtraError, Normalizer


def test_noise_goes_punctuation_and_paragraphs_stay():
    n = Normalizer()
    raw = (
        "\ufeffHello,\u3000world!\u200b  This   is\ta \x1b[31mred\x1b[0m test...\r\n"
        "Second line; with: punctuation?\x07\n\n\n\n"
        "  New paragraph \u2014 \u201cquoted\u201d.  \n"
    )
    assert n(raw) == (
        "Hello, world! This is a red test...\n"
        "Second line; with: punctuation?\n\n"
        "New paragraph \u2014 \u201cquoted\u201d."
    )


def test_nfkc_full_width_and_chinese_punctuation():
    n = Normalizer()
    # full-width Latin and digits become ASCII; 。、 and CJK characters are kept
    assert n("ＡＢＣ１２３　中文，句子。列举、结束！") == "ABC123 中文,句子。列举、结束!"
    off = Normalizer(nfkc=False)
    assert off("ＡＢＣ　中文，") == "ＡＢＣ 中文，"  # the ideographic space is still a space


def test_switches_turn_steps_off():
    raw = "a  b\x1b[1m c\n\n\n\nd"
    assert Normalizer(whitespace=False)(raw) == "a  b c\n\n\n\nd"
    assert Normalizer(ansi=False, control=False)(raw) == "a b\x1b[1m c\n\nd"


def test_ascii_text_is_returned_unchanged():
    text = "Plain ASCII.\n\nTwo paragraphs, one line each."
    assert Normalizer()(text) == text


def test_traditional_to_simplified_needs_the_extra_or_says_so():
    try:
        import opencc  # noqa: F401
    except ImportError:
        with pytest.raises(MissingExtraError, match=r"mindloom-data\[zh\]"):
            Normalizer(zh_simplified=True)
    else:
        assert Normalizer(zh_simplified=True)("漢語與學習") == "汉语与学习"
