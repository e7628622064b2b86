"""Quality filters, each a small step with configurable thresholds and named reasons.

Filters count *units*: whitespace-separated words for Latin script, and single characters
for CJK (Chinese has no spaces, so a "word" would be a whole sentence); in mixed text each
CJK character is a unit and each Latin word is one. Defaults follow Gopher (Rae et al. 2021)
/ FineWeb where a rule exists there; where a rule was written for English web prose and
misjudged Chinese, code, tables or verse on the labeled set
(packages/data/tests/data/filter_eval.jsonl, benchmarks/filters.py), it says below how it
differs.

A filter's `check(text, info)` returns the reason it rejects the document, or None.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, fields
from itertools import pairwise
from operator import mul

import numpy as np

_CJK = "\u2e80-\u2fdf\u3040-\u30ff\u3100-\u312f\u3190-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_HAS_CJK = re.compile(f"[{_CJK}]")
_CJK_CHAR = _HAS_CJK
_UNITS_CJK = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")
_GARBLED = re.compile(
    "[\ufffd\ue000-\uf8ff\U000f0000-\U0010ffff]|[\u00c2\u00c3][\u00a0-\u00bf]|\u00e2\u20ac"
    # the lead byte of a 3-byte UTF-8 sequence (CJK) read as Latin-1, then a continuation
    "|[\u00e0-\u00ef][\u00a0-\u00bf\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192\u02c6\u02dc\u2013-\u203a\u20ac\u2122]"
)
_P64 = np.uint64(0x100000001B3)


class TextInfo:
    """Per-document analysis shared by the filters (computed lazily, once)."""

    __slots__ = (
        "text",
        "_units",
        "_ids",
        "_lengths",
        "cjk",
        "ascii",
        "_raw",
        "_cjk_units",
        "_code",
    )

    def __init__(self, text: str):
        self.text = text
        self.ascii = text.isascii()
        self.cjk = not self.ascii and _HAS_CJK.search(text) is not None
        self._units = None
        self._ids = None
        self._lengths = None
        self._raw = None
        self._cjk_units = None
        self._code = None

    @property
    def code(self) -> bool:
        """Whether the text looks like source code (see `_looks_like_code`)."""
        if self._code is None:
            self._code = _looks_like_code(self.text)
        return self._code

    @property
    def cjk_units(self) -> int:
        """How many units are CJK characters (0 for text without CJK)."""
        if self._cjk_units is None:
            self._cjk_units = len(_CJK_CHAR.findall(self.text)) if self.cjk else 0
        return self._cjk_units

    @property
    def raw(self) -> bytes:
        """The text as bytes: ASCII (one byte per character) when `ascii`, else UTF-32."""
        if self._raw is None:
            self._raw = self.text.encode("ascii" if self.ascii else "utf-32-le")
        return self._raw

    @property
    def units(self) -> list[str]:
        if self._units is None:
            self._units = _UNITS_CJK.findall(self.text) if self.cjk else self.text.split()
        return self._units

    @property
    def ids(self) -> np.ndarray:
        """Each unit as a 64-bit value (equal units get equal values), for n-gram statistics.

        Python's str hash is salted per process, but it is only compared within one
        document, so decisions do not depend on the salt.
        """
        if self._ids is None:
            self._ids, self._lengths = _unit_arrays(self.units)
        return self._ids

    @property
    def lengths(self) -> np.ndarray:
        self.ids  # noqa: B018 - fills _lengths
        return self._lengths


_CODE_LINE = re.compile(
    r"[:;{}()\[\]\\]\s*$|^\s*(?:#|//|/\*|\*|@)|\s(?:=|==|!=|->|=>|:=|\+=)\s", re.MULTILINE
)


def _looks_like_code(text: str) -> bool:
    """At least 5 lines, 40% or more of them code-shaped: ending in `: ; { } ( ) [ ] \\`,
    starting with a comment or decorator marker, or holding an assignment or comparison."""
    lines = text.count("\n") + 1 - text.count("\n\n")
    if lines < 5:
        return False
    return len(_CODE_LINE.findall(text)) >= 0.4 * lines


def _may_have_rules(text: str) -> bool:
    """Whether to look for rule tokens: a table bar, box drawing or a doubled rule
    character. Substring tests are C-fast; the token regex (a look-behind at every
    position) is not, and a lone `-` in prose is not worth it."""
    return any(c in text for c in _RULE_HINTS) or _BOX_DRAWING.search(text) is not None


_RULE_HINTS = (
    "|",
    "--",
    "==",
    "__",
    "**",
    "~~",
    "++",
    "..",
    "##",
    "::",
    "\u2014",
    "\u2013",
    "\u2015",
)
_BOX_DRAWING = re.compile("[\u2500-\u257f]")


def _unit_arrays(units: list[str]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.fromiter(map(hash, units), np.int64, len(units)).view(np.uint64)
    return ids, np.fromiter(map(len, units), np.int64, len(units))


@dataclass
class Filter:
    name = "filter"

    def reasons(self) -> list[str]:
        return [self.name]

    def check(self, text: str, info: TextInfo) -> str | None:  # pragma: no cover
        raise NotImplementedError


@dataclass
class LengthFilter(Filter):
    """Too few or too many units, more characters than `max_chars` (e.g. a 50 MB line), or
    non-CJK words longer than `max_mean_word_length` characters on average (Gopher)."""

    min_units: int = 50
    max_units: int = 100_000
    max_chars: int = 1_000_000
    max_mean_word_length: float = 10.0
    name = "length"

    def reasons(self):
        return ["too_short", "too_long", "long_words"]

    def check(self, text, info):
        if len(text) > self.max_chars:
            return "too_long"
        n = len(info.units)
        if n < self.min_units:
            return "too_short"
        if n > self.max_units:
            return "too_long"
        # Gopher's upper bound on the mean word length (base64, hex strings, minified
        # text), over the non-CJK words only: CJK units are single characters.
        words = n - info.cjk_units
        if words and self.max_mean_word_length and not info.code:
            chars = len(text) - text.count(" ") - text.count("\n") - info.cjk_units
            if chars / words > self.max_mean_word_length:  # an upper bound: check exactly
                rest = _CJK_CHAR.sub(" ", text) if info.cjk_units else text
                # table borders and rules are drawings, not words
                # and URLs, paths and code names (`os.path`, `SSL_ERROR_EOF`, `f(x)`) are
                # names, not words
                lens = [
                    len(w)
                    for w in rest.split()
                    if w.translate(_RULE_DELETE)
                    and not _URL_OR_PATH.match(w)
                    and not _CODE_NAME.search(w)
                ]
                if lens and sum(lens) / len(lens) > self.max_mean_word_length:
                    return "long_words"
        return None


@dataclass
class RepeatedCharsFilter(Filter):
    """Too much of the text in runs of one repeated character ("!!!!!!!!!!", "aaaaaaaaaa").

    Unlike Gopher's rule, runs on a line made only of rule and table characters do not
    count: the borders and separators of tables (`+-----+`, `|-----+----|`, `├────┼────┤`)
    and underlines and rules (`=====`, `-----`), which manuals draw on purpose. A line of
    text that contains such a run (`Title ==========`) still counts.
    """

    run_length: int = 10
    max_fraction: float = 0.1
    name = "repeated_chars"

    def __post_init__(self):
        self._needle = b"\x01" * max(0, self.run_length - 1)

    def check(self, text, info):
        if len(text) < self.run_length:
            return None
        # numpy over code points: about 30x faster than a backreference regex
        a = np.frombuffer(info.raw, np.uint8 if info.ascii else np.uint32)
        same = a[1:] == a[:-1]
        # A run of `run_length` is `run_length - 1` equal neighbours in a row; most texts
        # have none, and a byte search says so faster than measuring every run.
        if self._needle not in same.tobytes():
            return None
        bounds = np.flatnonzero(np.concatenate(([True], ~same, [True])))
        lens = np.diff(bounds)
        long = lens >= self.run_length
        if not long.any():
            return None
        starts = bounds[:-1][long]
        lens = lens[long]
        codes = a[starts]
        counted = ~np.isin(codes, _SPACE_CODES)
        covered = int(lens[counted].sum())
        if covered / len(text) <= self.max_fraction:
            return None
        for i in np.flatnonzero(counted & np.isin(codes, _RULE_CODES)):
            start = int(starts[i])
            line_start = text.rfind("\n", 0, start) + 1
            line_end = text.find("\n", start)
            line = text[line_start : len(text) if line_end < 0 else line_end]
            if not line.translate(_RULE_DELETE).strip():
                covered -= int(lens[i])
        if covered / len(text) > self.max_fraction:
            return "repeated_chars"
        return None


_CODE_NAME = re.compile(r"\w_|\.\w|\w\(")
_URL_OR_PATH = re.compile(r"[(\"'<]?(?:\w+:|/|~/|\./)")

# Characters that draw rules and table borders: ASCII ones and the Box Drawing block.
_RULE_CHARS = "-=_~*+.#|:<>\u2014\u2013\u2015\u2550" + "".join(map(chr, range(0x2500, 0x2580)))
_RULE_CODES = np.array([ord(c) for c in _RULE_CHARS], np.uint32)
_RULE_DELETE = {ord(c): None for c in _RULE_CHARS}
_RULE_TOKEN = re.compile("(?<!\\S)[" + re.escape(_RULE_CHARS) + "]+(?!\\S)")
_SPACE_CODES = np.array([9, 10, 11, 12, 13, 32, 0xA0, 0x3000], np.uint32)


@dataclass
class GarbledFilter(Filter):
    """Replacement characters (U+FFFD), private-use code points and UTF-8-as-Latin-1 mojibake
    (`Ã©`, `â€™`, and Chinese read as Latin-1: `ä¸­`): more than `max_ratio` of the
    characters, or `max_matches` occurrences or more (a long English text with a mangled
    apostrophe in every paragraph is still mangled)."""

    max_ratio: float = 0.01
    max_matches: int = 8
    name = "garbled"

    def check(self, text, info):
        if info.ascii:  # every pattern below is non-ASCII
            return None
        found = [m.end() - m.start() for m in _GARBLED.finditer(text)]
        if not found:
            return None
        if sum(found) / len(text) > self.max_ratio or len(found) >= self.max_matches > 0:
            return "garbled"
        return None


@dataclass
class SymbolFilter(Filter):
    """Gopher: hashtags and ellipses per unit above `max_symbol_ratio`; too few units with a
    letter (`few_alpha_units`).

    Two differences from Gopher, both so that code and manuals are judged like prose:

    - `#` counts only as a hashtag (after a space or tab, before a non-space): `#define`
      and `# comment` at the start of a line and `page#anchor` are not hashtags.
    - The letter rule counts each CJK character as a unit with a letter and each other
      whitespace-separated word as one unit; words made only of punctuation and symbols
      (`$`, `|`, `&&`, `>`, `--`, `，`, box drawing) are left out of the count, so the
      prompts, pipes and table borders of a manual do not outvote its sentences. A
      document whose words are all such symbols is dropped. Command blocks and table
      rows (as in `RepetitionFilter`) are left out when prose remains. Source code (see
      `_looks_like_code`: numbers, operators and hex literals are its normal words) is
      not held to the letter rule.
    """

    max_symbol_ratio: float = 0.1
    min_alpha_fraction: float = 0.8
    name = "symbols"

    def reasons(self):
        return ["symbol_ratio", "few_alpha_units"]

    def check(self, text, info):
        n = max(1, len(info.units))
        limit = self.max_symbol_ratio * n
        dots = text.count("...")
        if not info.ascii:
            dots += text.count("\u2026")
        hashes = text.count("#")
        if dots + hashes > limit:  # the cheap upper bound first
            hashes = len(_HASHTAG.findall(text)) if hashes else 0
            if dots + hashes > limit:
                return "symbol_ratio"
        if self.min_alpha_fraction > 0 and not info.code:
            if _COMMAND_START.search(text):
                # a manual's commands, their output and table rows do not decide
                prose = _COMMAND_BLOCK.sub("\n", text)
                if len(prose.split()) >= 20:
                    text, info = prose, TextInfo(prose)
            alpha, numeric = _alpha_counts(text, info)
            if alpha + numeric == 0:
                return "few_alpha_units" if info.units else None
            if alpha / (alpha + numeric) < self.min_alpha_fraction:
                return "few_alpha_units"
        return None


_HASHTAG = re.compile("[ \t]#[^\\s#]")


def _alpha_counts(text: str, info: TextInfo) -> tuple[int, int]:
    """(units with a letter, units with a digit but no letter); symbol-only words ignored."""
    if info.ascii:
        # Letters -> "a", digits -> "0", whitespace -> " ", everything else deleted: a
        # word with a letter keeps an "a", a symbol-only word vanishes.
        t = info.raw.translate(_ALNUM_TABLE, _NOT_ALNUM_OR_SPACE)
        # Words start at the beginning or after a space: counted without splitting.
        words = t.count(b" a") + t.count(b" 0") + (t[:1] in (b"a", b"0"))
        t = t.translate(None, b"0")  # words with a letter keep an "a", others vanish
        alpha = t.count(b" a") + (t[:1] == b"a")
        return alpha, words - alpha
    cjk = info.cjk_units
    rest = _CJK_CHAR.sub(" ", text) if cjk else text
    alpha = len(_WORD_WITH_LETTER.findall(rest))
    return cjk + alpha, len(_WORD_WITH_ALNUM.findall(rest)) - alpha


# One match per whitespace-separated word that has a letter (or a letter or digit).
_WORD_WITH_LETTER = re.compile("\\S*?[^\\W\\d_]\\S*")
_WORD_WITH_ALNUM = re.compile("\\S*?[^\\W_]\\S*")
# The same for ASCII text, on bytes (whitespace is what str.split and \\s split on).
_ASCII_SPACE = b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f "
_ASCII_LETTERS = bytes(c for c in range(128) if chr(c).isascii() and chr(c).isalpha())
_ASCII_DIGITS = b"0123456789"
_ALNUM_TABLE = bytes(
    ord("a")
    if c in _ASCII_LETTERS
    else ord("0")
    if c in _ASCII_DIGITS
    else 32
    if c in _ASCII_SPACE
    else c
    for c in range(256)
)
_NOT_ALNUM_OR_SPACE = bytes(
    c for c in range(256) if c not in _ASCII_LETTERS + _ASCII_DIGITS + _ASCII_SPACE
)


@dataclass
class BoilerplateFilter(Filter):
    """Pages that are mostly site furniture: `boilerplate` when at least `max_line_fraction`
    of the non-empty lines carry a boilerplate marker (C4's cookie / terms / JavaScript
    notices and their Chinese counterparts: 版权所有, ICP备, 免责声明, 分享到, ...), and
    `no_sentences` when fewer than `min_sentence_lines` of them hold any sentence or code
    punctuation (`. , ! ? ; :` and CJK ones, brackets, `=`): a navigation menu or a tag
    list. Verse, code, lists with descriptions and tables inside a manual all pass the
    second rule, which asks for any such mark anywhere in a line, not at its end (FineWeb).
    """

    max_line_fraction: float = 0.3
    min_sentence_lines: float = 0.2
    name = "boilerplate"

    def reasons(self):
        return ["boilerplate", "no_sentences"]

    def check(self, text, info):
        lines = text.count("\n") + 1
        low = text.lower()
        if _boiler_hits(low) >= self.max_line_fraction * lines:  # an upper bound first
            nonempty = [x for x in low.split("\n") if x.strip()]
            marked = sum(1 for x in nonempty if _boiler_hits(x))
            if nonempty and marked / len(nonempty) >= self.max_line_fraction:
                return "boilerplate"
        if self.min_sentence_lines > 0:
            marks = len(_SENTENCE_LINE.findall(text))
            if marks < self.min_sentence_lines * lines:
                # table rows and rules are neither sentences nor menu items
                rows = sum(
                    1
                    for x in text.split("\n")
                    if x.translate(_RULE_DELETE).strip() and x.lstrip()[0] not in _TABLE_START
                )
                if marks < self.min_sentence_lines * rows:
                    return "no_sentences"
        return None


# Lowercase markers, found with str.count (a case-insensitive regex alternation cost
# ~20x the whole filter on ordinary text).
_BOILER_MARKERS = (
    "all rights reserved", "privacy policy", "terms of use", "terms of service", "cookie",
    "javascript is", "enable javascript", "powered by", "share this", "leave a comment",
    "skip to content", "skip to main content", "back to top", "sign up for",
    "subscribe to our", "newsletter", "log in or register", "login or register",
    "版权所有", "保留所有权利", "icp备", "公网安备", "备案号", "免责声明", "侵权", "责任编辑",
    "分享到", "上一篇", "下一篇", "扫一扫", "二维码", "公众号", "加载更多", "浏览器版本",
    "返回顶部", "忘记密码", "登录 | 注册", "登录|注册",
)  # fmt: skip


def _boiler_hits(text: str) -> int:
    return sum(map(text.count, _BOILER_MARKERS))


_TABLE_START = "|\u2502\u251c\u250c\u2514"
# A line with any sentence or code punctuation (one match per such line).
_SENTENCE_LINE = re.compile(
    "^.*?[.,!?;:=(){}\\[\\]\u3001\u3002\uff01\uff0c\uff1a\uff1b\uff1f\u2026].*$", re.MULTILINE
)


@dataclass
class RepetitionFilter(Filter):
    """Gopher repetition rules: duplicate lines / paragraphs, top n-grams, duplicate n-grams.

    Fractions are of lines (or paragraphs) and of their characters; n-gram fractions are
    of the characters (of units) covered. Three differences from Gopher:

    - A duplicated line or paragraph narrower than `min_dup_width` columns (a CJK
      character is two: `else:`, `}`, `raise NotImplementedError`, a short list item or
      refrain line) is structure, not repeated content, and so is a line drawn only
      with rule characters (a table border): they count in the total but not as
      duplicates, unless one of them is more than half of all the lines.
    - Gopher's n are in words. A Chinese word is about two characters, so on text whose
      units are CJK characters the n-grams span up to twice as many units (n * (1 + the
      share of units that are CJK characters)); reasons keep Gopher's names (`dup_5gram`).
    - Verse (at least 4 lines of even length, each at most `verse_max_line` characters,
      few digits; see `_is_verse`) and source code skip the n-gram rules: a refrain ("采采芣苢，薄言采之")
      is the most repeated n-gram of its poem by design, and `raise NotImplementedError`
      may be that of an abstract class. Their duplicate lines and paragraphs are still
      counted (code: the counts only, not the characters).
    - The duplicate-n-gram rules need `min_ngram_units` units and the top-n-gram rules
      `min_top_units` (after the exclusions below), and the top n-gram must occur at
      least 3 times: in a short text one phrase said twice (a quotation, a
      cross-reference) is already 10-15% of it.
    - Command blocks (from a line starting with a `$ `, `# `, `% ` or `>>> ` prompt to the
      next blank line, and Markdown code fences), table rows (lines starting with `|`,
      or box drawing) and tokens drawn only with rule characters are left out of the
      n-gram statistics: a manual repeats commands, their output and table cells by
      nature, and its prose should decide.
    """

    max_dup_line_fraction: float = 0.3
    max_dup_para_fraction: float = 0.3
    max_dup_line_char_fraction: float = 0.2
    max_dup_para_char_fraction: float = 0.2
    top_ngram: dict = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    dup_ngram: dict = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    )
    min_dup_width: int = 30
    min_ngram_units: int = 200
    min_top_units: int = 50
    verse_max_line: int = 80
    name = "repetition"

    def __post_init__(self):
        self.top_ngram = {int(k): float(v) for k, v in self.top_ngram.items()}
        self.dup_ngram = {int(k): float(v) for k, v in sorted(self.dup_ngram.items())}

    def reasons(self):
        r = ["dup_line_fraction", "dup_line_char_fraction", "dup_para_fraction"]
        r += ["dup_para_char_fraction"]
        r += [f"top_{n}gram" for n in self.top_ngram] + [f"dup_{n}gram" for n in self.dup_ngram]
        return r

    def check(self, text, info):
        r = self._dup_blocks(text.split("\n"), "line", info) if "\n" in text else None
        if r is None and "\n\n" in text:
            r = self._dup_blocks(text.split("\n\n"), "para", info)
        if r is None:
            r = self._ngrams(info)
            # Verse and code are exempt; asked only when a rule fired, which is rare.
            if r is not None and (info.code or _is_verse(text, self.verse_max_line)):
                r = None
        return r

    def _dup_blocks(self, blocks, kind, info):
        if len(blocks) < 2:
            return None
        counts = Counter(b for b in blocks if b.strip())
        total = sum(counts.values())
        if not total or len(counts) == total:
            return None
        dups = {
            b: c
            for b, c in counts.items()
            if c > 1 and _width(b) >= self.min_dup_width and b.translate(_RULE_DELETE).strip()
        }
        dup = sum(c - 1 for c in dups.values())
        chars = sum(len(b) * (c - 1) for b, c in dups.items())
        if dup / total > getattr(self, f"max_dup_{kind}_fraction"):
            return f"dup_{kind}_fraction"
        # ...but one narrow block that is half of all the text's blocks is not structure
        block, most = counts.most_common(1)[0]
        if most >= 3 and most - 1 > total / 2 and block not in dups:
            return f"dup_{kind}_fraction"
        if info.code:  # repeated statements are idiom in code; their count still decides
            return None
        if chars / max(1, sum(map(len, blocks))) > getattr(self, f"max_dup_{kind}_char_fraction"):
            return f"dup_{kind}_char_fraction"
        return None

    def _ngrams(self, info):
        units, ids, lengths = info.units, None, None
        if _COMMAND_START.search(info.text):
            # Shell sessions and fenced code in a manual repeat commands and their output
            # (`$ ls -li foo bar baz`) by nature: the prose decides, so they are left out.
            prose = _COMMAND_BLOCK.sub("\n", info.text)
            units = _UNITS_CJK.findall(prose) if info.cjk else prose.split()
            ids, lengths = _unit_arrays(units)
        if _may_have_rules(info.text) and _RULE_TOKEN.search(info.text):
            # Table borders and rules (`|`, `+-----+`, `│`) are layout, not words: left
            # out, so that a table's repeated borders are not its most common n-gram.
            units = [u for u in units if u.translate(_RULE_DELETE)]
            ids, lengths = _unit_arrays(units)
        scale = 1 + info.cjk_units / len(units) if info.cjk and units else 1
        # (name n, n in units, limit)
        top_all = [(n, round(n * scale), lim) for n, lim in sorted(self.top_ngram.items())]
        dup_all = [(n, round(n * scale), lim) for n, lim in self.dup_ngram.items()]
        # Exact shortcuts in plain Python, which beat numpy on typical (short) documents.
        # Every rule needs an n-gram that occurs twice, and with no repeated n-gram for
        # the smallest n there is none for larger n: most short documents stop here (in
        # long ones some bigram nearly always repeats, so the test would be wasted).
        sizes = [m for _, m, _ in top_all + dup_all]
        if not sizes or len(units) <= min(sizes):
            return None
        if len(units) <= _SHORT and not _repeats(units, min(sizes)):
            return None
        # An n-gram seen c times contains each of its units at least c times, so its
        # characters times c are at most n times the largest count * length of a unit.
        top = [t for t in top_all if len(units) > t[1]] if len(units) >= self.min_top_units else []
        if top:
            counts = Counter(units)
            total = sum(map(mul, map(len, counts), counts.values()))
            if total == 0:
                return None
            most = max(map(mul, map(len, counts), counts.values()))
            top = [t for t in top if t[1] * most / total > t[2]]
        dup = (
            [t for t in dup_all if len(units) > t[1]] if len(units) >= self.min_ngram_units else []
        )
        if dup and dup[0][1] > min(sizes) and not _repeats(units, dup[0][1]):
            dup = []
        if not top and not dup:
            return None
        if ids is None:
            ids, lengths = info.ids, info.lengths
        return self._ngrams_numpy(ids, lengths, top, dup)

    def _ngrams_numpy(self, ids, lengths, top_rules, dup_rules):
        total = int(lengths.sum())
        if total == 0:
            return None
        cum = np.concatenate([[0], np.cumsum(lengths)])
        cache = [ids]  # cache[n - 1]: keys of all n-grams, each built from the previous

        def ngram_keys(n):
            while len(cache) < n:
                m = len(cache) + 1
                cache.append(cache[-1][:-1] * _P64 + ids[m - 1 :])
            return cache[n - 1]

        for name, n, limit in top_rules:
            if len(ids) <= n:
                continue
            keys = ngram_keys(n)
            chars = cum[n:] - cum[:-n]
            # Fast exact bound: the characters of all n-grams sharing a bucket are at least
            # those of the most common n-gram; only a suspicious bucket needs the real count.
            buckets = np.bincount((keys & np.uint64(1023)).astype(np.intp), chars, 1024)
            if buckets.max() <= limit * total:
                continue
            uniq, first, counts = np.unique(keys, return_index=True, return_counts=True)
            top = int(np.argmax(counts * chars[first]))
            if counts[top] >= 3 and counts[top] * int(chars[first[top]]) / total > limit:
                return f"top_{name}gram"
        for name, n, limit in dup_rules:
            if len(ids) <= n:
                break
            keys = ngram_keys(n)
            srt = np.sort(keys)
            if not (srt[1:] == srt[:-1]).any():
                break  # no repeated n-gram, so none for larger n either
            _, first = np.unique(keys, return_index=True)
            dup = np.ones(len(keys), bool)
            dup[first] = False
            pos = np.flatnonzero(dup)
            marks = np.zeros(len(ids) + 1, np.int64)
            marks[pos] += 1
            marks[pos + n] -= 1
            covered = np.cumsum(marks[:-1]) > 0
            frac = int(lengths[covered].sum()) / total
            if frac > limit:
                return f"dup_{name}gram"
            if frac <= min(self.dup_ngram.values()):
                break  # coverage only shrinks as n grows
        return None


_SHORT = 400  # units; measured: the no-repeat test pays off below, not in ~1,000-unit texts


# A command block: from a line starting with a shell or Python prompt to the next blank
# line, or a Markdown code fence.
_COMMAND_START = re.compile(r"^(?:[$%#] |>>> |```|[ \t]*[|\u2502\u251c\u250c\u2514])", re.MULTILINE)
_COMMAND_BLOCK = re.compile(
    r"(?:^|\n)(?:[$%#] |>>> ).*?(?=\n\n|\Z)|```.*?(?:```|\Z)"
    r"|(?:^|\n)[ \t]*[|\u2502\u251c\u250c\u2514][^\n]*",
    re.DOTALL,
)


def _width(line: str) -> int:
    """Display columns, a CJK character being two."""
    return len(line.strip()) + len(_CJK_CHAR.findall(line))


def _is_verse(text: str, max_line: int) -> bool:
    """Lines of verse: at least 4, none longer than `max_line` characters, of even length
    (coefficient of variation at most 0.4, or 70% of them within 40% of the median: a
    title or author line may differ), and at most one in five with a digit (a year in an
    author line)."""
    if text.count("\n") < 3:
        return False
    lines = [x for x in text.split("\n") if x.strip()]
    if len(lines) < 4:
        return False
    lens = np.fromiter(map(len, lines), np.float64, len(lines))
    if lens.max() > max_line:
        return False
    if lens.std() > 0.4 * lens.mean():
        med = np.median(lens)
        if np.count_nonzero(np.abs(lens - med) <= 0.4 * med) < 0.7 * len(lines):
            return False
    return sum(1 for x in lines if _DIGIT.search(x)) <= 0.2 * len(lines)


_DIGIT = re.compile(r"\d")


def _repeats(units: list[str], n: int) -> bool:
    """Whether some n-gram of `units` occurs more than once."""
    if n == 2:
        return len(set(pairwise(units))) < len(units) - 1
    grams = len(units) - n + 1
    return len(set(zip(*(units[i : i + grams] for i in range(n))))) < grams


FILTERS = {
    "length": LengthFilter,
    "repeated_chars": RepeatedCharsFilter,
    "garbled": GarbledFilter,
    "symbols": SymbolFilter,
    "boilerplate": BoilerplateFilter,
    "repetition": RepetitionFilter,
}


def build_filters(cfg: dict | None) -> list[Filter]:
    """Filters from a config mapping `name -> {param: value}` (or `false` to switch off).

    Every filter is on by default with its default thresholds; an unknown filter name or
    parameter raises a one-line ValueError naming it.
    """
    cfg = dict(cfg or {})
    out = []
    for key in cfg:
        if key not in FILTERS:
            raise ValueError(f"unknown filter filters.{key} (known: {', '.join(FILTERS)})")
    for name, cls in FILTERS.items():
        params = cfg.get(name, {})
        if params is False:
            continue
        if params is True or params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"filters.{name} must be a mapping or false")
        known = {f.name for f in fields(cls)}
        for k in params:
            if k not in known:
                raise ValueError(
                    f"unknown key filters.{name}.{k} (known: {', '.join(sorted(known))})"
                )
        out.append(cls(**params))
    return out
