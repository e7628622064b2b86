"""From the config's tokenizer / dataset sections to a tokenizer and packed datasets.

Raw `text_input` is tokenized once into RUN_DIR/data/ (mindloom-data skips the work on a
rerun with the same inputs), so a recipe is one command from raw text to training.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mindloom_train._checkpoint import atomic_write
from mindloom_train._config import Config, ConfigError, DatasetConfig


def resolve_input(spec: str) -> str:
    if spec == "bundled":
        from mindloom_data import bundled_corpus

        return str(bundled_corpus())
    return spec


def tokenizer_dir(cfg: Config) -> Path:
    return Path(cfg.tokenizer.path) if cfg.tokenizer.path else Path(cfg.run_dir) / "tokenizer"


def _has_tokenizer(path: Path) -> bool:
    return (path / "mindloom_tokenizer.json").exists() or (path / "tokenizer.model").exists()


def prepare_tokenizer(cfg: Config, log) -> Any:
    from mindloom_tokenizer import Tokenizer, TokenizerError, train_tokenizer

    path = tokenizer_dir(cfg)
    t = cfg.tokenizer
    if _has_tokenizer(path):
        try:
            return Tokenizer.load(path)
        except TokenizerError as exc:
            raise ConfigError(f"config key tokenizer.path: {exc}") from None
    if not t.train_input:
        raise ConfigError(f"config key tokenizer.path: no tokenizer in {path} and no train_input")
    src = resolve_input(t.train_input)
    log(f"tokenizer: training a {t.model_type} tokenizer on {src} -> {path}")
    kwargs: dict[str, Any] = {"seed": cfg.seed}
    if not t.special_tokens:
        kwargs.update(unk_id=-1, bos_id=-1, eos_id=-1, pad_id=-1)
    try:
        return train_tokenizer(src, path, t.vocab_size, t.model_type, **kwargs)
    except TokenizerError as exc:
        # e.g. a vocab_size below what the corpus' characters need: a config problem
        raise ConfigError(f"config key tokenizer.vocab_size={t.vocab_size}: {exc}") from None


def _write_if_changed(path: Path, data: bytes) -> None:
    # an unchanged slice keeps its mtime, so the tokenizer's completion marker still holds
    if path.exists() and path.read_bytes() == data:
        return
    atomic_write(path, data)


def _slice_input(ds: DatasetConfig, src: str, out: Path) -> str:
    """Apply char_range / doc_range; returns the input path to tokenize."""
    if ds.char_range != [0.0, 1.0]:
        if not os.path.isfile(src) or src.endswith((".jsonl", ".gz", ".zst", ".parquet")):
            raise ConfigError(
                f"config key char_range: needs one plain-text file as text_input, got {src!r}"
            )
        text = Path(src).read_text(encoding="utf-8")
        n = len(text)
        a, b = (int(n * f) for f in ds.char_range)
        target = out.with_suffix(".txt")
        _write_if_changed(target, text[a:b].encode("utf-8"))
        return str(target)
    if ds.doc_range != [0.0, 1.0]:
        from mindloom_data import iter_documents

        docs = list(iter_documents(src, text_key=ds.text_key, txt_mode=ds.txt_mode))
        n = len(docs)
        a, b = (int(round(n * f)) for f in ds.doc_range)
        target = out.with_suffix(".jsonl")
        lines = "".join(json.dumps({"text": d.text}) + "\n" for d in docs[a:b])
        _write_if_changed(target, lines.encode("utf-8"))
        return str(target)
    return src


def prepare_dataset(cfg: Config, ds: DatasetConfig, name: str, tok_path: Path, log) -> list[str]:
    """The .bin/.idx prefixes of a dataset section (tokenizing text_input if needed)."""
    if ds.data_prefix:
        return list(ds.data_prefix)
    data_dir = Path(cfg.run_dir) / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    prefix = data_dir / name
    src = _slice_input(ds, resolve_input(ds.text_input), prefix)
    txt_mode = ds.txt_mode
    from mindloom_data import tokenize

    stats = tokenize(
        src,
        tok_path,
        prefix,
        append_eos=ds.append_eos,
        append_bos=ds.append_bos,
        text_key="text" if src.endswith(".jsonl") and ds.doc_range != [0.0, 1.0] else ds.text_key,
        txt_mode=txt_mode,
    )
    if not getattr(stats, "skipped", False):
        log(
            f"data: tokenized {src} -> {prefix}.bin/.idx ({stats.documents} documents, {stats.tokens} tokens)"
        )
    return [str(prefix)]


# tokens per slice of the full-range scan: bounded memory whatever the dataset's size
_SCAN_TOKENS = 1 << 24


def check_token_ids(prefixes: list[str], vocab_size: int) -> None:
    """Every token id of every dataset in [0, vocab_size), or DataInputError naming the
    file, the id and the vocabulary: an id the embedding lacks otherwise crashes the step
    that first meets it (hundreds of steps in, with a C++ stack). A full scan, not a
    sample: one bad id is enough (cost measured in the README)."""
    import numpy as np
    from mindloom_data import IndexedDataset, IndexedDatasetError

    from mindloom_train._errors import DataInputError

    for prefix in prefixes:
        try:
            ds = IndexedDataset(prefix)
        except IndexedDatasetError as exc:
            raise DataInputError(str(exc)) from None
        tokens = ds.tokens()
        for start in range(0, len(tokens), _SCAN_TOKENS):
            part = tokens[start : start + _SCAN_TOKENS]
            hi, lo = part.max(), part.min()
            if hi < vocab_size and lo >= 0:
                continue
            bad_at = int(np.flatnonzero((part >= vocab_size) | (part < 0))[0])
            raise DataInputError(
                f"{ds.bin_file}: token id {int(part[bad_at])} at token {start + bad_at} is "
                f"outside the model's vocabulary of {vocab_size} ids (data tokenized with "
                "another tokenizer?)"
            )


def build_dataset(
    cfg: Config, ds: DatasetConfig, prefixes: list[str], num_samples: int, name: str, tok
):
    """A PackedDataset (or a blend) with at least `num_samples` samples; DataInputError
    (one line naming the file) for a corrupt, empty or too small dataset or split."""
    from mindloom_train._errors import DataInputError

    try:
        return _build_dataset(cfg, ds, prefixes, num_samples, name, tok)
    except ValueError as exc:  # IndexedDatasetError and PackedDataset's input errors
        raise DataInputError(f"{name} dataset: {exc}") from None


def _build_dataset(cfg, ds, prefixes, num_samples, name, tok):
    from mindloom_data import BlendedDataset, PackedDataset

    eos = tok.eos_id if tok.eos_id >= 0 else None
    kwargs = dict(
        seed=cfg.seed,
        mode=ds.pack_mode,
        eos_id=eos,
        mask_eos_loss=ds.mask_eos_loss and eos is not None,
        pad_id=tok.pad_id if tok.pad_id >= 0 else None,
        name=name,
    )
    if len(prefixes) == 1:
        return PackedDataset(prefixes[0], ds.seq_length, num_samples=num_samples, **kwargs)
    weights = ds.weights or [1.0] * len(prefixes)
    total = sum(weights)
    parts = [
        PackedDataset(
            p, ds.seq_length, num_samples=int(num_samples * w / total * 1.005) + 1, **kwargs
        )
        for p, w in zip(prefixes, weights)
    ]
    return BlendedDataset(parts, weights, num_samples, name=name)


def build_loader(dataset, cfg: Config, *, dp_rank: int, dp_size: int, consumed: int, total: int,
                 global_batch_size: int | None = None, micro_batch_size: int | None = None):  # fmt: skip
    from mindloom_data import build_dataloader

    return build_dataloader(
        dataset,
        global_batch_size=global_batch_size or cfg.training.global_batch_size,
        micro_batch_size=micro_batch_size or cfg.training.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        consumed_samples=consumed,
        total_samples=total,
    )


def _contract_of(prefix: str) -> dict | None:
    from mindloom_data import read_dataset_metadata

    try:
        meta = read_dataset_metadata(prefix)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if meta is None:
        return None
    return {k: meta.get(k) for k in ("append_bos", "append_eos", "bos_id", "eos_id")}


def data_contract(train_prefixes: list[str], eval_prefixes: list[str] | None, tok) -> dict:
    """The BOS/EOS contract of the training data, from each prefix's PREFIX.dataset.json.

    The run records it (common.json, the start event) and `mindloom generate` builds its
    prompts by it. Training prefixes that disagree, held-out data tokenized otherwise, or
    a dataset whose BOS/EOS ids are not the tokenizer's stop the run with one line.
    Datasets without metadata (Megatron-LM's own tools) leave it unknown (null).
    """
    found = [(p, _contract_of(p)) for p in train_prefixes]
    known = [(p, c) for p, c in found if c is not None]
    contract = {"append_bos": None, "append_eos": None, "bos_id": None, "eos_id": None}
    contract["source"] = "unknown: no PREFIX.dataset.json"
    if known:
        first_p, first = known[0]
        for p, c in known[1:]:
            if c["append_bos"] != first["append_bos"] or c["append_eos"] != first["append_eos"]:
                raise ConfigError(
                    f"config key train_dataset.data_prefix: {p} has append_bos="
                    f"{c['append_bos']} append_eos={c['append_eos']}, {first_p} has "
                    f"append_bos={first['append_bos']} append_eos={first['append_eos']}"
                )
        contract.update(first, source=f"{first_p}.dataset.json")
        for key, tid in (("bos_id", tok.bos_id), ("eos_id", tok.eos_id)):
            flag = "append_bos" if key == "bos_id" else "append_eos"
            if first[flag] and first[key] != tid:
                raise ConfigError(
                    f"config key tokenizer.path: {first_p} was tokenized with {key} "
                    f"{first[key]}, the run's tokenizer has {tid}"
                )
    for p in eval_prefixes or []:
        c = _contract_of(p)
        if c is not None and known and c["append_bos"] != contract["append_bos"]:
            raise ConfigError(
                f"config key eval_dataset.append_bos: the held-out data {p} has "
                f"append_bos={c['append_bos']}, the training data append_bos="
                f"{contract['append_bos']}; evaluate on data made like the training data"
            )
    return contract


def describe_contract(contract: dict) -> str:
    """`documents start with BOS (id 1) and end with EOS (id 2)`, for logs and generate."""
    if contract.get("append_bos") is None:
        return "BOS/EOS of the training data unknown (no dataset metadata)"
    bos = (
        f"start with BOS (id {contract['bos_id']})"
        if contract["append_bos"]
        else "start without BOS"
    )
    eos = f"end with EOS (id {contract['eos_id']})" if contract["append_eos"] else "end without EOS"
    return f"documents {bos} and {eos}"
