"""The two ways a vocabulary is built from what was read: SentencePiece (BPE / unigram)
on the sampled sentences, with its refusals turned into one line, and the `char` model
from character counts."""

from __future__ import annotations

import io
import re
import threading
import time

from mindloom_tokenizer._tokenizer import TokenizerError, _CharModel

HEARTBEAT_S = 10.0


def build_char_model(counts, vocab_size, coverage, specials, control, user) -> _CharModel:
    if user:
        raise TokenizerError("user_defined_symbols are not supported by model_type='char'")
    by_id: dict[int, tuple[str, str]] = {}
    for i, piece in specials["by_id"].items():
        kind = "unk" if specials["ids"]["unk_id"] == i else "control"
        by_id[i] = (piece, kind)
    clash = [s for s in control if s in counts]
    if clash:
        raise TokenizerError(f"control symbol {clash[0]!r} is also a character of the corpus")
    n_fixed = len(by_id) + len(control)
    # Most frequent first (ties by code point) decides what is kept; ids then follow code
    # point order, as nanoGPT's sorted(set(text)).
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    if coverage < 1.0:
        total = sum(counts.values())
        kept, acc = [], 0
        for ch, c in ranked:
            if acc >= coverage * total:
                break
            kept.append(ch)
            acc += c
        ranked = [(ch, counts[ch]) for ch in kept]
    needed = n_fixed + len(ranked)
    if vocab_size is not None:
        if vocab_size > needed:
            raise TokenizerError(
                f"vocab size {vocab_size} is larger than this corpus supports for model_type "
                f"'char': {len(ranked)} characters + {n_fixed} special = {needed}"
            )
        if vocab_size <= n_fixed:
            raise TokenizerError(
                f"vocab size {vocab_size} leaves no room for characters after {n_fixed} special ids"
            )
        ranked = ranked[: vocab_size - n_fixed]
    if len(ranked) < len(counts) and specials["ids"]["unk_id"] < 0:
        raise TokenizerError(
            f"the char vocabulary drops {len(counts) - len(ranked)} rare characters but the "
            "model has no unknown id (set unk_id, or raise vocab_size / character_coverage)"
        )
    chars = sorted(ch for ch, _ in ranked)
    total_ids = n_fixed + len(chars)
    for i, (piece, _) in by_id.items():
        if i >= total_ids:
            raise TokenizerError(
                f"special id {i} ({piece}) is out of range for a char vocabulary of {total_ids}"
            )
    fill = iter([(s, "control") for s in control] + [(c, "char") for c in chars])
    pieces, kinds = [], []
    for i in range(total_ids):
        piece, kind = by_id[i] if i in by_id else next(fill)
        pieces.append(piece)
        kinds.append(kind)
    return _CharModel(pieces, kinds)


_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_LOW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def train_sentencepiece(
    sentences,
    *,
    model_type,
    vocab_size,
    seed,
    specials,
    control_symbols,
    user_defined_symbols,
    options,
    verbose,
    say,
) -> bytes:
    import sentencepiece as spm

    kwargs = _spm_options(model_type, vocab_size, specials, control_symbols,
                          user_defined_symbols, options, verbose)  # fmt: skip
    spm.set_random_generator_seed(seed)
    writer = io.BytesIO()
    # SentencePiece releases the GIL while it trains, so a heartbeat can show progress.
    stop = threading.Event()
    t0 = time.monotonic()

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_S):
            say(f"  training ... {time.monotonic() - t0:.0f}s")

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=writer, **kwargs
        )
    except RuntimeError as exc:
        raise _spm_error(exc, model_type) from None
    finally:
        stop.set()
        beat.join()
    return writer.getvalue()


def _spm_options(
    model_type, vocab_size, specials, control_symbols, user_defined_symbols, options, verbose
) -> dict:
    """SentencePieceTrainer's keyword arguments for what was asked."""
    ids = specials["ids"]
    pieces = specials["pieces"]
    names = {v: k for k, v in pieces.items()}
    kwargs = dict(
        model_type=model_type,
        vocab_size=vocab_size,
        character_coverage=options["character_coverage"],
        byte_fallback=options["byte_fallback"],
        split_digits=options["split_digits"],
        normalization_rule_name=options["normalization_rule_name"],
        add_dummy_prefix=options["add_dummy_prefix"],
        remove_extra_whitespaces=options["remove_extra_whitespaces"],
        max_sentence_length=options["max_sentence_length"],
        max_sentencepiece_length=options["max_sentencepiece_length"],
        num_threads=options["num_threads"],
        # We already sampled: SentencePiece takes every sentence it is given, in order.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        allow_whitespace_only_pieces=True,
        split_by_unicode_script=True,
        split_by_whitespace=True,
        split_by_number=True,
        hard_vocab_limit=True,
        unk_id=ids["unk_id"],
        bos_id=ids["bos_id"],
        eos_id=ids["eos_id"],
        pad_id=ids["pad_id"],
        unk_piece=names.get(ids["unk_id"], "<unk>"),
        bos_piece=names.get(ids["bos_id"], "<s>"),
        eos_piece=names.get(ids["eos_id"], "</s>"),
        pad_piece=names.get(ids["pad_id"], "<pad>"),
        minloglevel=0 if verbose else 2,
    )
    if control_symbols:
        kwargs["control_symbols"] = control_symbols
    if user_defined_symbols:
        kwargs["user_defined_symbols"] = user_defined_symbols
    return kwargs


def _spm_error(exc: RuntimeError, model_type: str) -> TokenizerError:
    """SentencePiece's refusal as one line (the vocabulary size it can take, if that was it)."""
    msg = " ".join(str(exc).split())
    m = _TOO_HIGH.search(msg)
    if m:
        return TokenizerError(
            f"vocab size {m.group(1)} is larger than this corpus supports for model_type "
            f"{model_type!r}: use at most {m.group(2)}"
        )
    m = _TOO_LOW.search(msg)
    if m:
        return TokenizerError(
            f"vocab size {m.group(1)} is too small: the corpus needs at least {m.group(2)} "
            "pieces (characters kept by character_coverage, byte-fallback and special pieces)"
        )
    msg = re.sub(r"^.*?\] ", "", msg)  # drop SentencePiece's C++ file/line prefix
    return TokenizerError(f"SentencePiece training failed: {msg}")


def spm_version() -> str:
    try:
        import sentencepiece

        return sentencepiece.__version__
    except Exception:  # pragma: no cover - informational only
        return "unknown"
