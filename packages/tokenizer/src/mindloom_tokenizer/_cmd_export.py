"""`mindloom-tokenizer export`: write a Hugging Face tokenizer.json."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    x = subparsers.add_parser("export", help="write a Hugging Face tokenizer.json")
    x.add_argument("--tokenizer", "-t", required=True)
    x.add_argument("--out", "-o", help="output directory (default: the tokenizer directory)")
    x.set_defaults(func=run)


def run(args) -> int:
    from mindloom_tokenizer._export import export_hf

    print(export_hf(args.tokenizer, args.out))
    return 0
