"""Quality filters, each a small step with configurable thresholds and named reasons.

Filters count *units*: whitespace-separated words for Latin script, and single characters
for CJK (Chinese has no spaces, so a "word" would be a whole sentence). Defaults follow
Gopher (Rae et al. 2021) / FineWeb where a rule exists there.

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
_UNITS_CJK = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")
_GARBLED = re.compile(
    "[\ufffd\ue000-\uf8ff\U000f0000-\U0010ffff]|[\u00c2\u00c3][\u00a0-\u00bf]|\u00e2\u20ac"
)
_P64 = np.uint64(0x100000001B3)


class TextInfo:
    """Per-document analysis shared by the filters (computed lazily, once)."""

    __slots__ = ("text", "_units", "_ids", "_lengths", "cjk", "ascii", "_raw")

    def __init__(self, text: str):
        self.text = text
        self.ascii = text.isascii()
        self.cjk = not self.ascii and _HAS_CJK.search(text) is not None
        self._units = None
        self._ids = None
        self._lengths = None
        self._raw = None

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
            units = self.units
            self._ids = np.fromiter(map(hash, units), np.int64, len(units)).view(np.uint64)
            self._lengths = np.fromiter(map(len, units), np.int64, len(units))
        return self._ids

    @property
    def lengths(self) -> np.ndarray:
        self.ids  # noqa: B018 - fills _lengths
        return self._lengths


@dataclass
class Filter:
    name = "filter"

    def reasons(self) -> list[str]:
        return [self.name]

    def check(self, text: str, info: TextInfo) -> str | None:  # pragma: no cover
        raise NotImplementedError


@dataclass
class LengthFilter(Filter):
    """Too few or too many units, or more characters than `max_chars` (e.g. a 50 MB line)."""

    min_units: int = 50
    max_units: int = 100_000
    max_chars: int = 1_000_000
    name = "length"

    def reasons(self):
        return ["too_short", "too_long"]

    def check(self, text, info):
        if len(text) > self.max_chars:
            return "too_long"
        n = len(info.units)
        if n < self.min_units:
            return "too_short"
        if n > self.max_units:
            return "too_long"
        return None


@dataclass
class RepeatedCharsFilter(Filter):
    """Too much of the text in runs of one repeated character ("!!!!!!!!!!", "=========")."""

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
        covered = int(lens[long][~np.isin(a[starts], _SPACE_CODES)].sum())
        if covered / len(text) > self.max_fraction:
            return "repeated_chars"
        return None


_SPACE_CODES = np.array([9, 10, 11, 12, 13, 32, 0xA0, 0x3000], np.uint32)


@dataclass
class GarbledFilter(Filter):
    """Replacement characters (U+FFFD), private-use code points and UTF-8-as-Latin-1 mojibake."""

    max_ratio: float = 0.01
    name = "garbled"

    def check(self, text, info):
        if info.ascii:  # every pattern below is non-ASCII
            return None
        bad = sum(m.end() - m.start() for m in _GARBLED.finditer(text))
        if bad and bad / max(1, len(text)) > self.max_ratio:
            return "garbled"
        return None


@dataclass
class SymbolFilter(Filter):
    """Gopher: '#' and ellipses per unit above `max_symbol_ratio`; too few units with a letter."""

    max_symbol_ratio: float = 0.1
    min_alpha_fraction: float = 0.8
    name = "symbols"

    def reasons(self):
        return ["symbol_ratio", "few_alpha_units"]

    def check(self, text, info):
        n = max(1, len(info.units))
        symbols = text.count("#") + text.count("...")
        if not info.ascii:
            symbols += text.count("\u2026")
        if symbols / n > self.max_symbol_ratio:
            return "symbol_ratio"
        if self.min_alpha_fraction > 0:
            if info.ascii:
                # Drop every byte that is neither a letter nor a space: a word that had a
                # letter keeps one, the others vanish; words left = words with a letter.
                t = info.raw.translate(_ALPHA_TABLE, _NOT_ALPHA_OR_SPACE)
                nonalpha = len(info.units) - t.count(b" a") - t.startswith(b"a")
            else:
                # CJK text: units are characters, so count runs of non-letters between them.
                pattern = _NONALPHA_RUN if info.cjk else _NONALPHA_TOKEN
                nonalpha = len(pattern.findall(text))
            if 1 - nonalpha / n < self.min_alpha_fraction:
                return "few_alpha_units"
        return None


# "Has a letter": an ASCII letter or any character from Latin-1 letters upwards, which
# is cheap to test with one regex over the whole text and close enough for this rule.
_NONALPHA_RUN = re.compile("[^\\sA-Za-z\u00c0-\U0010ffff]+")
_NONALPHA_TOKEN = re.compile("(?<!\\S)[^\\sA-Za-z\u00c0-\U0010ffff]+(?!\\S)")
# The same for ASCII text, on bytes: letters -> "a", whitespace (what str.split and the
# regex's \s split on) -> " ", everything else deleted.
_ASCII_SPACE = b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f "
_ASCII_LETTERS = bytes(c for c in range(128) if chr(c).isascii() and chr(c).isalpha())
_ALPHA_TABLE = bytes(
    ord("a") if c in _ASCII_LETTERS else 32 if c in _ASCII_SPACE else c for c in range(256)
)
_NOT_ALPHA_OR_SPACE = bytes(c for c in range(256) if c not in _ASCII_LETTERS + _ASCII_SPACE)


@dataclass
class RepetitionFilter(Filter):
    """Gopher repetition rules: duplicate lines / paragraphs, top n-grams, duplicate n-grams.

    Fractions are of lines (or paragraphs) and of their characters; n-gram fractions are
    of the characters (of units) covered.
    """

    max_dup_line_fraction: float = 0.3
    max_dup_para_fraction: float = 0.3
    max_dup_line_char_fraction: float = 0.2
    max_dup_para_char_fraction: float = 0.2
    top_ngram: dict = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    dup_ngram: dict = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    )
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
        r = self._dup_blocks(text.split("\n"), "line") if "\n" in text else None
        if r is None and "\n\n" in text:
            r = self._dup_blocks(text.split("\n\n"), "para")
        if r is None:
            r = self._ngrams(info)
        return r

    def _dup_blocks(self, blocks, kind):
        if len(blocks) < 2:
            return None
        counts = Counter(b for b in blocks if b.strip())
        total = sum(counts.values())
        if not total or len(counts) == total:
            return None
        dup = sum(c - 1 for c in counts.values())
        chars = sum(len(b) * (c - 1) for b, c in counts.items())
        if dup / total > getattr(self, f"max_dup_{kind}_fraction"):
            return f"dup_{kind}_fraction"
        if chars / max(1, sum(map(len, blocks))) > getattr(self, f"max_dup_{kind}_char_fraction"):
            return f"dup_{kind}_char_fraction"
        return None

    def _ngrams(self, info):
        units = info.units
        # Exact shortcuts in plain Python, which beat numpy on typical (short) documents.
        # Every rule needs an n-gram that occurs twice, and with no repeated n-gram for
        # the smallest n there is none for larger n: most short documents stop here (in
        # long ones some bigram nearly always repeats, so the test would be wasted).
        sizes = [*self.top_ngram, *self.dup_ngram]
        if not sizes or len(units) <= min(sizes):
            return None
        if len(units) <= _SHORT and not _repeats(units, min(sizes)):
            return None
        # An n-gram seen c times contains each of its units at least c times, so its
        # characters times c are at most n times the largest count * length of a unit.
        top = [(n, limit) for n, limit in sorted(self.top_ngram.items()) if len(units) > n]
        if top:
            counts = Counter(units)
            total = sum(map(mul, map(len, counts), counts.values()))
            if total == 0:
                return None
            most = max(map(mul, map(len, counts), counts.values()))
            top = [(n, limit) for n, limit in top if n * most / total > limit]
        n0 = min(self.dup_ngram, default=0)
        dup = bool(self.dup_ngram) and len(units) > n0
        if dup and n0 > min(sizes):
            dup = _repeats(units, n0)
        if not top and not dup:
            return None
        return self._ngrams_numpy(info, dict(top), dup)

    def _ngrams_numpy(self, info, top_ngram, check_dup):
        ids, lengths = info.ids, info.lengths
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

        for n, limit in sorted(top_ngram.items()):
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
            if counts[top] >= 2 and counts[top] * int(chars[first[top]]) / total > limit:
                return f"top_{n}gram"
        for n, limit in self.dup_ngram.items() if check_dup else ():
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
                return f"dup_{n}gram"
            if frac <= min(self.dup_ngram.values()):
                break  # coverage only shrinks as n grows
        return None


_SHORT = 400  # units; measured: the no-repeat test pays off below, not in ~1,000-unit texts


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
