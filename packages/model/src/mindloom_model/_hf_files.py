"""The file side of Hugging Face directories, shared by the Llama and DeepSeek-V3 mappings:
config.json and (sharded) safetensors, read and written through mindloom's one codec
(`_safetensors`). Neither mapping module imports the other for these."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from mindloom_model import _safetensors as st

__all__ = [
    "CONFIG",
    "INDEX",
    "WEIGHTS",
    "HFFormatError",
    "check_tensor_shapes",
    "read_headers",
    "read_fp32_tensor",
    "read_safetensors_header",
    "weight_files",
    "write_hf_dir",
]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFFormatError(ValueError):
    """A Hugging Face directory that cannot be loaded; the message is one line."""


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """The codec's checked header, its refusal as an HFFormatError (the same line)."""
    try:
        return st.read_safetensors_header(path)
    except st.SafetensorsError as e:
        raise HFFormatError(str(e)) from None


def read_fp32_tensor(f, info: dict, data_start: int) -> np.ndarray:
    # the model's parameters are fp32 masters whatever the file stores
    return st.read_tensor(f, info, data_start, getattr(f, "name", "<file>")).astype(np.float32)


def write_hf_dir(out_dir, tensors: dict[str, np.ndarray], config: dict, dtype: str) -> Path:
    """`out_dir/model.safetensors`, then `out_dir/config.json` last (atomically), so a
    directory with a config is complete."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    st.write_safetensors(out / WEIGHTS, tensors, dtype, metadata={"format": "pt"})
    tmp = out / (CONFIG + ".tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / CONFIG)
    return out


def weight_files(root: Path) -> list[Path]:
    if (root / INDEX).exists():
        try:
            index = json.loads((root / INDEX).read_text())
            files = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise HFFormatError(
                f"{root / INDEX}: not a safetensors index (needs a 'weight_map' object)"
            ) from None
        for name in files:
            if Path(name).name != name:
                raise HFFormatError(f"{root / INDEX}: shard name {name!r} is not a plain file name")
        return [root / name for name in files]
    if (root / WEIGHTS).exists():
        return [root / WEIGHTS]
    raise HFFormatError(f"{root}: no {WEIGHTS} or {INDEX} (only safetensors weights are loaded)")


def read_headers(root: Path) -> dict[str, tuple[Path, dict, int]]:
    """Every tensor of the directory's weight files: name -> (file, header entry, data start)."""
    found: dict[str, tuple[Path, dict, int]] = {}
    for file in weight_files(root):
        header, start = read_safetensors_header(file)
        for name, info in header.items():
            found[name] = (file, info, start)
    return found


def check_tensor_shapes(
    found, expected: dict[str, tuple], root: Path, ignore, what: str = ""
) -> None:
    """Refuse, before anything is read, an unexpected, mis-shaped or missing tensor (one
    line naming it). `ignore(name)` -> True skips a tensor the files may carry (a buffer
    older exports include, a copy the mapping does not load); `what` ends the unexpected-
    tensor line (e.g. "(not in a 2-layer Llama)")."""
    for name, (file, info, _) in found.items():
        if name.endswith("rotary_emb.inv_freq") or ignore(name):
            continue  # a buffer older exports include; it is recomputed
        if name not in expected:
            raise HFFormatError(
                f"{file}: unexpected tensor {name!r} with shape {info['shape']}"
                + (f" {what}" if what else "")
            )
        if tuple(info["shape"]) != expected[name]:
            raise HFFormatError(
                f"{file}: tensor {name!r} has shape {info['shape']}, expected {list(expected[name])}"
            )
    for name, shape in expected.items():
        if name not in found:
            raise HFFormatError(f"{root}: missing tensor {name!r} (expected shape {list(shape)})")
