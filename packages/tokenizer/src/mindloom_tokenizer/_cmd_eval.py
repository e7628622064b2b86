"""`mindloom-tokenizer eval`: coverage, compression and fertility on a sample."""

from __future__ import annotations

import sys


def add_parser(subparsers) -> None:
    e = subparsers.add_parser("eval", help="coverage, compression and fertility on a sample")
    e.add_argument("--tokenizer", "-t", required=True)
    e.add_argument("--input", "-i", nargs="+", required=True)
    e.add_argument("--num-sentences", type=int, default=10_000)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--min-coverage", type=float, default=0.98)
    e.add_argument("--text-key", default="text")
    e.add_argument("--json", help="also write the full report to this JSON file")
    e.add_argument("--strict", action="store_true", help="exit 3 when below --min-coverage")

    e.set_defaults(func=run)


def run(args) -> int:
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
