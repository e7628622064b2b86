"""Export to a Hugging Face `tokenizer.json` built with the `tokenizers` library.

The export reproduces SentencePiece's ids, not just its vocabulary (tested property-based
against SentencePiece itself, see the README for the exact guarantee):

- Normalization is SentencePiece's `Normalizer::Normalize` for identity rules, on the whole
  text (no pre-tokenizer splits words; SentencePiece's models see the whole normalized
  string): spaces become U+2581, one U+2581 is prepended to non-empty text (also before a
  leading space), `remove_extra_whitespaces` strips and collapses U+0020 only. Regexes
  anchor with `\\A`/`\\z`: Oniguruma's `^` matches after every newline.
- BPE: the merges are derived from the piece scores (SentencePiece merges the pair whose
  result has the highest score; Hugging Face merges the lowest-ranked pair), so merges are
  ranked by the score of the piece they produce.
- Unigram: SentencePiece keeps control, unknown and byte pieces out of its lattice;
  `tokenizers` does not, so a split pre-tokenizer cuts each of them at a character pair
  that no normal piece contains (`_unigram_guard`).
- Control symbols (BOS, EOS, PAD, ...) are special tokens. SentencePiece never produces
  them from text; Hugging Face does when the literal string (e.g. "<s>") occurs in text,
  unless `encode_special_tokens` is set (transformers: `split_special_tokens=True`, which
  the written `tokenizer_config.json` sets). That flag is not stored in tokenizer.json.
- User-defined symbols are normalized added tokens, matched leftmost-longest as
  SentencePiece's prefix matcher does.
- No BOS/EOS are added on encode, as `Tokenizer.encode`.

Combinations `tokenizers` cannot reproduce are refused with a one-line `TokenizerError`.
`tokenizer_config.json` is written next to it so `transformers.AutoTokenizer` can load the
directory and knows the BOS/EOS/UNK/PAD tokens.
"""

from __future__ import annotations

import os

from mindloom_tokenizer._io import write_bytes_atomic, write_json_atomic
from mindloom_tokenizer._tokenizer import HF_CONFIG_FILE, HF_FILE, Tokenizer, TokenizerError

SPIECE_UNDERLINE = "\u2581"


def export_hf(
    tokenizer: Tokenizer | str | os.PathLike, out_dir: str | os.PathLike | None = None
) -> str:
    """Write `tokenizer.json` (+ `tokenizer_config.json`) and return the tokenizer.json path.

    `out_dir` defaults to the tokenizer's own directory.
    """
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.load(tokenizer)
    if out_dir is None:
        if tok.path is None:
            raise TokenizerError("give out_dir: this tokenizer was not loaded from a directory")
        out_dir = tok.path if os.path.isdir(tok.path) else os.path.dirname(tok.path) or "."
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    hf = build_hf_tokenizer(tok)
    path = os.path.join(out_dir, HF_FILE)
    write_bytes_atomic(path, hf.to_str(pretty=True).encode("utf-8"))

    def name(i: int):
        return tok.id_to_piece(i) if i >= 0 else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(tok.bos_id),
        "eos_token": name(tok.eos_id),
        "unk_token": name(tok.unk_id),
        "pad_token": name(tok.pad_id),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "model_max_length": 1_000_000_000,
    }
    write_json_atomic(os.path.join(out_dir, HF_CONFIG_FILE), config)
    return path


def build_hf_tokenizer(tok: Tokenizer):
    """A `tokenizers.Tokenizer` that encodes like `tok`."""
    if tok.model_type == "char":
        return _build_char(tok)
    return _build_sentencepiece(tok)


def _build_char(tok: Tokenizer):
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kinds = tok._backend.kinds
    pieces = tok._backend.pieces
    vocab = {p: i for i, p in enumerate(pieces)}
    unk = pieces[tok.unk_id] if tok.unk_id >= 0 else None
    # WordLevel needs an unknown token name; without one, an unseen character fails to
    # encode, as it does in `Tokenizer.encode`.
    model = models.WordLevel(vocab=vocab, unk_token=unk if unk is not None else "\x00<no-unk>")
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    specials = [
        AddedToken(p, special=True, normalized=False) for p, k in zip(pieces, kinds) if k != "char"
    ]
    hf.add_special_tokens(specials)
    hf.encode_special_tokens = True
    return hf


def _model_proto(tok: Tokenizer):
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(tok.sentencepiece.serialized_model_proto())
    return m


def _build_sentencepiece(tok: Tokenizer):
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    proto = _model_proto(tok)
    ns = proto.normalizer_spec
    ts = proto.trainer_spec
    if ns.precompiled_charsmap:
        # tokenizers' Precompiled normalizer works on grapheme clusters and loses characters
        # SentencePiece keeps, and it decides the dummy prefix after normalizing, not before.
        raise TokenizerError(
            f"export supports identity normalization only; this model uses {ns.name!r}, which "
            "tokenizers' Precompiled normalizer does not reproduce (it turns 'a\\u0308\\u0323' "
            "into 'ä', SentencePiece into 'ä\\u0323')"
        )
    if ts.treat_whitespace_as_suffix:
        raise TokenizerError("export does not support treat_whitespace_as_suffix models")
    if not ns.escape_whitespaces:
        raise TokenizerError("export does not support escape_whitespaces=false models")
    pb_type = proto.SentencePiece.Type
    normal, unknown, control, user, unused, byte = (
        pb_type.Value(n) for n in ("NORMAL", "UNKNOWN", "CONTROL", "USER_DEFINED", "UNUSED", "BYTE")
    )
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    if any(t == unused for _, _, t in pieces):
        raise TokenizerError("export does not support models with UNUSED pieces")
    user_symbols = [p for p, _, t in pieces if t == user]
    for sym in user_symbols:
        if " " in sym or SPIECE_UNDERLINE in sym:
            raise TokenizerError(
                f"export does not support user-defined symbols containing a space or U+2581: "
                f"{sym!r}"
            )
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    unk_piece = pieces[tok.unk_id][0]
    byte_fallback = bool(ts.byte_fallback)
    model_type = ts.model_type  # 1 unigram, 2 bpe, 3 word, 4 char
    pre_tokenizer = None
    if model_type == 2:
        merges = _bpe_merges(pieces, vocab, normal)
        model = models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=unk_piece,
            fuse_unk=True,
            byte_fallback=byte_fallback,
        )
    elif model_type == 1:
        model = models.Unigram(
            [(p, s) for p, s, _ in pieces], unk_id=tok.unk_id, byte_fallback=byte_fallback
        )
        pre_tokenizer = _unigram_guard(pieces, normal, (unknown, control, byte), byte_fallback)
    else:
        raise TokenizerError(
            f"export supports bpe and unigram SentencePiece models, not type {model_type}"
        )
    hf = HFTokenizer(model)
    hf.normalizer = normalizers.Sequence(_normalizer_steps(ns, user_symbols))
    if pre_tokenizer is not None:
        hf.pre_tokenizer = pre_tokenizer
    steps = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if ns.add_dummy_prefix or ns.remove_extra_whitespaces:
        # SentencePiece drops the U+2581 that starts the first piece in both cases.
        steps.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(steps)
    added = []
    for p, _, t in pieces:
        if t in (unknown, control):
            added.append(AddedToken(p, special=True, normalized=False))
        elif t == user:
            # Matched in the normalized text, as SentencePiece's model does; their content is
            # normalized by the same normalizer, so the dummy-prefix rule must leave it alone.
            added.append(AddedToken(p, special=False, normalized=True))
    hf.add_special_tokens([a for a in added if a.special])
    hf.add_tokens([a for a in added if not a.special])
    hf.encode_special_tokens = True
    return hf


def _normalizer_steps(ns, user_symbols: list[str]) -> list:
    r"""SentencePiece's `Normalizer::Normalize` for identity rules, as `tokenizers` normalizers.

    SentencePiece works on the whole text: it never splits at newlines or tabs, only U+0020
    counts as whitespace, and `^`/`$` in a `tokenizers` Regex (Oniguruma) match at every line
    break, so the rules anchor with `\A` and `\z`.
    """
    from tokenizers import Regex, normalizers

    steps = []
    if ns.remove_extra_whitespaces:
        steps += [
            normalizers.Replace(Regex(r"\A +"), ""),
            normalizers.Replace(Regex(r" {2,}"), " "),
        ]
    steps.append(normalizers.Replace(" ", SPIECE_UNDERLINE))
    if ns.remove_extra_whitespaces:
        # SentencePiece strips trailing U+2581 after escaping, literal ones included.
        steps.append(normalizers.Replace(Regex(SPIECE_UNDERLINE + r"+\z"), ""))
    if ns.add_dummy_prefix:
        # One U+2581 before any non-empty text, also before a leading space. `tokenizers`
        # normalizes the content of a user-defined symbol with this same normalizer before
        # matching it, so a text that is exactly one symbol gets no prefix (else no symbol
        # could ever match); SentencePiece gives "▁" + symbol there (see the README).
        exclude = "|".join(_onig_escape(s) for s in sorted(user_symbols, key=len, reverse=True))
        guard = rf"(?!(?:{exclude})\z)" if exclude else ""
        steps.append(normalizers.Replace(Regex(r"\A(?=[\s\S])" + guard), SPIECE_UNDERLINE))
    return steps


_ONIG_META = set(".^$*+?()[]{}|\\-/#&~")


def _onig_escape(text: str) -> str:
    # Only metacharacters: in Oniguruma an escaped letter or `<` can be an operator.
    return "".join("\\" + c if c in _ONIG_META else c for c in text)


def _unigram_guard(pieces, normal_type, hidden_types, byte_fallback):
    """Keep the `tokenizers` Unigram lattice from matching pieces SentencePiece never matches.

    SentencePiece leaves control, unknown and byte pieces (`<s>`, `<unk>`, `<0x41>`) out of
    its lattice; `tokenizers` puts every vocabulary entry in it, so the literal text `<s>`
    would become one token. For each such piece we split the text between two of its
    characters that no normal piece contains as a pair: no normal piece can cross that
    boundary anywhere, so splitting there changes nothing else, and the hidden piece can
    no longer match. Without byte fallback the split must not separate two unknown
    characters (SentencePiece fuses a run of unknowns into one `<unk>`).
    """
    from tokenizers import Regex, pre_tokenizers

    normal = [p for p, _, t in pieces if t == normal_type]
    known_chars = {p for p in normal if len(p) == 1}
    normal_pairs = set()
    for p in normal:
        normal_pairs.update(p[k : k + 2] for k in range(len(p) - 1))
    cuts = set()
    for p, _, t in pieces:
        if t not in hidden_types or len(p) < 2:
            continue
        for k in range(1, len(p)):
            pair = p[k - 1 : k + 1]
            if pair in normal_pairs:
                continue
            if not byte_fallback and pair[0] not in known_chars and pair[1] not in known_chars:
                continue
            cuts.add(pair)
            break
        else:
            raise TokenizerError(
                f"cannot export: every character pair of the piece {p!r} also occurs in normal "
                "pieces, so tokenizers would match its literal text"
            )
    if not cuts:
        return None
    alternatives = "|".join(
        _onig_escape(a) + "(?=" + _onig_escape(b) + ")" for a, b in sorted(cuts)
    )
    return pre_tokenizers.Split(Regex(alternatives), behavior="merged_with_previous")


def _bpe_merges(pieces, vocab, normal_type) -> list[tuple[str, str]]:
    """Merges ranked by the score of the piece they make (transformers' SentencePieceExtractor)."""
    merges = []
    for piece, score, t in pieces:
        if t != normal_type or len(piece) < 2:
            continue
        local = []
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        merges.extend(
            (-score, vocab[piece], n, left, right) for n, (_, _, left, right) in enumerate(local)
        )
    merges.sort()
    return [(left, right) for *_, left, right in merges]
