"""`mindloom generate` and `mindloom export-hf`: a checkpoint as text, or as a Hugging Face
directory."""

from __future__ import annotations

import sys
from pathlib import Path

from mindloom_train._cliargs import positive_int
from mindloom_train._errors import CommandError
from mindloom_train._generate import (
    generate_compile_cache,
    load_model,
    load_tokenizer,
    sample_text,
)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="a step directory or a save path")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive_int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the run's)")
    p.add_argument("--compile-cache", choices=["auto", "off"], default="auto",
                   help="compile the decoder graphs through the training runs' store (auto) "
                   "or not (off), as the config's context.compile_cache")  # fmt: skip
    p.add_argument("--compile-cache-dir", default=None,
                   help="the store (default: $MINDLOOM_COMPILE_CACHE, else "
                   "~/.cache/mindloom/compile), as the config's context.compile_cache_dir")  # fmt: skip
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face Llama directory")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.set_defaults(func=_cmd_export_hf)


def _cmd_generate(args) -> int:
    import mindspore as ms

    ms.set_context(device_target="CPU")
    model, ckpt = load_model(args.checkpoint)
    tok = load_tokenizer(args.tokenizer, ckpt)

    def say(ids: list[int], note: str) -> None:
        shown = ", ".join(map(str, ids[:16])) + (", ..." if len(ids) > 16 else "")
        print(f"generate: step {ckpt.step}; {note}; prompt ids [{shown}]", file=sys.stderr)

    def note(line: str) -> None:
        print(f"generate: {line}", file=sys.stderr)

    graphs = generate_compile_cache(model, note, store=args.compile_cache_dir,
                                    enabled=args.compile_cache == "auto")  # fmt: skip
    try:
        text = sample_text(model, tok, args.prompt, args.max_new_tokens, args.temperature,
                           args.top_k, args.top_p, args.seed,
                           contract=ckpt.common.get("data_contract"), on_ids=say,
                           compile_cache=graphs)  # fmt: skip
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    note(graphs.summary())
    print(text)
    return 0


def _cmd_export_hf(args) -> int:
    from mindloom_model import save_hf

    out_dir = Path(args.out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        # another export (or anything else) there would be overwritten file by file
        raise CommandError(f"export-hf: {out_dir} exists and is not an empty directory; "
                           "give a new --out")  # fmt: skip
    model, ckpt = load_model(args.checkpoint)
    extra = {}
    tok_dir = ckpt.common.get("tokenizer")
    if tok_dir:
        try:
            tok = load_tokenizer(None, ckpt)
            for key, val in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id)):
                if val >= 0:
                    extra[key] = val
        except CommandError:
            pass
    try:
        out = save_hf(model, args.out, dtype=args.dtype, **extra)
    except (OSError, ValueError) as exc:
        raise CommandError(f"export-hf: {exc}") from None
    kind = "DeepseekV3ForCausalLM" if model.config.family == "deepseek_v3" else "Llama"
    print(f"wrote {out} (Hugging Face {kind}, step {ckpt.step}, {args.dtype})")
    return 0
