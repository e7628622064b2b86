"""Writers that never leave a half-written file under a final name.

Everything is written to `NAME.tmp-<pid>` in the same directory, flushed, fsynced and
renamed (the package's one atomic-write helper, `_atomic`), so a killed run leaves only
`*.tmp-*` files, which the next run removes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mindloom_data._atomic import (
    WriteOnly,
    atomic_write_bytes,
    atomic_write_json,
    named_oserror,
    save_array,
)
from mindloom_data._atomic import commit as _commit
from mindloom_data._atomic import tmp_name as _tmp
from mindloom_data._atomic import writing as _writing

__all__ = [
    "SCHEMA", "JsonlWriter", "NpyAppender", "ParquetShardWriter", "WriteOnly",
    "atomic_write_bytes", "atomic_write_json", "load_array", "metadata_json", "named_oserror",
    "remove_temporaries", "save_array",
]  # fmt: skip

# `metadata`: the record's other fields as one JSON object in text (records differ in
# their fields and types, which one Arrow struct type per shard could not hold).
SCHEMA = pa.schema(
    [("text", pa.string()), ("id", pa.string()), ("source", pa.string()), ("line", pa.int64()),
     ("metadata", pa.string())]
)  # fmt: skip


def metadata_json(metadata: dict | None) -> str:
    """A document's metadata as the `metadata` column holds it (key order kept)."""
    # default=str: Parquet inputs can hold timestamps, decimals, bytes
    return json.dumps(metadata or {}, ensure_ascii=False, separators=(",", ":"), default=str)


class NpyAppender:
    """A 1-D exchange file written in pieces (so it need not fit in memory), then committed.

    The .npy header is rewritten with the final length on `close()`; it has a fixed size
    so the data does not move.
    """

    HEADER = 128

    def __init__(self, path: str | Path, dtype):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = _tmp(self.path)
        self.dtype = np.dtype(dtype)
        self.length = 0
        self._f = open(self.tmp, "wb")  # noqa: SIM115
        self._f.write(b"\0" * self.HEADER)

    def append(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, self.dtype)
        with _writing(self.path, self.tmp):
            self._f.write(arr.tobytes())
        self.length += len(arr)

    def close(self) -> None:
        d = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False}
        d["shape"] = (self.length,)
        text = repr(d).encode("latin1")
        pad = self.HEADER - 10 - len(text) - 1
        header = b"\x93NUMPY\x01\x00" + (self.HEADER - 10).to_bytes(2, "little")
        with _writing(self.path, self.tmp):
            self._f.seek(0)
            self._f.write(header + text + b" " * pad + b"\n")
            self._f.close()
            _commit(self.tmp, self.path)


def load_array(path: str | Path, cols: int | None = None, dtype=np.uint64, mmap: bool = False):
    """Load an exchange file, checking that it is what the stage that wrote it promised."""
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (OSError, ValueError) as exc:
        raise ValueError(f"corrupt exchange file {path}: {exc}") from exc
    if arr.dtype != dtype or (cols is not None and (arr.ndim != 2 or arr.shape[1] != cols)):
        raise ValueError(
            f"corrupt exchange file {path}: expected {dtype} with {cols} columns, got {arr.dtype} {arr.shape}"
        )
    return arr


class ParquetShardWriter:
    """Cleaned documents (text, id, source, line, metadata) to one Parquet file, in row groups."""

    def __init__(
        self,
        path: str | Path,
        schema: pa.Schema = SCHEMA,
        rows_per_group: int = 2048,
        compression: str | None = "zstd",
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = _tmp(self.path)
        self.schema = schema
        self.rows_per_group = rows_per_group
        self._cols: list[list] = [[] for _ in schema.names]
        self._writer = pq.ParquetWriter(self.tmp, schema, compression=compression or "none")
        self.rows = 0

    def write(self, **row) -> None:
        self.append(*(row[n] for n in self.schema.names))

    def append(self, *values) -> None:
        """One row, values in schema order."""
        for col, v in zip(self._cols, values):
            col.append(v)
        self.rows += 1
        if len(self._cols[0]) >= self.rows_per_group:
            self._flush()

    def write_table(self, table: pa.Table) -> None:
        """Many rows at once (after the rows appended so far); columns by schema name."""
        self._flush()
        if table.num_rows:
            with _writing(self.path, self.tmp):
                self._writer.write_table(table.select(self.schema.names).cast(self.schema))
            self.rows += table.num_rows

    def _flush(self) -> None:
        if self._cols[0]:
            with _writing(self.path, self.tmp):
                self._writer.write_table(
                    pa.table(dict(zip(self.schema.names, self._cols)), schema=self.schema)
                )
            self._cols = [[] for _ in self.schema.names]

    def close(self) -> None:
        self._flush()
        with _writing(self.path, self.tmp):
            self._writer.close()
            _commit(self.tmp, self.path)

    def abort(self) -> None:
        self._writer.close()
        self.tmp.unlink(missing_ok=True)


class JsonlWriter:
    """JSON Lines written atomically; the file appears only on `close()`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = _tmp(self.path)
        self._f = open(self.tmp, "w", encoding="utf-8")  # noqa: SIM115
        self.rows = 0

    def write(self, obj: dict) -> None:
        with _writing(self.path, self.tmp):
            self._f.write(json.dumps(obj, ensure_ascii=False, default=str) + "\n")
        self.rows += 1

    def close(self) -> None:
        with _writing(self.path, self.tmp):
            self._f.flush()
            self._f.close()
            _commit(self.tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)


def remove_temporaries(root: str | Path) -> int:
    """Delete `*.tmp-*` leftovers of a killed run under `root`; returns how many."""
    n = 0
    for p in Path(root).rglob("*.tmp-*"):
        if p.is_file():
            p.unlink(missing_ok=True)
            n += 1
    return n
