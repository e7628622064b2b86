"""The `repetition` filter: Gopher's repetition rules, CJK-aware and kind to verse, code
and manuals (see the README's filter table)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from operator import mul

import numpy as np

from mindloom_data._filter_base import (
    _CJK_CHAR,
    _COMMAND_BLOCK,
    _COMMAND_START,
    _P64,
    _RULE_DELETE,
    _RULE_TOKEN,
    _UNITS_CJK,
    Filter,
    _may_have_rules,
    _unit_arrays,
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
            # (each distinct unit tested once: a page repeats its words, and translate
            # on every unit was the filter's largest cost on web pages)
            rules = {u for u in set(units) if u[0] in _RULE_SET and not u.translate(_RULE_DELETE)}
            if rules:
                units = [u for u in units if u not in rules]
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


_RULE_SET = frozenset(map(chr, _RULE_DELETE))  # a rule-only unit starts with one
_SHORT = 400  # units; measured: the no-repeat test pays off below, not in ~1,000-unit texts


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
