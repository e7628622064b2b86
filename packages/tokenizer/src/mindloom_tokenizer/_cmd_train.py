"""`mindloom-tokenizer train`: train a tokenizer on JSONL / Parquet / text files."""

from __future__ import annotations

import sys


def _symbols(value: str) -> list[str]:
    return [s for s in value.split(",") if s]


def add_parser(subparsers) -> None:
    t = subparsers.add_parser("train", help="train a tokenizer on JSONL / Parquet / text files")
    t.add_argument("--input", "-i", nargs="+", required=True, help="files, directories, globs")
    t.add_argument("--out", "-o", required=True, help="output tokenizer directory")
    t.add_argument("--vocab-size", type=int, help="vocabulary size (bpe/unigram: required)")
    t.add_argument("--model-type", choices=("bpe", "unigram", "char"), default="bpe")
    t.add_argument("--text-key", default="text", help="JSONL key / Parquet column of the text")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--character-coverage", type=float, help="default 0.99995 (char: 1.0)")
    t.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false")
    t.add_argument("--no-split-digits", dest="split_digits", action="store_false")
    t.add_argument("--input-sentence-size", type=int, default=2_000_000)
    t.add_argument("--max-sentence-length", type=int, default=4192, help="in bytes")
    t.add_argument("--num-threads", type=int, default=16, help="part of the recipe (unigram)")
    t.add_argument("--unk-id", type=int, default=0)
    t.add_argument("--bos-id", type=int, default=1)
    t.add_argument("--eos-id", type=int, default=2)
    t.add_argument("--pad-id", type=int, default=-1)
    t.add_argument(
        "--no-special-tokens",
        action="store_true",
        help="no unk/bos/eos/pad ids (char only; nanoGPT's vocabulary)",
    )
    t.add_argument("--control-symbols", type=_symbols, default=[], help="comma-separated")
    t.add_argument("--user-defined-symbols", type=_symbols, default=[], help="comma-separated")
    t.add_argument("--export", action="store_true", help="also write the Hugging Face export")
    t.add_argument("--verbose", action="store_true", help="show SentencePiece's own log")
    t.add_argument("--quiet", "-q", action="store_true", help="no progress messages")

    t.set_defaults(func=run)


def run(args) -> int:
    from mindloom_tokenizer._export import export_hf
    from mindloom_tokenizer._train import train_tokenizer

    ids = {"unk_id": args.unk_id, "bos_id": args.bos_id, "eos_id": args.eos_id}
    ids["pad_id"] = args.pad_id
    if args.no_special_tokens:
        if args.model_type != "char":
            print("error: --no-special-tokens needs --model-type char", file=sys.stderr)
            return 2
        ids = dict.fromkeys(ids, -1)

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    tok = train_tokenizer(
        args.input,
        args.out,
        args.vocab_size,
        args.model_type,
        text_key=args.text_key,
        seed=args.seed,
        character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback,
        split_digits=args.split_digits,
        input_sentence_size=args.input_sentence_size,
        max_sentence_length=args.max_sentence_length,
        num_threads=args.num_threads,
        control_symbols=args.control_symbols,
        user_defined_symbols=args.user_defined_symbols,
        progress=say,
        verbose=args.verbose,
        **ids,
    )
    if args.export:
        say(f"wrote {export_hf(tok)}")
    print(tok.path)
    return 0
