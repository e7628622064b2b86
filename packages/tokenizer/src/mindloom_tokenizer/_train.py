"""`train_tokenizer`: SentencePiece BPE / unigram with Llama-style defaults, or a `char` model.

Reading and sampling happen here, not inside SentencePiece, so that (1) every input format
of mindloom-data works, (2) memory is bounded by `input_sentence_size` whatever the corpus
size (reservoir sampling, seeded), and (3) over-long sentences are counted and reported
rather than dropped silently. The same inputs, options and seed give a byte-identical
`tokenizer.model`. Unigram training sums floating-point statistics per thread, so its
result depends on `num_threads`: the default is a fixed 16 (SentencePiece's own default),
not the machine's CPU count, so the recipe gives the same model on every machine.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from mindloom_tokenizer.__about__ import __version__
from mindloom_tokenizer._io import write_bytes_atomic, write_json_atomic
from mindloom_tokenizer._readers import NoInputError, ReadStats, iter_texts, resolve_inputs
from mindloom_tokenizer._tokenizer import (
    CHAR_VOCAB_FILE,
    FORMAT_VERSION,
    HF_CONFIG_FILE,
    HF_FILE,
    META_FILE,
    MODEL_FILE,
    Tokenizer,
    TokenizerError,
    _CharModel,
)

MODEL_TYPES = ("bpe", "unigram", "char")
PROGRESS_EVERY_S = 2.0
HEARTBEAT_S = 10.0


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
    specials = _special_ids(
        {unk_piece: unk_id, bos_piece: bos_id, eos_piece: eos_id, pad_piece: pad_id},
        {"unk_id": unk_id, "bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id},
    )
    _check_symbols(control_symbols, user_defined_symbols, specials)
    if model_type != "char" and unk_id < 0:
        raise TokenizerError(
            f"model_type {model_type!r} needs an unknown id (unk_id >= 0); only 'char' can "
            "have none"
        )

    stats = ReadStats()
    try:
        files = resolve_inputs(inputs, stats)  # unsupported files are counted, not read
    except NoInputError as exc:
        raise TokenizerError(str(exc)) from None
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise TokenizerError(f"output {out_dir} exists and is not a directory")

    t0 = time.monotonic()
    say(f"reading {len(files)} file(s)")
    if model_type == "char":
        char_counts, n_chars = _count_chars(files, text_key, stats, say)
        sample_stats = {"characters": n_chars, "distinct_characters": len(char_counts)}
        if not char_counts:
            raise TokenizerError(_empty_message(files, stats))
    else:
        sentences, sample_stats = _sample_sentences(
            files, text_key, stats, input_sentence_size, max_sentence_length, seed, say
        )
        if not sentences:
            if sample_stats["skipped_too_long"]:
                raise TokenizerError(
                    f"every sentence is longer than max_sentence_length={max_sentence_length} "
                    f"bytes (skipped {sample_stats['skipped_too_long']} too long sentences)"
                )
            raise TokenizerError(_empty_message(files, stats))
    read_s = time.monotonic() - t0
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

    options: dict = {
        "character_coverage": coverage,
        "byte_fallback": byte_fallback,
        "split_digits": split_digits,
        "normalization_rule_name": normalization_rule_name,
        "add_dummy_prefix": add_dummy_prefix,
        "remove_extra_whitespaces": remove_extra_whitespaces,
        "input_sentence_size": input_sentence_size,
        "max_sentence_length": max_sentence_length,
        "max_sentencepiece_length": max_sentencepiece_length,
        "num_threads": num_threads,
    }
    t1 = time.monotonic()
    if model_type == "char":
        backend = _build_char_model(
            char_counts, vocab_size, coverage, specials, list(control_symbols), user_defined_symbols
        )
        say(f"char vocabulary: {len(backend)} ids from {len(char_counts)} distinct characters")
        options = {"character_coverage": coverage}
        payload = None
    else:
        say(f"training SentencePiece {model_type}, vocab_size={vocab_size:,} ...")
        payload = _train_sentencepiece(
            sentences,
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
        del sentences
    train_s = time.monotonic() - t1

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
        digest = hashlib.sha256(payload).hexdigest()
    else:
        vocab_path = os.path.join(out_dir, CHAR_VOCAB_FILE)
        write_json_atomic(vocab_path, backend.to_json())
        # Hashing the vocabulary into the metadata lets tools that fingerprint only
        # mindloom_tokenizer.json notice a changed char vocabulary.
        with open(vocab_path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    ids = specials["ids"]
    if model_type == "char":
        vocab_final = len(backend)
        ids = {k: (v if v < vocab_final else -1) for k, v in ids.items()}
    else:
        vocab_final = vocab_size
    meta = {
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
        "stats": {"read": stats.to_dict(), **sample_stats},
        "model_sha256": digest,
        "mindloom_tokenizer_version": __version__,
        "sentencepiece_version": _spm_version(),
    }
    write_json_atomic(os.path.join(out_dir, META_FILE), meta)
    tok = Tokenizer.load(out_dir)
    say(
        f"wrote {out_dir}: {model_type}, vocab_size={tok.vocab_size:,} "
        f"(read {read_s:.1f}s, train {train_s:.1f}s)"
    )
    return tok


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


def _empty_message(files: list[str], stats: ReadStats) -> str:
    bad = ", ".join(f"{k}={v}" for k, v in sorted(stats.bad.items()))
    shown = files[0] if len(files) == 1 else f"{len(files)} files"
    return f"empty corpus: no text found in {shown}" + (f" (bad records: {bad})" if bad else "")


class _Progress:
    def __init__(self, say: Callable[[str], None], stats: ReadStats):
        self.say, self.stats = say, stats
        self.last = time.monotonic()

    def tick(self, sentences: int) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.say(f"  read {self.stats.bytes / 1e6:,.1f} MB, {sentences:,} sentences")


def _sample_sentences(files, text_key, stats, k, max_bytes, seed, say):
    """Reservoir-sample `k` lines (Algorithm R, seeded); skip and count over-long lines."""
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    too_long = 0
    prog = _Progress(say, stats)
    # A line under max_bytes // 4 characters cannot exceed max_bytes in UTF-8.
    safe_chars = max_bytes // 4
    for text in iter_texts(files, text_key=text_key, stats=stats):
        for line in text.split("\n"):
            if line.endswith("\r"):
                line = line[:-1]
            if not line or line.isspace():
                continue
            if len(line) > safe_chars and (
                len(line) > max_bytes or len(line.encode("utf-8", "surrogatepass")) > max_bytes
            ):
                too_long += 1
                continue
            seen += 1
            if len(reservoir) < k:
                reservoir.append(line)
            else:
                j = rng.randrange(seen)
                if j < k:
                    reservoir[j] = line
        prog.tick(seen)
    return reservoir, {
        "sentences_seen": seen,
        "sentences_sampled": len(reservoir),
        "skipped_too_long": too_long,
    }


def _count_chars(files, text_key, stats, say):
    counts: Counter = Counter()
    total = 0
    prog = _Progress(say, stats)
    for text in iter_texts(files, text_key=text_key, stats=stats):
        counts.update(text)
        total += len(text)
        prog.tick(stats.documents)
    return counts, total


def _build_char_model(counts, vocab_size, coverage, specials, control, user) -> _CharModel:
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


def _train_sentencepiece(
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
        msg = " ".join(str(exc).split())
        m = _TOO_HIGH.search(msg)
        if m:
            raise TokenizerError(
                f"vocab size {m.group(1)} is larger than this corpus supports for model_type "
                f"{model_type!r}: use at most {m.group(2)}"
            ) from None
        m = _TOO_LOW.search(msg)
        if m:
            raise TokenizerError(
                f"vocab size {m.group(1)} is too small: the corpus needs at least {m.group(2)} "
                "pieces (characters kept by character_coverage, byte-fallback and special pieces)"
            ) from None
        msg = re.sub(r"^.*?\] ", "", msg)  # drop SentencePiece's C++ file/line prefix
        raise TokenizerError(f"SentencePiece training failed: {msg}") from None
    finally:
        stop.set()
        beat.join()
    return writer.getvalue()


def _spm_version() -> str:
    try:
        import sentencepiece

        return sentencepiece.__version__
    except Exception:  # pragma: no cover - informational only
        return "unknown"
