"""`train_tokenizer`: SentencePiece BPE / unigram with Llama-style defaults, or a `char` model.

Reading and sampling happen here, not inside SentencePiece, so that (1) every input format
of mindloom-data works, (2) memory is bounded by `input_sentence_size` whatever the corpus
size (reservoir sampling, seeded), and (3) over-long sentences are counted and reported
rather than dropped silently. The same inputs, options and seed give a byte-identical
`tokenizer.model`. Unigram training sums floating-point statistics per thread, so its
result depends on `num_threads`: the default is a fixed 16 (SentencePiece's own default),
not the machine's CPU count, so the recipe gives the same model on every machine.

The parts: `_train_read` reads and samples the corpus, `_train_backends` builds the
vocabulary (SentencePiece or `char`); this module checks the arguments and writes the
tokenizer directory.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable, Sequence

from mindloom_tokenizer.__about__ import __version__
from mindloom_tokenizer._io import write_bytes_atomic, write_json_atomic
from mindloom_tokenizer._readers import NoInputError, ReadStats, resolve_inputs
from mindloom_tokenizer._tokenizer import (
    CHAR_VOCAB_FILE,
    FORMAT_VERSION,
    HF_CONFIG_FILE,
    HF_FILE,
    META_FILE,
    MODEL_FILE,
    Tokenizer,
    TokenizerError,
)
from mindloom_tokenizer._train_backends import (
    HEARTBEAT_S,
    build_char_model,
    spm_version,
    train_sentencepiece,
)
from mindloom_tokenizer._train_read import (
    PROGRESS_EVERY_S,
    count_chars,
    empty_message,
    sample_sentences,
)

# the reader's old private name (mindloom_tokenizer._eval samples through it)
_sample_sentences = sample_sentences

__all__ = ["HEARTBEAT_S", "MODEL_TYPES", "PROGRESS_EVERY_S", "train_tokenizer"]

MODEL_TYPES = ("bpe", "unigram", "char")


def train_tokenizer(
    inputs: str | os.PathLike | Iterable[str | os.PathLike],
    out_dir: str | os.PathLike,
    vocab_size: int | None = None,
    model_type: str = "bpe",
    *,
    text_key: str = "text",
    seed: int = 0,
    character_coverage: float | None = None,
    byte_fallback: bool = True,
    split_digits: bool = True,
    normalization_rule_name: str = "identity",
    add_dummy_prefix: bool = True,
    remove_extra_whitespaces: bool = False,
    input_sentence_size: int = 2_000_000,
    max_sentence_length: int = 4192,
    max_sentencepiece_length: int = 16,
    num_threads: int = 16,
    unk_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
    pad_id: int = -1,
    unk_piece: str = "<unk>",
    bos_piece: str = "<s>",
    eos_piece: str = "</s>",
    pad_piece: str = "<pad>",
    control_symbols: Sequence[str] = (),
    user_defined_symbols: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
    verbose: bool = False,
) -> Tokenizer:
    """Train a tokenizer on `inputs` (files, directories, globs) and write it to `out_dir`.

    `model_type` is "bpe" or "unigram" (SentencePiece) or "char" (one id per character;
    `vocab_size=None` keeps every character; set all special ids to -1 for a vocabulary of
    characters only, as nanoGPT's). `control_symbols` are special tokens that `encode`
    never produces from text; `user_defined_symbols` are pieces always kept whole.
    Returns the loaded `Tokenizer`. Raises `TokenizerError` with a one-line message.
    """
    say = progress or (lambda _msg: None)
    coverage = _check_arguments(model_type, vocab_size, input_sentence_size,
                                max_sentence_length, num_threads, character_coverage)  # fmt: skip
    specials = _checked_specials(
        model_type, {unk_piece: unk_id, bos_piece: bos_id, eos_piece: eos_id, pad_piece: pad_id},
        {"unk_id": unk_id, "bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id},
        control_symbols, user_defined_symbols,
    )  # fmt: skip
    stats = ReadStats()
    files, out_dir = _inputs_and_output(inputs, out_dir, stats)

    corpus, sample_stats, read_s = _read_corpus(files, model_type, text_key, stats,
                                                input_sentence_size, max_sentence_length, seed,
                                                say)  # fmt: skip

    # SentencePiece's own option names, recorded in tokenizer.json as given
    options = dict(character_coverage=coverage, byte_fallback=byte_fallback,
                   split_digits=split_digits, normalization_rule_name=normalization_rule_name,
                   add_dummy_prefix=add_dummy_prefix,
                   remove_extra_whitespaces=remove_extra_whitespaces,
                   input_sentence_size=input_sentence_size,
                   max_sentence_length=max_sentence_length,
                   max_sentencepiece_length=max_sentencepiece_length,
                   num_threads=num_threads)  # fmt: skip
    t1 = time.monotonic()
    payload, backend, options = _build_vocabulary(
        corpus, model_type, vocab_size, seed, specials, control_symbols, user_defined_symbols,
        options, verbose, say,
    )  # fmt: skip
    del corpus
    train_s = time.monotonic() - t1

    digest = _write_model(out_dir, payload, backend)
    meta = _metadata(model_type, vocab_size, backend, specials["ids"], control_symbols,
                     user_defined_symbols, files, text_key, seed, options,
                     {"read": stats.to_dict(), **sample_stats}, digest)  # fmt: skip
    write_json_atomic(os.path.join(out_dir, META_FILE), meta)
    tok = Tokenizer.load(out_dir)
    say(f"wrote {out_dir}: {model_type}, vocab_size={tok.vocab_size:,} "
        f"(read {read_s:.1f}s, train {train_s:.1f}s)")  # fmt: skip
    return tok


def _checked_specials(model_type, pieces, ids, control_symbols, user_defined_symbols) -> dict:
    """The special pieces and ids, refused in one line when they collide or when a
    subword model would have no unknown id."""
    specials = _special_ids(pieces, ids)
    _check_symbols(control_symbols, user_defined_symbols, specials)
    if model_type != "char" and ids["unk_id"] < 0:
        raise TokenizerError(
            f"model_type {model_type!r} needs an unknown id (unk_id >= 0); only 'char' can "
            "have none"
        )
    return specials


def _inputs_and_output(inputs, out_dir, stats: ReadStats) -> tuple[list, str]:
    """The input files (unsupported ones counted in `stats`, not read) and the output
    directory, refused in one line before any reading."""
    try:
        files = resolve_inputs(inputs, stats)
    except NoInputError as exc:
        raise TokenizerError(str(exc)) from None
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise TokenizerError(f"output {out_dir} exists and is not a directory")
    return files, out_dir


def _metadata(model_type, vocab_size, backend, ids, control_symbols, user_defined_symbols,
              files, text_key, seed, options, stats, digest) -> dict:  # fmt: skip
    """tokenizer.json's record of what was trained, on what and how."""
    if model_type == "char":
        vocab_final = len(backend)  # every character seen (or the vocab_size cap)
        ids = {k: (v if v < vocab_final else -1) for k, v in ids.items()}
    else:
        vocab_final = vocab_size
    return {
        "format": "mindloom-tokenizer",
        "format_version": FORMAT_VERSION,
        "model_type": model_type,
        "vocab_size": vocab_final,
        **ids,
        "control_symbols": list(control_symbols),
        "user_defined_symbols": list(user_defined_symbols),
        "trained_on": files,
        "text_key": text_key,
        "seed": seed,
        "options": options,
        "stats": stats,
        "model_sha256": digest,
        "mindloom_tokenizer_version": __version__,
        "sentencepiece_version": spm_version(),
    }


def _check_arguments(model_type, vocab_size, input_sentence_size, max_sentence_length,
                     num_threads, character_coverage) -> float:  # fmt: skip
    """The numeric arguments, one line each; -> the character coverage to use."""
    if model_type not in MODEL_TYPES:
        raise TokenizerError(
            f"model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}"
        )
    if model_type != "char" and vocab_size is None:
        raise TokenizerError(f"vocab_size is required for model_type={model_type!r}")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise TokenizerError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if input_sentence_size < 1:
        raise TokenizerError(f"input_sentence_size must be >= 1, got {input_sentence_size}")
    if max_sentence_length < 1:
        raise TokenizerError(f"max_sentence_length must be >= 1, got {max_sentence_length}")
    if num_threads < 1:
        raise TokenizerError(f"num_threads must be >= 1, got {num_threads}")
    coverage = character_coverage
    if coverage is None:
        coverage = 1.0 if model_type == "char" else 0.99995
    if not 0.0 < coverage <= 1.0:
        raise TokenizerError(f"character_coverage must be in (0, 1], got {coverage}")
    return coverage


def _read_corpus(files, model_type, text_key, stats, input_sentence_size, max_sentence_length,
                 seed, say):  # fmt: skip
    """-> (character counts of a `char` model or the sampled sentences, the sample's stats,
    seconds spent), reported through `say`; TokenizerError when nothing usable was read."""
    t0 = time.monotonic()
    say(f"reading {len(files)} file(s)")
    if model_type == "char":
        corpus, n_chars = count_chars(files, text_key, stats, say)
        sample_stats = {"characters": n_chars, "distinct_characters": len(corpus)}
        if not corpus:
            raise TokenizerError(empty_message(files, stats))
    else:
        corpus, sample_stats = sample_sentences(
            files, text_key, stats, input_sentence_size, max_sentence_length, seed, say
        )
        if not corpus and sample_stats["skipped_too_long"]:
            raise TokenizerError(
                f"every sentence is longer than max_sentence_length={max_sentence_length} "
                f"bytes (skipped {sample_stats['skipped_too_long']} too long sentences)"
            )
        if not corpus:
            raise TokenizerError(empty_message(files, stats))
    read_s = time.monotonic() - t0
    _report_read(stats, sample_stats, model_type, read_s, input_sentence_size,
                 max_sentence_length, seed, say)  # fmt: skip
    return corpus, sample_stats, read_s


def _report_read(stats, sample_stats, model_type, read_s, input_sentence_size,
                 max_sentence_length, seed, say) -> None:  # fmt: skip
    if stats.bad:
        bad = ", ".join(f"{k}={v}" for k, v in sorted(stats.bad.items()))
        say(f"warning: skipped bad input records: {bad}")
        if stats.bad.get("unsupported_file"):
            shown = ", ".join(stats.examples["unsupported_file"])
            more = (
                " ..."
                if stats.bad["unsupported_file"] > len(stats.examples["unsupported_file"])
                else ""
            )
            say(f"warning: files of no known format, not read: {shown}{more}")
    if model_type != "char":
        say(
            f"read {stats.bytes / 1e6:.1f} MB in {read_s:.1f}s: {sample_stats['sentences_seen']:,} "
            f"sentences, sampled {sample_stats['sentences_sampled']:,} "
            f"(input_sentence_size={input_sentence_size:,}, seed={seed})"
        )
        if sample_stats["skipped_too_long"]:
            say(
                f"skipped {sample_stats['skipped_too_long']} too long sentences "
                f"(longer than max_sentence_length={max_sentence_length} bytes)"
            )


def _build_vocabulary(corpus, model_type, vocab_size, seed, specials, control_symbols,
                      user_defined_symbols, options, verbose, say):  # fmt: skip
    """-> (SentencePiece's model bytes or None, the char model or None, the options the
    metadata records)."""
    if model_type == "char":
        coverage = options["character_coverage"]
        backend = build_char_model(
            corpus, vocab_size, coverage, specials, list(control_symbols), user_defined_symbols
        )
        say(f"char vocabulary: {len(backend)} ids from {len(corpus)} distinct characters")
        return None, backend, {"character_coverage": coverage}
    say(f"training SentencePiece {model_type}, vocab_size={vocab_size:,} ...")
    payload = train_sentencepiece(
        corpus,
        model_type=model_type,
        vocab_size=vocab_size,
        seed=seed,
        specials=specials,
        control_symbols=list(control_symbols),
        user_defined_symbols=list(user_defined_symbols),
        options=options,
        verbose=verbose,
        say=say,
    )
    return payload, None, options


def _write_model(out_dir: str, payload: bytes | None, backend) -> str:
    """The model file (SentencePiece's bytes, or the char vocabulary) -> its SHA-256."""
    os.makedirs(out_dir, exist_ok=True)
    # A model of another type, or an export of an earlier model, must not survive next to
    # the new one; the metadata is written last and marks the directory complete.
    for stale in (META_FILE, HF_FILE, HF_CONFIG_FILE, MODEL_FILE, CHAR_VOCAB_FILE):
        try:
            os.unlink(os.path.join(out_dir, stale))
        except FileNotFoundError:
            pass
    if payload is not None:
        write_bytes_atomic(os.path.join(out_dir, MODEL_FILE), payload)
        return hashlib.sha256(payload).hexdigest()
    vocab_path = os.path.join(out_dir, CHAR_VOCAB_FILE)
    write_json_atomic(vocab_path, backend.to_json())
    # Hashing the vocabulary into the metadata lets tools that fingerprint only
    # mindloom_tokenizer.json notice a changed char vocabulary.
    with open(vocab_path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _special_ids(pieces: dict[str, int], ids: dict[str, int]) -> dict:
    used: dict[int, str] = {}
    for name, i in ids.items():
        if not isinstance(i, int) or i < -1:
            raise TokenizerError(f"{name} must be an integer >= -1, got {i!r}")
        if i >= 0:
            if i in used:
                raise TokenizerError(f"{name}={i} is also {used[i]}; special ids must differ")
            used[i] = name
    by_id = {i: p for p, i in pieces.items() if i >= 0}
    if len(by_id) != len(used):
        raise TokenizerError("special pieces must have distinct names")
    return {"ids": dict(ids), "by_id": by_id, "pieces": pieces}


def _check_symbols(control: Sequence[str], user: Sequence[str], specials: dict) -> None:
    seen = {p for p, i in specials["pieces"].items() if i >= 0}
    for kind, syms in (("control symbol", control), ("user-defined symbol", user)):
        if isinstance(syms, str):
            raise TokenizerError(f"{kind}s must be a list of strings, not one string")
        for s in syms:
            if not isinstance(s, str) or not s:
                raise TokenizerError(f"{kind} {s!r} must be a non-empty string")
            if s in seen:
                raise TokenizerError(f"{kind} {s!r} is given twice or is a special token")
            seen.add(s)
