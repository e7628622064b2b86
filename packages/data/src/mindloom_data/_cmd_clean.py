"""`mindloom-data clean INPUT... --output OUT`: clean and deduplicate a corpus."""

from __future__ import annotations

import argparse
import sys

from mindloom_data._clean_config import load_config
from mindloom_data._executors import add_executor_args
from mindloom_data._pipeline import clean


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "clean",
        help="normalize, filter and deduplicate (exact, MinHash, paragraph) a corpus",
        description=(
            "Read JSON Lines (.jsonl/.jsonl.gz/.jsonl.zst), Parquet, .txt, WARC (.warc/.warc.gz) "
            "or HTML (.html/.htm) files, directories "
            "or globs; write OUT/shard-NNNNN.parquet, OUT/removed/<step>/, OUT/report.json "
            "and OUT/summary.txt. Rerunning the same command resumes."
        ),
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT")
    p.add_argument("--output", "-o", required=True, metavar="OUT")
    p.add_argument("--config", "-c", metavar="YAML", help="run config (see the README)")
    p.add_argument("--workers", "-j", type=int, default=1, help="processes (default 1)")
    add_executor_args(p, "ranks of the hash-partitioned dedup stages (default: config partitions)")
    p.add_argument("--text-key", default=None, help="JSON / Parquet field with the text")
    p.add_argument(
        "--id-key", default=None, help="JSON / Parquet field with the record's id (default id)"
    )
    p.add_argument(
        "--html-key",
        default=None,
        help="JSON Lines field with a page's HTML: read it and extract the main text (web extra)",
    )
    p.add_argument(
        "--max-bad-fraction",
        type=float,
        default=None,
        help="exit 1 if more than this fraction of input records is malformed",
    )
    p.add_argument("--jsonl", action="store_true", help="also write shard-NNNNN.jsonl")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress and no summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        print("error: --workers must be at least 1", file=sys.stderr)
        return 2
    mbf = args.max_bad_fraction
    if mbf is not None and not 0 <= mbf <= 1:  # NaN fails this too
        print(f"error: --max-bad-fraction must be a number in [0, 1], got {mbf}", file=sys.stderr)
        return 2
    cfg = load_config(args.config)  # a failure raises: _cli's EXIT_CODES decides the code
    if args.id_key is not None:
        cfg.id_key = args.id_key
    if args.jsonl:
        cfg.output.jsonl = True
    if args.html_key is not None:
        cfg.html_key = args.html_key
    if args.max_bad_fraction is not None:
        cfg.max_bad_fraction = args.max_bad_fraction
    report = clean(
        args.inputs,
        args.output,
        config=cfg,
        workers=args.workers,
        text_key=args.text_key,
        progress=None if not args.quiet else False,
        executor=args.executor,
        ray_address=args.ray_address,
        tasks=args.tasks,
    )
    if not args.quiet:
        from mindloom_data._report import summary_text

        print(summary_text(report))
    limit = cfg.max_bad_fraction
    frac = report["read"]["bad_fraction"]
    if limit is not None and frac > limit:
        print(
            f"error: {frac:.2%} of input records are malformed, above --max-bad-fraction {limit:.2%} "
            f"(see {args.output}/report.json)",
            file=sys.stderr,
        )
        return 1
    return 0
