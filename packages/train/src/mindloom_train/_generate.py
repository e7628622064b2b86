"""From a checkpoint to text: the checkpoint a name stands for (`best`, a save path, a step
directory), the model with its weights, the tokenizer, and sampling with the training
data's BOS contract. Used by `mindloom generate`, `export-hf` and the demo."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from mindloom_train._errors import CommandError

BEST = "best"


def best_checkpoint(save_path: str | os.PathLike) -> tuple[Path, float, int]:
    """(step directory, held-out loss, checkpoints with a loss) of the checkpoint with the
    lowest held-out loss that the run recorded for it (common.json `eval`, written when
    the evaluation ran at the checkpoint's own step). A run directory stands for its
    `checkpoints/`. Ties go to the later step; steps newer than `latest` are skipped."""
    from mindloom_train._checkpoint import complete_steps, read_tracker, step_dirname

    root = Path(save_path)
    if not complete_steps(root) and complete_steps(root / "checkpoints"):
        root = root / "checkpoints"
    try:
        tracked = read_tracker(root)
    except Exception:  # an unreadable tracker: every complete step is a candidate
        tracked = None
    found: list[tuple[float, int]] = []
    for step in complete_steps(root):
        if tracked is not None and step > tracked:
            continue
        try:
            ev = json.loads((root / step_dirname(step) / "common.json").read_text()).get("eval")
        except (OSError, ValueError):
            continue
        if (
            isinstance(ev, dict)
            and ev.get("step") == step
            and isinstance(ev.get("loss"), (int, float))
        ):
            if math.isfinite(ev["loss"]):
                found.append((float(ev["loss"]), step))
    if not found:
        raise CommandError(
            f"{root}: no checkpoint records a held-out loss (evaluate at checkpoint steps: "
            "training.eval_interval and checkpoint.save_interval); cannot pick 'best'"
        )
    loss, step = min(found, key=lambda x: (x[0], -x[1]))
    return root / step_dirname(step), loss, len(found)


def resolve_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """`best` / `DIR/best` -> the best step directory (see best_checkpoint); else as given."""
    path = Path(checkpoint)
    if path.name == BEST and not (path / "common.json").exists():
        step_dir, loss, n = best_checkpoint(path.parent)
        print(
            f"checkpoint: {checkpoint} -> {step_dir} (lowest held-out loss {loss:.4f} "
            f"of {n} checkpoint(s) with one)",
            file=sys.stderr,
        )
        return step_dir
    return path


def load_model(checkpoint: str | os.PathLike):
    """(Llama with the checkpoint's weights, Checkpoint) from a step dir, a save path (its
    `latest`) or `SAVE_PATH/best`."""
    from mindloom_model import DeepseekV3, Llama, ModelConfig

    from mindloom_train._checkpoint import CheckpointError, open_checkpoint

    checkpoint = resolve_checkpoint(checkpoint)
    try:
        ckpt = open_checkpoint(Path(checkpoint))
        mdict = ckpt.common.get("model_config")
        if not isinstance(mdict, dict):
            raise CheckpointError(f"{ckpt.path / 'common.json'}: no model_config")
        mcfg = ModelConfig.from_dict(mdict)
        model = DeepseekV3(mcfg) if mcfg.family == "deepseek_v3" else Llama(mcfg)
        params = list(model.get_parameters())
        tensors = ckpt.load_tensors([p.name for p in params])
    except (CheckpointError, ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    import mindspore as ms

    for p in params:
        arr = tensors[p.name]
        if tuple(arr.shape) != tuple(p.shape):
            raise CommandError(
                f"{ckpt.path}: tensor {p.name!r} has shape {list(arr.shape)}, expected {list(p.shape)}"
            )
        p.set_data(ms.Tensor(arr, p.dtype))
    return model, ckpt


def load_tokenizer(path: str | None, ckpt) -> Any:
    from mindloom_tokenizer import Tokenizer

    where = path or ckpt.common.get("tokenizer")
    if not where:
        raise CommandError(f"{ckpt.path}: records no tokenizer; pass --tokenizer DIR")
    try:
        return Tokenizer.load(where)
    except Exception as exc:  # the tokenizer's own one-line error
        raise CommandError(f"tokenizer {where}: {exc}") from None


def prompt_ids(tok, prompt: str, contract: dict | None) -> tuple[list[int], str]:
    """The prompt's ids as the training data began its documents, and a line saying so.

    `contract` is the checkpoint's `data_contract` (from PREFIX.dataset.json): BOS goes
    first exactly when the training documents started with it. A checkpoint without one
    (older runs, datasets without metadata) gets no BOS, as mindloom-data wrote none
    before `append_bos` existed. A BOS the tokenizer does not have is an error.
    """
    ids = tok.encode(prompt)
    bos = bool(contract and contract.get("append_bos"))
    if contract is None or contract.get("append_bos") is None:
        note = "the checkpoint records no BOS/EOS contract: prompt without BOS"
    elif bos:
        if tok.bos_id < 0 or (contract.get("bos_id") not in (None, tok.bos_id)):
            raise CommandError(
                f"the training data started documents with BOS id {contract.get('bos_id')}, "
                f"the tokenizer's BOS id is {tok.bos_id}: pass the run's tokenizer"
            )
        note = f"prompt starts with BOS (id {tok.bos_id}), as the training documents did"
    else:
        note = "prompt without BOS, as the training documents were"
    if bos:
        ids = [tok.bos_id, *ids]
    return ids, note


def sample_text(model, tok, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                contract: dict | None = None, on_ids=None, compile_cache=None) -> str:  # fmt: skip
    from mindloom_model import generate

    ids, note = prompt_ids(tok, prompt, contract)
    bos = len(ids) > 0 and contract is not None and bool(contract.get("append_bos"))
    if not ids:
        raise CommandError("the prompt encodes to no tokens")
    out = generate(
        model,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tok.eos_id if tok.eos_id >= 0 else None,
        seed=seed,
        compile_cache=compile_cache,
    )
    row = [int(i) for i in out[0]]
    if on_ids is not None:  # what the model was fed, as generate returns it
        on_ids(row[: len(ids)], note)
    if bos:
        row = row[1:]
    if tok.eos_id >= 0 and tok.eos_id in row[len(ids) - bos :]:
        row = row[: row.index(tok.eos_id, len(ids) - bos)]
    return tok.decode(row)


def generate_compile_cache(model, log, store: str | None = None, enabled: bool = True):
    """The store `mindloom generate` compiles its decoder graphs through: `store`, else the
    training runs' ($MINDLOOM_COMPILE_CACHE, else ~/.cache/mindloom/compile), keyed by the
    model's whole config (a value like rope_theta is baked into the graph as a constant)."""
    import dataclasses

    from mindloom_model import CompileCache, compile_cache_dir

    context = {"purpose": "generate", "model": dataclasses.asdict(model.config)}
    return CompileCache(compile_cache_dir(store), context, log=log, enabled=enabled)
