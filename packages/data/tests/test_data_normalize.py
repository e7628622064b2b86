import unicodedata

import pytest
from mindloom_data import CleanError
from mindloom_data._normalize import MissingExtraError, Normalizer
from mindloom_data._pipeline import load_config


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
    # full-width Latin and digits become ASCII; Chinese punctuation and characters stay
    assert n("ＡＢＣ１２３　中文，句子。列举、结束！") == "ABC123 中文，句子。列举、结束！"
    full = Normalizer(keep_cjk_punctuation=False)
    assert full("ＡＢＣ１２３　中文，句子。列举、结束！") == "ABC123 中文,句子。列举、结束!"
    off = Normalizer(nfkc=False)
    assert off("ＡＢＣ　中文，") == "ＡＢＣ 中文，"  # the ideographic space is still a space


def test_each_class_of_full_width_and_compatibility_character():
    """Every code point of the Halfwidth and Fullwidth Forms block, judged against the
    Unicode database: punctuation and symbols (categories P*, S*) of the full-width part
    U+FF01-FF60 stay; letters, digits and everything else get NFKC."""
    n = Normalizer(whitespace=False, control=False)
    for cp in range(0xFF01, 0xFFEF):
        ch = chr(cp)
        if unicodedata.category(ch) == "Cn":
            continue
        full_width_mark = cp <= 0xFF60 and unicodedata.category(ch)[0] in "PS"
        want = ch if full_width_mark else unicodedata.normalize("NFKC", ch)
        assert n("中" + ch + "文") == "中" + want + "文", hex(cp)
    cases = {
        "，。！？：；（）「」『』、《》【】": "，。！？：；（）「」『』、《》【】",
        "ＡＢＣｘｙｚ": "ABCxyz",  # full-width Latin letters
        "０１２３４５６７８９": "0123456789",  # full-width digits
        "甲\u3000乙": "甲 乙",  # the ideographic space
        "好……": "好……",  # the Chinese ellipsis
        "１００％～２００％": "100％～200％",  # digits change, symbols stay
        "ｶﾀｶﾅ｡｢ﾃｽﾄ｣､": "カタカナ。「テスト」、",  # half-width forms get their usual form
        "\ufb01le \u2460 \u339c": "file 1 mm",  # ligature, circled digit, squared unit
    }
    for raw, want in cases.items():
        assert Normalizer()(raw) == want, raw
    full = Normalizer(keep_cjk_punctuation=False)
    assert full("好，（甲）……") == unicodedata.normalize("NFKC", "好，（甲）……") == "好,(甲)......"


def test_private_use_characters_in_the_text_are_not_mistaken_for_placeholders():
    text = "\ue000\ue001，Ａ（\ue00b）"
    assert Normalizer()(text) == "\ue000\ue001，A（\ue00b）"


def test_normalize_config_values_are_checked_with_one_line_naming_the_key():
    assert load_config({"normalize": {"keep_cjk_punctuation": False}}).to_dict()["normalize"] == {
        **load_config(None).to_dict()["normalize"],
        "keep_cjk_punctuation": False,
    }
    with pytest.raises(
        CleanError, match=r"^normalize\.keep_cjk_punctuation must be true or false, not 'yes'$"
    ):
        load_config({"normalize": {"keep_cjk_punctuation": "yes"}})
    with pytest.raises(ValueError, match="normalize.nfkc must be true or false"):
        Normalizer(nfkc="full")


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
