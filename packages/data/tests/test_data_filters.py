import json
import random
from collections import Counter
from pathlib import Path

import pytest
from mindloom_data._filters import (
    BoilerplateFilter,
    GarbledFilter,
    LengthFilter,
    RepeatedCharsFilter,
    RepetitionFilter,
    SymbolFilter,
    TextInfo,
    build_filters,
)
from mindloom_data._normalize import Normalizer

_EVAL_SET = Path(__file__).parent / "data" / "filter_eval.jsonl"

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
    assert _check(f, "#tag " * 20 + _prose(50)) == "symbol_ratio"
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
    # at least min_ngram_units (200) words: the duplicate-n-gram rules skip shorter texts
    chunk = _prose(25, 7)
    spam = " ".join([_prose(100, 1), chunk, _prose(40, 2), chunk, _prose(40, 3), chunk])
    assert _check(RepetitionFilter(top_ngram={}), spam).startswith("dup_")
    assert _check(f, _prose(400)) is None


def test_build_filters_validates_names_and_keys():
    names = [f.name for f in build_filters({"garbled": False, "length": {"min_units": 5}})]
    assert "garbled" not in names and "length" in names
    with pytest.raises(ValueError, match="unknown filter filters.nope"):
        build_filters({"nope": {}})
    with pytest.raises(ValueError, match="unknown key filters.length.min_word"):
        build_filters({"length": {"min_word": 3}})


def _load_eval_set():
    return [json.loads(x) for x in _EVAL_SET.read_text(encoding="utf-8").split("\n") if x]


def test_labeled_set_is_what_it_claims():
    docs = _load_eval_set()
    assert len(docs) >= 400
    assert len({d["id"] for d in docs}) == len(docs)
    for d in docs:
        assert d["label"] in {"keep", "drop"} and d["lang"] in {"zh", "en", "code", "mixed"}
        assert d["reason"] and "\n" not in d["reason"] and d["source"] and d["license"]
    langs = Counter((d["lang"], d["label"]) for d in docs)
    assert langs["zh", "keep"] + langs["zh", "drop"] + langs["mixed", "keep"] >= 150
    assert all(langs[lang, "keep"] >= 30 for lang in ("zh", "en", "code", "mixed"))


def test_default_filters_meet_the_targets_on_the_labeled_set():
    """The defaults keep >= 98% of the good documents of each language and remove >= 90%
    of the bad ones, judged on the text as `clean` gives it to them (normalized)."""
    norm, filters = Normalizer(), build_filters({})
    kept, total, wrongly_dropped = Counter(), Counter(), []
    for d in _load_eval_set():
        text = norm(d["text"])
        info = TextInfo(text)
        reason = next((r for f in filters if (r := f.check(text, info))), None)
        total[d["label"], d["lang"]] += 1
        kept[d["label"], d["lang"]] += reason is None
        if d["label"] == "keep" and reason:
            wrongly_dropped.append((d["id"], reason))
    for lang in ("zh", "mixed", "en", "code"):
        rate = kept["keep", lang] / total["keep", lang]
        assert rate >= 0.98, (lang, rate, wrongly_dropped)
    bad = sum(v for (label, _), v in total.items() if label == "drop")
    removed = bad - sum(v for (label, _), v in kept.items() if label == "drop")
    assert removed / bad >= 0.90, removed / bad


_ZH_MANUAL = """1.5.9. 命令别名

你可以为经常使用的命令设置一个别名，这样就不必每次都输入完整的命令和它的参数。
例如下面的命令把 la 定义为列出所有文件的长格式：

$ alias la='ls -la'
$ type la
la is aliased to ls -la
$ ls -la /etc/apt/sources.list.d/ /var/lib/dpkg/ 2>&1 | head -n 20
-rw-r--r-- 1 root root 2 12 2024 01 02 03 04 05 06

别名只在当前的 shell 中有效。如果想要每次登录都能使用，请把上面的定义写进
“~/.bashrc” 文件，然后重新登录或者执行 source 命令使它生效。"""


def test_cjk_characters_and_latin_words_are_counted_apart_and_commands_do_not_decide():
    f = SymbolFilter()
    assert _check(f, _ZH_MANUAL) is None
    # numbers and symbols with a few Chinese characters are still a data dump
    dump = "表 1\n" + "\n".join(" | ".join(str(i * j) for j in range(8)) for i in range(30))
    assert _check(f, dump) == "few_alpha_units"
    # prompts, pipes and redirections are symbols, not words without letters
    en = _prose(60) + " " + " ".join(["$", "|", "&&", ">", "2>&1", "--"] * 10)
    assert _check(f, en) is None
    assert _check(f, "$ | && > -- " * 30) == "few_alpha_units"


def test_hashtags_count_but_comments_and_preprocessor_lines_do_not():
    f = SymbolFilter()
    c = "\n".join(f"#define NAME_{i} {i}\n# comment about item {i}" for i in range(30))
    assert _check(f, c) is None
    assert _check(f, _prose(50) + " #sale #cheap #deal" * 5) == "symbol_ratio"


def test_repeated_chars_ignore_table_borders_and_rules_but_not_shouting():
    f = RepeatedCharsFilter()
    rows = [f"|{'name' + str(i):<12}|{'value ' * 5:<40}|" for i in range(10)]
    ascii_table = "\n".join(
        ["+" + "-" * 53 + "+"] + [r + "\n|" + "-" * 12 + "+" + "-" * 40 + "|" for r in rows]
    )
    box = ascii_table.replace("-", "\u2500").replace("+", "\u253c").replace("|", "\u2502")
    head = "Title\n" + "=" * 40 + "\n" + _prose(30) + "\n"
    for table in (ascii_table, box):
        assert _check(f, head + table) is None
    assert _check(f, _prose(30) + " Title " + "=" * 400) == "repeated_chars"
    assert _check(f, _prose(30) + "\nwow" + "!" * 300) == "repeated_chars"


_FUYI = """采采芣苢，薄言采之。采采芣苢，薄言有之。
采采芣苢，薄言掇之。采采芣苢，薄言捋之。
采采芣苢，薄言袺之。采采芣苢，薄言襭之。"""


def test_verse_with_a_refrain_passes_but_the_same_repetition_as_spam_does_not():
    f = RepetitionFilter()
    assert _check(f, "《芣苢》\n\n" + _FUYI) is None
    # the same words as one unbroken block are not verse: the top n-gram decides
    assert _check(f, _FUYI.replace("\n", "") * 2).startswith("top_")
    spam = "\n".join(
        f"代开发票联系电话13{i:09d}，代开发票微信同号，专业代开发票，刻章。" for i in range(8)
    )
    assert _check(f, spam) == "top_2gram"


def test_chinese_ngrams_span_words_not_characters():
    # a five-character phrase said three times is ordinary Chinese, not repetition...
    rng = random.Random(3)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 2500)]
    parts = ["".join(rng.choice(chars) for _ in range(60)) + "，这是一个例子。" for _ in range(6)]
    assert _check(RepetitionFilter(), "".join(parts)) is None
    # ...but a long passage pasted twice is
    assert _check(RepetitionFilter(), "".join(parts) * 2) == "dup_5gram"


def test_short_structural_lines_and_code_may_repeat_but_not_one_line_throughout():
    f = RepetitionFilter()
    code = "\n".join(
        f"class Shape{i}:\n    @abstractmethod\n    def area_{i}(self, scale_{i}):\n"
        f"        raise NotImplementedError\n    else:\n        return None"
        for i in range(12)
    )
    assert _check(f, code) is None
    assert _check(f, "\n".join(["x = x + 1"] * 40)) == "dup_line_fraction"
    assert (
        _check(f, "Intro line here\n" + "\n".join(["Transformation Format)。"] * 20))
        == "dup_line_fraction"
    )


def test_commands_and_table_rows_are_left_out_of_the_ngram_statistics():
    f = RepetitionFilter()
    commands = "\n".join(f"$ git config --global alias.a{i} status" for i in range(25))
    doc = _prose(120, 5) + "\n\n" + commands + "\n\n" + _prose(120, 6)
    assert _check(f, doc) is None
    # the same lines as prose are repetition
    assert _check(f, _prose(60, 5) + "\n" + commands.replace("$ ", "")) == "top_2gram"


def test_boilerplate_and_navigation_but_not_verse_code_or_tables():
    f = BoilerplateFilter()
    footer = "\n".join(
        [
            "Copyright 2024 Acme. All rights reserved.",
            "We use cookies to improve your experience.",
            "Privacy Policy | Terms of Use",
            "版权所有 © 2024 某某公司",
            "京ICP备12345678号",
            "Contact: 010-12345678",
        ]
    )
    assert _check(f, footer) == "boilerplate"
    menu = "\n".join(["Home", "About Us", "Products", "Blog", "Careers", "Contact", "Support"] * 4)
    assert _check(f, menu) == "no_sentences"
    assert (
        _check(f, "首页 | 关于我们 | 新闻中心 | 产品展示\n联系我们 | 在线留言 | 人才招聘")
        == "no_sentences"
    )
    assert _check(f, _FUYI) is None
    assert _check(f, "def f(x):\n    y = x + 1\n    return y\n\nclass A:\n    pass") is None
    table = "Table 1. Files\n" + "\n".join(f"| file{i} | size {i} |" for i in range(20))
    assert _check(f, table + "\nThe table lists the files.") is None
    assert _check(f, _prose(100)) is None


def test_long_words_catch_blobs_but_not_urls_paths_or_identifiers():
    import base64

    f = LengthFilter()
    blob = base64.b64encode(random.Random(1).randbytes(3000)).decode()
    assert _check(f, "\n".join(blob[i : i + 76] for i in range(0, len(blob), 76))) == "long_words"
    names = " ".join(
        f"see https://example.org/a/very/long/path/{i} and /usr/share/doc/package{i}/README "
        f"and SSL_ERROR_WANT_X509_LOOKUP_{i} or os.path.expanduser(path{i})"
        for i in range(10)
    )
    assert _check(f, _prose(60) + " " + names) is None
    constants = "\n".join(
        f"SSL_ERROR_WANT_X509_LOOKUP_{i} -- see os.path.expanduser" for i in range(40)
    )
    assert _check(f, _prose(30) + "\n" + constants) is None


def test_mojibake_of_chinese_and_repeated_mangled_apostrophes():
    f = GarbledFilter()
    zh = "中文的文本被错误地当成了拉丁字母来读取。" * 5
    assert _check(f, zh.encode("utf-8").decode("latin-1")) == "garbled"
    mangled = (_prose(40) + " don\u2019t ").encode("utf-8").decode("cp1252") * 10
    assert _check(f, mangled) == "garbled"
    assert _check(f, _prose(300) + " it\u2019s caf\u00e9 \u00e0 la carte") is None
