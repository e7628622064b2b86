"""On-disk cache of index arrays, keyed by a hash of the parameters that built them.

Arrays are `.npy` files saved without pickle and loaded memory-mapped with
`allow_pickle=False`. Each file is written under a temporary name, fsynced and renamed;
the description file is written last and marks the set complete. A lock file makes one
process (rank) build while the others wait, then every process maps the same files.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable

import numpy as np

from mindloom_data._atomic import atomic_write_bytes, save_array


def description_hash(description: dict) -> str:
    blob = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def cached_arrays(
    cache_dir: str | os.PathLike | None,
    kind: str,
    description: dict,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], bool]:
    """Load the arrays `names` for `description`, building and saving them if missing.

    Returns the arrays (memory-mapped when they come from disk) and whether the cache hit.
    With `cache_dir=None` the arrays are built in memory and nothing is written.
    """
    if cache_dir is None:
        return build(), False
    cache_dir = os.fspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    key = description_hash(description)
    base = os.path.join(cache_dir, f"{key}-{kind}")
    desc_path = base + "-description.json"
    paths = {n: f"{base}-{n}.npy" for n in names}

    def load() -> dict[str, np.ndarray] | None:
        if not os.path.exists(desc_path) or not all(os.path.exists(p) for p in paths.values()):
            return None
        return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}

    found = load()
    if found is not None:
        return found, True
    with open(base + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building this very set
        try:
            found = load()
            if found is not None:
                return found, True
            arrays = build()
            for n in names:
                save_array(paths[n], arrays[n])
            atomic_write_bytes(
                desc_path, json.dumps(description, indent=1, sort_keys=True).encode()
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    loaded = load()
    if loaded is None:  # the cache directory lost files under us; use what we built
        return arrays, False
    return loaded, False
