"""`evaluate`: does a tokenizer fit a corpus?

On a reproducible random sample of N sentences (lines, reservoir-sampled with a seed):

- coverage: the share of tokens that are neither unknown nor byte fallback;
- compression: characters and UTF-8 bytes per token;
- unknown characters: those with no piece of their own (they become <unk> or bytes);
- fertility per script: tokens per word for Latin text, tokens per character for CJK,
  counting each token for the script of the first character it covers.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from mindloom_tokenizer._readers import NoInputError, ReadStats, resolve_inputs
from mindloom_tokenizer._tokenizer import Tokenizer, TokenizerError
from mindloom_tokenizer._train import _sample_sentences

DEFAULT_MIN_COVERAGE = 0.98
MAX_EVAL_SENTENCE_BYTES = 1 << 20
TOP_UNKNOWN = 30

_CJK_RANGES = (
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x3400, 0x4DBF),  # CJK Extension A
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0xAC00, 0xD7AF),  # Hangul syllables
    (0xF900, 0xFAFF),  # CJK Compatibility Ideographs
    (0x20000, 0x3134F),  # CJK Extensions B-G
)
_CJK_CLASS = "".join(f"{chr(a)}-{chr(b)}" for a, b in _CJK_RANGES)
_CJK_RE = re.compile(f"[{_CJK_CLASS}]")
_LATIN_CLASS = "A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f\u1e00-\u1eff"
_LATIN_WORD_RE = re.compile(f"[{_LATIN_CLASS}]+")


def script_of(ch: str) -> str:
    o = ord(ch)
    for a, b in _CJK_RANGES:
        if a <= o <= b:
            return "cjk"
    if ch.isalpha() and (o < 0x250 or 0x1E00 <= o <= 0x1EFF):
        return "latin"
    return "other"


def evaluate(
    tokenizer: Tokenizer | str,
    inputs,
    num_sentences: int = 10_000,
    seed: int = 0,
    text_key: str = "text",
    min_coverage: float = DEFAULT_MIN_COVERAGE,
    num_threads: int | None = None,
) -> dict:
    """Measure `tokenizer` on a seeded sample of `num_sentences` lines of `inputs`."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.load(tokenizer)
    if num_sentences < 1:
        raise TokenizerError(f"num_sentences must be >= 1, got {num_sentences}")
    stats = ReadStats()
    try:
        files = resolve_inputs(inputs, stats)  # unsupported files are counted, not read
    except NoInputError as exc:
        raise TokenizerError(str(exc)) from None
    sample, sstats = _sample_sentences(
        files, text_key, stats, num_sentences, MAX_EVAL_SENTENCE_BYTES, seed, lambda _m: None
    )
    if not sample:
        raise TokenizerError(f"no sentences to evaluate in {' '.join(files)}")

    kinds = tok.piece_kinds()
    if tok.model_type == "char":
        n_tokens, n_unk, n_byte, script_tokens = _count_char_tokens(tok, sample)
    else:
        n_tokens, n_unk, n_byte, script_tokens = _count_sentencepiece_tokens(
            tok, kinds, sample, _threads(num_threads)
        )

    n_chars = sum(len(t) for t in sample)
    n_bytes = sum(len(t.encode("utf-8")) for t in sample)
    char_counts: Counter = Counter()
    for t in sample:
        char_counts.update(t)
    unknown = _unknown_characters(tok, kinds, char_counts)
    latin_words = sum(len(_LATIN_WORD_RE.findall(t)) for t in sample)
    cjk_chars = sum(len(_CJK_RE.findall(t)) for t in sample)
    coverage = (n_tokens - n_unk - n_byte) / n_tokens if n_tokens else 1.0
    report = {
        "tokenizer": tok.path,
        "model_type": tok.model_type,
        "vocab_size": tok.vocab_size,
        "inputs": files,
        "seed": seed,
        "sentences_seen": sstats["sentences_seen"],
        "sentences": len(sample),
        "skipped_too_long": sstats["skipped_too_long"],
        "characters": n_chars,
        "bytes": n_bytes,
        "tokens": n_tokens,
        "unk_tokens": n_unk,
        "byte_fallback_tokens": n_byte,
        "coverage": coverage,
        "chars_per_token": n_chars / n_tokens if n_tokens else 0.0,
        "bytes_per_token": n_bytes / n_tokens if n_tokens else 0.0,
        "unknown_characters": unknown[:TOP_UNKNOWN],
        "unknown_character_count": len(unknown),
        "fertility": {
            "latin": {
                "tokens": script_tokens["latin"],
                "words": latin_words,
                "tokens_per_word": script_tokens["latin"] / latin_words if latin_words else None,
            },
            "cjk": {
                "tokens": script_tokens["cjk"],
                "characters": cjk_chars,
                "tokens_per_char": script_tokens["cjk"] / cjk_chars if cjk_chars else None,
            },
            "other": {"tokens": script_tokens["other"]},
        },
        "min_coverage": min_coverage,
        "ok": coverage >= min_coverage,
        "read": stats.to_dict(),
    }
    return report


def _count_char_tokens(tok: Tokenizer, sample: list[str]) -> tuple[int, int, int, Counter]:
    """(tokens, unknown, byte-fallback, tokens per script) of a char tokenizer."""
    n_tokens = n_unk = 0
    script_tokens: Counter = Counter()
    table = tok._backend._table
    for text in sample:
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = np.full(cps.shape, -1, dtype=np.int64)
        inside = cps < len(table)
        ids[inside] = table[cps[inside]]
        n_tokens += ids.size
        # Without an unknown id an unseen character cannot be encoded at all; count it
        # as unknown rather than failing the evaluation.
        n_unk += int((ids < 0).sum())
        for ch in text:
            script_tokens[script_of(ch)] += 1
    return n_tokens, n_unk, 0, script_tokens


def _count_sentencepiece_tokens(tok: Tokenizer, kinds, sample: list[str], threads: int):
    """(tokens, unknown, byte-fallback, tokens per script) of a SentencePiece model."""
    n_tokens = n_unk = n_byte = 0
    script_tokens: Counter = Counter()
    for text, proto in zip(sample, _encode_protos(tok.sentencepiece, sample, threads)):
        raw = text.encode("utf-8")
        ids = []
        for p in proto.pieces:
            ids.append(p.id)
            # Attribute a token to the first non-space character it covers. Byte
            # fallback pieces of one character all start at that character.
            chunk = raw[p.begin : max(p.end, p.begin + 4)].decode("utf-8", "ignore")
            covered = chunk[: len(raw[p.begin : p.end].decode("utf-8", "ignore"))]
            ch = covered.lstrip(" ")[:1] or chunk[:1]
            script_tokens[script_of(ch) if ch else "other"] += 1
        ids_arr = np.asarray(ids, dtype=np.int64)
        n_tokens += ids_arr.size
        n_unk += int((kinds[ids_arr] == 1).sum())
        n_byte += int((kinds[ids_arr] == 3).sum())
    return n_tokens, n_unk, n_byte, script_tokens


def _encode_protos(sp, texts: list[str], num_threads: int):
    try:
        return sp.encode(texts, return_type="proto", num_threads=num_threads)
    except (TypeError, ValueError):  # sentencepiece < 0.2.1
        return sp.encode(texts, out_type="immutable_proto", num_threads=num_threads)


def _threads(n: int | None) -> int:
    from mindloom_tokenizer._tokenizer import default_num_threads

    return default_num_threads() if n is None else n


def _unknown_characters(tok: Tokenizer, kinds: np.ndarray, counts: Counter) -> list[dict]:
    """Characters without a piece of their own, most frequent first."""
    out = []
    for ch, n in counts.items():
        if tok.model_type == "char":
            i = tok.piece_to_id(ch)
            known = i >= 0 and kinds[i] == 0
        else:
            piece = "\u2581" if ch == " " else ch
            i = tok.piece_to_id(piece)
            known = i != tok.unk_id and kinds[i] in (0, 4)
        if not known:
            out.append({"char": ch, "codepoint": f"U+{ord(ch):04X}", "count": n})
    out.sort(key=lambda d: (-d["count"], d["char"]))
    return out


def format_report(r: dict) -> str:
    """The report as a few aligned lines for the terminal."""
    fert = r["fertility"]
    lat = fert["latin"]["tokens_per_word"]
    cjk = fert["cjk"]["tokens_per_char"]
    lines = [
        f"tokenizer      {r['tokenizer']} ({r['model_type']}, vocab {r['vocab_size']:,})",
        f"sample         {r['sentences']:,} sentences (seed {r['seed']}) of "
        f"{r['sentences_seen']:,}; {r['characters']:,} chars, {r['tokens']:,} tokens",
        f"coverage       {100 * r['coverage']:.3f}%  (unk {r['unk_tokens']:,}, "
        f"byte fallback {r['byte_fallback_tokens']:,})",
        f"compression    {r['chars_per_token']:.3f} chars/token, {r['bytes_per_token']:.3f} bytes/token",
        "fertility      latin "
        + (f"{lat:.3f} tokens/word ({fert['latin']['words']:,} words)" if lat else "n/a")
        + ", cjk "
        + (f"{cjk:.3f} tokens/char ({fert['cjk']['characters']:,} chars)" if cjk else "n/a"),
    ]
    if r.get("skipped_too_long"):
        lines.append(f"skipped        {r['skipped_too_long']:,} lines over 1 MB (not sampled)")
    unk = r["unknown_characters"]
    if unk:
        shown = " ".join(f"{u['char']!r}({u['codepoint']})x{u['count']}" for u in unk[:15])
        more = r["unknown_character_count"] - min(len(unk), 15)
        lines.append(f"unknown chars  {shown}" + (f" (+{more} more)" if more > 0 else ""))
    else:
        lines.append("unknown chars  none")
    return "\n".join(lines)
