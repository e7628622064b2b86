"""The Megatron-LM indexed dataset (`PREFIX.bin` + `PREFIX.idx`), byte for byte.

`.idx` layout (little endian): magic `MMIDIDX\\x00\\x00`, u64 version (1), u8 dtype code,
u64 sequence count S, u64 document count D (= documents + 1), int32[S] lengths,
int64[S] byte pointers into `.bin`, int64[D] document indices. `.bin` is the raw token
array. See `shared/reference/formats.md` (B1-B3).

The reader validates everything it relies on before returning, with plain `if`s (never
`assert`, which `python -O` strips), and refuses a bad pair with one line naming the file,
the check, the expected and the actual value.
"""

from __future__ import annotations

import os
import struct
from array import array

import numpy as np

from mindloom_data._atomic import commit

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # 9 magic + 8 version + 1 dtype + 8 sequence count + 8 document count

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A `.bin`/`.idx` pair that must not be read; the message is one line."""


def optimal_dtype(vocab_size: int | None) -> type:
    """Megatron's `DType.optimal_dtype`: uint16 below 65,500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def bin_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".bin"


def idx_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".idx"


class IndexedDataset:
    """Memory-mapped reader of a Megatron indexed dataset, validated on open.

    `len(ds)` is the number of sequences (one per document for document-level data),
    `ds[i]` the tokens of sequence `i` as a read-only numpy view. `vocab_size`, when given,
    turns on a sampled check that every token id is below it.
    """

    def __init__(
        self,
        prefix: str | os.PathLike,
        *,
        vocab_size: int | None = None,
        check_sequences: int = 256,
    ) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_file = idx_path(prefix)
        self.bin_file = bin_path(prefix)
        for path in (self.idx_file, self.bin_file):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: file not found")
        self._open_index()
        self._open_bin()
        if vocab_size is not None:
            self._check_token_ids(vocab_size, check_sequences)

    # -- validation ----------------------------------------------------------------

    def _fail(self, path: str, what: str) -> None:
        raise IndexedDatasetError(f"{path}: {what}")

    def _open_index(self) -> None:
        path = self.idx_file
        size = os.path.getsize(path)
        if size < HEADER_SIZE:
            self._fail(path, f"truncated header: expected at least {HEADER_SIZE} bytes, got {size}")
        with open(path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[:9] != MAGIC:
            self._fail(path, f"bad magic: expected {MAGIC!r}, got {header[:9]!r}")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            self._fail(path, f"unsupported version: expected {VERSION}, got {version}")
        code = header[17]
        if code not in DTYPE_CODES:
            self._fail(path, f"unknown dtype code: expected one of 1-8, got {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind not in "iu":  # Megatron's format allows floats; token ids never are
            self._fail(path, f"dtype code {code} ({self.dtype}) is not an integer token type")
        s, d = struct.unpack("<QQ", header[18:34])
        text_size = HEADER_SIZE + 12 * s + 8 * d
        if size not in (text_size, text_size + s):  # + S int8 modes for multimodal data
            self._fail(
                path,
                f"size does not match its header (S={s}, D={d}): "
                f"expected {text_size} bytes, got {size}",
            )
        if d < 1:
            self._fail(path, "document count: expected at least 1 (the leading 0), got 0")
        self._idx_mmap = np.memmap(path, dtype=np.uint8, mode="r")
        buf = self._idx_mmap
        self.sequence_lengths = np.frombuffer(buf, np.int32, s, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(buf, np.int64, s, HEADER_SIZE + 4 * s)
        self.document_indices = np.frombuffer(buf, np.int64, d, HEADER_SIZE + 12 * s)
        docs = self.document_indices
        if docs[0] != 0:
            self._fail(path, f"document_indices[0]: expected 0, got {int(docs[0])}")
        if docs[-1] != s:
            self._fail(
                path,
                f"sequence_count != document_indices[-1]: expected {s}, got {int(docs[-1])}",
            )
        if d > 1 and np.any(np.diff(docs) < 0):
            k = int(np.argmax(np.diff(docs) < 0)) + 1
            self._fail(path, f"document_indices out of order at document {k}")
        if s and int(self.sequence_lengths.min()) < 0:
            k = int(np.argmin(self.sequence_lengths))
            self._fail(path, f"negative length {int(self.sequence_lengths[k])} at sequence {k}")

    def _open_bin(self) -> None:
        path, s = self.bin_file, len(self.sequence_lengths)
        size = os.path.getsize(path)
        itemsize = self.dtype.itemsize
        lengths = self.sequence_lengths.astype(np.int64)
        ptrs = self.sequence_pointers
        expected = int(lengths.sum()) * itemsize
        if size != expected:
            self._fail(
                path,
                f"size does not match {os.path.basename(self.idx_file)}: "
                f"expected {expected} bytes, got {size}",
            )
        if s:
            if ptrs[0] != 0:
                self._fail(self.idx_file, f"pointer of sequence 0: expected 0, got {int(ptrs[0])}")
            steps = np.diff(ptrs)
            if np.any(steps < 0):
                k = int(np.argmax(steps < 0)) + 1
                self._fail(self.idx_file, f"pointers out of order at sequence {k}")
            ends = ptrs + lengths * itemsize
            if int(ends.max()) > size:
                k = int(np.argmax(ends > size))
                self._fail(
                    self.idx_file,
                    f"sequence {k} ends past the end of {path}: "
                    f"expected at most {size} bytes, needs {int(ends[k])}",
                )
            if np.any(steps != lengths[:-1] * itemsize):
                k = int(np.argmax(steps != lengths[:-1] * itemsize)) + 1
                want = int(ptrs[k - 1] + lengths[k - 1] * itemsize)
                self._fail(
                    self.idx_file, f"pointer of sequence {k}: expected {want}, got {int(ptrs[k])}"
                )
        if size:
            self._bin_mmap = np.memmap(path, dtype=self.dtype, mode="r")
        else:
            self._bin_mmap = np.empty(0, dtype=self.dtype)
        self.num_tokens = expected // itemsize

    def _check_token_ids(self, vocab_size: int, n: int) -> None:
        s = len(self)
        if s == 0:
            return
        picks = np.unique(np.linspace(0, s - 1, num=min(n, s)).astype(np.int64))
        for i in picks:
            seq = self[int(i)]
            if seq.size and (int(seq.max()) >= vocab_size or int(seq.min()) < 0):
                bad = int(seq.max()) if int(seq.max()) >= vocab_size else int(seq.min())
                self._fail(
                    self.bin_file,
                    f"token id out of range in sequence {int(i)}: "
                    f"expected 0 <= id < {vocab_size}, got {bad}",
                )

    # -- access --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """`length` tokens of sequence `i` starting at token `offset` (Megatron's `get`)."""
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._bin_mmap[start : start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        return self.get(i % len(self))

    def document(self, k: int) -> np.ndarray:
        """All tokens of document `k` (its sequences are contiguous in `.bin`)."""
        a, b = int(self.document_indices[k]), int(self.document_indices[k + 1])
        if a == b:
            return self._bin_mmap[:0]
        start = int(self.sequence_pointers[a]) // self.dtype.itemsize
        return self._bin_mmap[start : start + int(self.sequence_lengths[a:b].sum())]

    def tokens(self) -> np.ndarray:
        """Every token of the dataset, as one memory-mapped array."""
        return self._bin_mmap


class IndexedDatasetBuilder:
    """Stream tokens into `PREFIX.bin`/`PREFIX.idx` under temporary names.

    Nothing appears at the final paths until `finalize()`, which fsyncs both files, removes
    a stale `.idx`, then renames `.bin` and finally `.idx`: a crash at any point leaves
    either the old pair, no `.idx` (the reader refuses), or the complete new pair.
    The temporary names are fixed (`PREFIX.bin.partial`), so a rerun after a kill
    overwrites the leftovers.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type = np.int32) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        parent = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(parent, exist_ok=True)
        self._bin_tmp = bin_path(prefix) + ".partial"
        self._idx_tmp = idx_path(prefix) + ".partial"
        self._bin = open(self._bin_tmp, "wb")
        self.sequence_lengths = array("q")
        self.document_indices = array("q", [0])
        self._done = False

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()

    def _write(self, tokens) -> int:
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            arr = arr.astype(self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        return int(arr.size)

    def add_item(self, tokens) -> None:
        """Append one sequence to the current document."""
        self.sequence_lengths.append(self._write(tokens))

    def extend_item(self, tokens) -> None:
        """Append tokens to the last sequence (for documents tokenized in chunks)."""
        self.sequence_lengths[-1] += self._write(tokens)

    def write_raw(self, data: bytes) -> None:
        """Append tokens already in this builder's dtype; pair with `add_document_length`."""
        self._bin.write(data)

    def add_document_length(self, n: int) -> None:
        """Record one single-sequence document of `n` tokens written with `write_raw`."""
        self.sequence_lengths.append(n)
        self.document_indices.append(len(self.sequence_lengths))

    def add_document_lengths(self, lengths: np.ndarray) -> None:
        """`add_document_length` for each of `lengths` (int64), without a Python loop."""
        first = len(self.sequence_lengths) + 1
        self.sequence_lengths.frombytes(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
        docs = np.arange(first, first + len(lengths), dtype=np.int64)
        self.document_indices.frombytes(docs.tobytes())

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths=None) -> None:
        """One document: its tokens and the lengths of its sequences (default: one)."""
        n = self._write(tokens)
        lengths = [n] if lengths is None else list(lengths)
        if sum(lengths) != n:
            raise ValueError(f"lengths sum to {sum(lengths)} but the document has {n} tokens")
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append a whole validated dataset (Megatron's merge rule, see formats.md B3)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{other.idx_file}: dtype: expected {self.dtype}, got {other.dtype}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.astype(np.int64).tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        with open(other.bin_file, "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def _write_index(self, path: str) -> None:
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2**31-1 tokens cannot be indexed")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        docs = np.frombuffer(self.document_indices, dtype=np.int64)
        with open(path, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", _CODE_OF[self.dtype]))
            f.write(struct.pack("<QQ", len(lengths), len(docs)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(docs.tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._write_index(self._idx_tmp)
        final_idx = idx_path(self.prefix)
        if os.path.exists(final_idx):
            os.unlink(final_idx)  # never pair a stale .idx with the new .bin
        commit(self._bin_tmp, bin_path(self.prefix))
        commit(self._idx_tmp, final_idx)
        self._done = True

    def abort(self) -> None:
        """Drop the temporary files; the final paths are left untouched."""
        if not self._bin.closed:
            self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.unlink(p)
        self._done = True


def merge_datasets(prefixes, output_prefix: str | os.PathLike) -> IndexedDataset:
    """Concatenate datasets of one dtype into `output_prefix` (documents in order)."""
    prefixes = [os.fspath(p) for p in prefixes]
    if not prefixes:
        raise ValueError("merge needs at least one input prefix")
    first = IndexedDataset(prefixes[0])
    with IndexedDatasetBuilder(output_prefix, dtype=first.dtype) as builder:
        for p in prefixes:
            builder.add_index(p)
    return IndexedDataset(output_prefix)
