"""Subcommands `tokenize`, `inspect`, `merge` and `pack-stats`."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _error(msg: str) -> int:
    """A flag value the command refuses (exit 1, as it always was for these commands)."""
    print(f"error: {msg}", file=sys.stderr)
    return 1


def _warn_unsupported(read: dict) -> None:
    n = read["bad"].get("unsupported_file", 0)
    if n:
        shown = ", ".join(read["examples"].get("unsupported_file", []))
        more = " ..." if n > len(read["examples"].get("unsupported_file", [])) else ""
        print(f"warning: {n} files of no known format, not read: {shown}{more}", file=sys.stderr)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tokenize", help="tokenize documents into PREFIX.bin/.idx")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory or .model file")
    p.add_argument("--input", required=True, nargs="+", help="files, directories or globs")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="encoding threads (processes for a char tokenizer; default 1)",
    )
    p.add_argument("--no-eos", action="store_true", help="do not append EOS to each document")
    p.add_argument(
        "--bos",
        action="store_true",
        help="put BOS before each document (recorded in PREFIX.dataset.json; default off)",
    )
    p.add_argument(
        "--metadata-fields",
        default=None,
        metavar="A,B",
        help="write PREFIX.docmeta.jsonl: each document's id and these fields, in dataset order",
    )
    p.add_argument("--id-key", default="id", help="JSON/Parquet field with the record's id")
    p.add_argument("--text-key", default="text", help="JSON/Parquet text field (default text)")
    p.add_argument(
        "--txt-mode",
        default="paragraph",
        choices=("paragraph", "file", "line"),
        help="what a document is in a .txt file (default paragraph)",
    )
    p.add_argument(
        "--chunk-chars", type=int, default=1 << 20, help="encode longer documents in chunks"
    )
    p.add_argument("--force", action="store_true", help="redo even if a completion marker matches")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace PREFIX.bin/.idx that exist from another input or settings",
    )
    from mindloom_data._executors import add_executor_args

    add_executor_args(p, "ranks, each a slice of the input files, merged at the end")
    p.set_defaults(func=run_tokenize)

    p = subparsers.add_parser("inspect", help="validate and summarize PREFIX.bin/.idx")
    p.add_argument("prefix")
    p.add_argument("--tokenizer", help="detokenize a few documents and check ids < vocab")
    p.add_argument("--show", type=int, default=3, help="documents to print (default 3)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run_inspect)

    p = subparsers.add_parser("merge", help="concatenate datasets into one prefix")
    p.add_argument("inputs", nargs="+", help="input prefixes, in order")
    p.add_argument("--output-prefix", required=True)
    p.set_defaults(func=run_merge)

    p = subparsers.add_parser("pack-stats", help="dry-run packing: padding, splits, tokens")
    p.add_argument("blend", nargs="+", help="PREFIX, or weights and prefixes: W1 P1 W2 P2")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--mode", default="best_fit", choices=("concat", "best_fit"))
    p.add_argument("--split", default="969,30,1", help="train,valid,test (default 969,30,1)")
    p.add_argument("--num-samples", type=int, default=None, help="train samples (default 1 epoch)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    p.set_defaults(func=run_pack_stats)


def run_tokenize(args: argparse.Namespace) -> int:
    from mindloom_data._tokenize import tokenize

    if args.workers < 1:
        return _error(f"--workers must be >= 1, got {args.workers}")
    fields = None
    if args.metadata_fields is not None:
        fields = [f.strip() for f in args.metadata_fields.split(",") if f.strip()]
    args.fields = fields
    if args.executor is not None or args.tasks is not None:
        return _run_ranked(args)
    stats = tokenize(
        args.input,
        args.tokenizer,
        args.output_prefix,
        workers=args.workers,
        append_eos=not args.no_eos,
        append_bos=args.bos,
        text_key=args.text_key,
        txt_mode=args.txt_mode,
        chunk_chars=args.chunk_chars,
        force=args.force,
        overwrite=args.overwrite,
        metadata_fields=fields,
        id_key=args.id_key,
    )
    _warn_unsupported(stats.read.to_dict())
    if stats.skipped:
        print(
            f"{args.output_prefix}: already complete ({stats.documents} documents, "
            f"{stats.tokens} tokens); use --force to redo"
        )
        return 0
    d = stats.to_dict()
    bad = stats.read.bad_records
    print(
        f"wrote {args.output_prefix}.bin/.idx: {d['documents']} documents, {d['tokens']} tokens "
        f"({d['dtype']}), {d['text_bytes'] / 1e6:.2f} MB in {d['seconds']:.2f} s "
        f"({d['mb_per_s']} MB/s, {args.workers} workers); empty {d['empty_documents']}, "
        f"chunked {d['chunked_documents']}, bad records {bad}; documents "
        f"{'start with BOS' if args.bos else 'without BOS'}, "
        f"{'end with EOS' if not args.no_eos else 'without EOS'} ({args.output_prefix}.dataset.json)"
    )
    if bad:
        print("bad records: " + json.dumps(dict(stats.read.counts), sort_keys=True))
    return 0


def _run_ranked(args: argparse.Namespace) -> int:
    from mindloom_data._ranked_tokenize import tokenize_ranks

    r = tokenize_ranks(
        args.input,
        args.tokenizer,
        args.output_prefix,
        executor=args.executor,
        workers=args.workers,
        ray_address=args.ray_address,
        tasks=args.tasks,
        append_eos=not args.no_eos,
        append_bos=args.bos,
        text_key=args.text_key,
        txt_mode=args.txt_mode,
        chunk_chars=args.chunk_chars,
        metadata_fields=args.fields,
        id_key=args.id_key,
    )
    _warn_unsupported(r["read"])
    print(
        f"wrote {args.output_prefix}.bin/.idx: {r['documents']} documents, {r['tokens']} tokens "
        f"({r['dtype']}) from {r['ranks']} ranks ({args.executor or 'local'} executor); "
        f"empty {r['empty_documents']}, bad records {sum(r['read']['bad'].values())}"
    )
    return 0


def _histogram(lengths: np.ndarray) -> list[tuple[str, int]]:
    if lengths.size == 0:
        return []
    top = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    edges = [0] + [2**k for k in range(top + 1)]
    counts, _ = np.histogram(lengths, bins=np.asarray(edges + [edges[-1] * 2]) - 0.5)
    out = []
    for lo, hi, c in zip(edges[:-1] + [edges[-1]], edges[1:] + [edges[-1] * 2], counts):
        if c:
            out.append((f"{lo}-{hi - 1}" if hi - 1 > lo else f"{lo}", int(c)))
    return out


def run_inspect(args: argparse.Namespace) -> int:
    from mindloom_data._indexed import IndexedDataset

    tok = None
    if args.tokenizer:
        from mindloom_tokenizer import Tokenizer

        tok = Tokenizer.load(args.tokenizer)
    ds = IndexedDataset(args.prefix, vocab_size=tok.vocab_size if tok else None)
    lengths = np.asarray(ds.sequence_lengths)
    summary = {
        "prefix": args.prefix,
        "dtype": str(ds.dtype),
        "sequences": len(ds),
        "documents": ds.num_documents,
        "tokens": int(ds.num_tokens),
        "length_min": int(lengths.min()) if lengths.size else 0,
        "length_mean": float(lengths.mean()) if lengths.size else 0.0,
        "length_max": int(lengths.max()) if lengths.size else 0,
        "histogram": _histogram(lengths),
    }
    shown = []
    for i in range(min(args.show, len(ds))):
        ids = ds[i]
        text = tok.decode(ids) if tok else " ".join(str(int(x)) for x in ids[:32])
        shown.append({"sequence": i, "tokens": int(ids.size), "text": text[:300]})
    summary["examples"] = shown
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{args.prefix}: valid Megatron indexed dataset, dtype {summary['dtype']}")
    print(
        f"  sequences {summary['sequences']}, documents {summary['documents']}, "
        f"tokens {summary['tokens']}"
    )
    print(
        f"  length min {summary['length_min']}, mean {summary['length_mean']:.1f}, "
        f"max {summary['length_max']}"
    )
    print("  length histogram (tokens: sequences):")
    for label, c in summary["histogram"]:
        print(f"    {label:>15}: {c}")
    for ex in shown:
        print(f"  [{ex['sequence']}] {ex['tokens']} tokens: {ex['text']!r}")
    return 0


def run_merge(args: argparse.Namespace) -> int:
    from mindloom_data._indexed import merge_datasets

    ds = merge_datasets(args.inputs, args.output_prefix)
    print(
        f"wrote {args.output_prefix}.bin/.idx: {len(ds)} sequences, "
        f"{ds.num_documents} documents, {ds.num_tokens} tokens from {len(args.inputs)} inputs"
    )
    return 0


def run_pack_stats(args: argparse.Namespace) -> int:
    from mindloom_data._blend import BlendedDataset, build_datasets

    built = build_datasets(
        args.blend,
        args.seq_length,
        (args.num_samples, None, None),
        split=args.split,
        seed=args.seed,
        mode=args.mode,
        cache_dir=None,  # a dry run writes nothing
    )
    report = {}
    for name, ds in built.items():
        if ds is None:
            report[name] = None
            continue
        if isinstance(ds, BlendedDataset):
            parts = [d.stats() for d in ds.datasets]
            report[name] = {"samples": len(ds), "mixture": ds.mixture(), "sources": parts}
        else:
            report[name] = {"samples": len(ds), "sources": [ds.stats()]}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"pack-stats: mode {args.mode}, seq_length {args.seq_length}, split {args.split}")
    for name, r in report.items():
        if r is None:
            print(f"  {name}: empty")
            continue
        print(f"  {name}: {r['samples']} samples")
        for s in r["sources"]:
            print(
                f"    padding {100 * s['padding_ratio']:.2f}%, tokens/sample "
                f"{s['tokens_per_sample']:.1f}, documents {s['documents']}, split "
                f"{s['documents_split']} ({100 * s['documents_split_frac']:.1f}%), "
                f"documents/sample {s['documents_per_sample']:.2f}"
            )
        for m in r.get("mixture", []):
            print(
                f"    {m['source']}: requested {m['requested']:.4f}, achieved "
                f"{m['achieved']:.4f} ({m['samples']} samples)"
            )
    return 0
