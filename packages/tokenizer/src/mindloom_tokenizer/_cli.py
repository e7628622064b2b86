"""The `mindloom-tokenizer` command: train, eval, export."""

from __future__ import annotations

import argparse
import sys

from mindloom_tokenizer.__about__ import __version__


class _Exit(Exception):
    def __init__(self, code: int):
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and never exits the interpreter."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise _Exit(2)

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            print(message.rstrip("\n"), file=sys.stderr)
        raise _Exit(status)


def _symbols(value: str) -> list[str]:
    return [s for s in value.split(",") if s]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mindloom-tokenizer",
        description="Train, evaluate and export tokenizers for LLM pretraining.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    t = sub.add_parser("train", help="train a tokenizer on JSONL / Parquet / text files")
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

    e = sub.add_parser("eval", help="coverage, compression and fertility on a sample")
    e.add_argument("--tokenizer", "-t", required=True)
    e.add_argument("--input", "-i", nargs="+", required=True)
    e.add_argument("--num-sentences", type=int, default=10_000)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--min-coverage", type=float, default=0.98)
    e.add_argument("--text-key", default="text")
    e.add_argument("--json", help="also write the full report to this JSON file")
    e.add_argument("--strict", action="store_true", help="exit 3 when below --min-coverage")

    x = sub.add_parser("export", help="write a Hugging Face tokenizer.json")
    x.add_argument("--tokenizer", "-t", required=True)
    x.add_argument("--out", "-o", help="output directory (default: the tokenizer directory)")
    return parser


def _train(args) -> int:
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


def _eval(args) -> int:
    from mindloom_tokenizer._eval import evaluate, format_report
    from mindloom_tokenizer._io import write_json_atomic

    if not 0.0 <= args.min_coverage <= 1.0:
        print(f"error: --min-coverage must be in [0, 1], got {args.min_coverage}", file=sys.stderr)
        return 2
    report = evaluate(
        args.tokenizer,
        args.input,
        num_sentences=args.num_sentences,
        seed=args.seed,
        text_key=args.text_key,
        min_coverage=args.min_coverage,
    )
    print(format_report(report))
    if args.json:
        write_json_atomic(args.json, report)
    if not report["ok"]:
        print(
            f"warning: coverage {100 * report['coverage']:.2f}% is below "
            f"{100 * args.min_coverage:.2f}%: extend the vocabulary or check the data",
            file=sys.stderr,
        )
        return 3 if args.strict else 0
    return 0


def _export(args) -> int:
    from mindloom_tokenizer._export import export_hf

    print(export_hf(args.tokenizer, args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _Exit as exc:
        return exc.code
    if args.command is None:
        parser.print_help()
        return 2
    from mindloom_tokenizer._readers import NoInputError
    from mindloom_tokenizer._tokenizer import TokenizerError

    try:
        return {"train": _train, "eval": _eval, "export": _export}[args.command](args)
    except (TokenizerError, NoInputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        print(f"error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
