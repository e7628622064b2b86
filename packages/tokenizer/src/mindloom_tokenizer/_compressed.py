"""Compressed inputs read to a verified end (see `mindloom_tokenizer.inputs`, which makes
these names public): every gzip member's CRC and length trailer, every zstd frame
completed, several members or frames in a row; the bad-input category of a failure."""

from __future__ import annotations

import gzip
import io
import os
import zlib

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class CompressedStreamError(ValueError):
    """A compressed input that is not what its name says, or ends too early.

    `category` is `not_compressed`, `truncated_file` or `corrupt_file`.
    """

    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category = category


class _Members(io.RawIOBase):
    """Decompresses consecutive gzip members or zstd frames. At the end of the file the
    last one must be complete (the decoder's `eof`): for zstd that includes its checksum
    where it has one, for gzip (zlib, wbits=31) the CRC-32 and length trailer."""

    def __init__(self, path: str, kind: str):
        self._path = path
        self._kind = kind
        if kind == "zstd":
            import zstandard

            self._new = zstandard.ZstdDecompressor().decompressobj
        else:
            self._new = lambda: zlib.decompressobj(wbits=31)
        self._raw = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._obj = None
        self._buf = bytearray()
        self._done = False
        self._members = 0
        self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf and not self._done:
            self._fill()
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        del self._buf[:n]
        return n

    def _fill(self) -> None:
        chunk = self._raw.read(1 << 17)
        if not chunk:
            self._done = True
            if self._obj is not None:
                what = "frame" if self._kind == "zstd" else "member"
                raise CompressedStreamError(
                    "truncated_file",
                    f"{self._path}: {self._kind} {what} {self._members + 1} ends early at byte "
                    f"{self._offset} (premature end)",
                )
            return
        self._offset += len(chunk)
        data = chunk
        while data:
            if self._obj is None:
                if self._kind == "gzip" and not data.strip(b"\0"):
                    return  # zero padding after the last member, as gzip(1) allows
                self._obj = self._new()
            try:
                self._buf += self._obj.decompress(data)
            except zlib.error as exc:
                raise CompressedStreamError(
                    "corrupt_file", f"{self._path}: bad gzip data near byte {self._offset}: {exc}"
                ) from None
            if self._obj.eof:
                data = self._obj.unused_data
                self._obj = None
                self._members += 1
            else:
                data = b""

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


def open_compressed(path: str | os.PathLike):
    """A buffered binary reader of `path`: `.gz` and `.zst` decompressed and verified
    (see the module docstring), anything else as is."""
    path = os.fspath(path)
    if path.endswith((".gz", ".zst")):
        magic = _GZIP_MAGIC if path.endswith(".gz") else _ZSTD_MAGIC
        with open(path, "rb") as f:
            head = f.read(len(magic))
        if head != magic[: len(head)]:  # a shorter head is a truncated stream
            kind = "gzip" if path.endswith(".gz") else "zstd"
            raise CompressedStreamError(
                "not_compressed", f"{path}: not {kind} data (starts with {head!r})"
            )
        kind = "gzip" if path.endswith(".gz") else "zstd"
        return io.BufferedReader(_Members(path, kind), buffer_size=1 << 20)
    return open(path, "rb", buffering=1 << 20)


def stream_error_category(exc: BaseException) -> str | None:
    """The bad-input category of an error raised while reading a compressed stream, or
    None if it is not one (then it is not ours to count)."""
    if isinstance(exc, CompressedStreamError):
        return exc.category
    if isinstance(exc, EOFError):  # gzip: "ended before the end-of-stream marker"
        return "truncated_file"
    if isinstance(exc, (gzip.BadGzipFile, zlib.error)):  # CRC/length trailer, bad data
        return "corrupt_file"
    if type(exc).__name__ == "ZstdError":  # corrupt data or a checksum mismatch
        return "corrupt_file"
    return None
