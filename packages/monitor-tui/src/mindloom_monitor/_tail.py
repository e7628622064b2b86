"""Follow an append-only text file, and open a huge one quickly (plain Python).

`Follower` hands out complete lines only, keeps a partial last line until its newline
arrives, and notices when the file is truncated (size shrinks) or replaced (new inode),
re-opening it from the start. `read_initial` opens a large file by reading its head, a
fixed number of lines sampled from the middle and the tail, so a million-line file opens
without parsing every line.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import BinaryIO

# A line longer than this is garbage (the trainer writes a few hundred bytes); dropping
# it bounds memory when a binary file is appended by mistake.
MAX_LINE = 1 << 20
# Bytes remembered before the read position; compared when the file grows.
MARK = 64
# Upper bound of bytes read per poll, so one message never carries an unbounded batch.
MAX_READ = 8 << 20


@dataclass
class Chunk:
    """What one read produced."""

    lines: list[bytes] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # "appeared", "truncated", "replaced"
    dropped: int = 0  # over-long lines discarded


class Follower:
    """Tail one file by stat polling; no inotify, so it also works on network mounts."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._fh = None
        self._ident: tuple[int, int] | None = None
        self.pos = 0
        self.partial = b""
        self._mark = b""  # the bytes just before `pos`, to notice an in-place rewrite

    @property
    def is_open(self) -> bool:
        return self._fh is not None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._fh = None

    def attach(self, pos: int, partial: bytes = b"", ident: tuple[int, int] | None = None) -> bool:
        """Open the file and continue from `pos` (after `read_initial`). False if absent.

        `ident` is the (device, inode) that `pos` belongs to: if the file was replaced in
        between, the new one is read from the start instead."""
        try:
            fh = open_regular(self.path)  # kept open while following
        except OSError:
            return False
        st = os.fstat(fh.fileno())
        if ident is not None and ident != (st.st_dev, st.st_ino):
            pos, partial = 0, b""
        self.close()
        self._fh, self._ident = fh, (st.st_dev, st.st_ino)
        self.pos, self.partial = pos, partial
        self._mark = os.pread(fh.fileno(), min(pos, MARK), pos - min(pos, MARK))
        fh.seek(pos)
        return True

    def _split(self, data: bytes, out: Chunk) -> None:
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if len(self.partial) > MAX_LINE:
            self.partial = b""
            out.dropped += 1
        for line in lines:
            if len(line) > MAX_LINE:
                out.dropped += 1
            else:
                out.lines.append(line)

    def _drain(self, out: Chunk) -> None:
        data = self._fh.read(MAX_READ)
        if data:
            self.pos += len(data)
            self._mark = (self._mark + data)[-MARK:]
            self._split(data, out)

    def _rewritten(self) -> bool:
        """The file was truncated and rewritten past our position between two polls:
        the bytes before `pos` are no longer the ones we read."""
        if not self._mark:
            return False
        n = len(self._mark)
        return os.pread(self._fh.fileno(), n, self.pos - n) != self._mark

    def poll(self) -> Chunk:
        """New complete lines since the last call (possibly none)."""
        out = Chunk()
        try:
            st = os.stat(self.path)
        except OSError:
            # Gone (rotation in progress or deleted): finish what the open handle holds.
            if self._fh is not None:
                self._drain(out)
            return out
        ident = (st.st_dev, st.st_ino)
        if self._fh is None:
            if self.attach(0):
                out.notes.append("appeared")
        elif ident != self._ident:
            self._drain(out)  # lines written to the old file before it was replaced
            self.partial = b""
            if self.attach(0):
                out.notes.append("replaced")
        elif st.st_size < self.pos or (st.st_size > self.pos and self._rewritten()):
            self._fh.seek(0)
            self.pos, self.partial, self._mark = 0, b"", b""
            out.notes.append("truncated")
        if self._fh is not None and st.st_size > self.pos:
            self._drain(out)
        return out


@dataclass
class Initial:
    """The result of opening a file: lines to parse, in file order."""

    head: list[bytes]  # complete lines from the start of the file
    sampled: list[bytes]  # one line per sample offset in the middle
    tail: list[bytes]  # every complete line of the tail
    end_pos: int  # where following continues
    partial: bytes  # an incomplete last line
    size: int
    exists: bool
    ident: tuple[int, int] | None = None  # (device, inode) of what was read


class NotRegularFile(OSError):
    """A FIFO, socket or device where a log file should be: never read (it can block)."""


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """Open for reading without blocking on a FIFO; only regular files are returned."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(f"{os.fspath(path)}: not a regular file")
    os.set_blocking(fd, True)
    return open(fd, "rb")  # noqa: SIM115


def read_initial(
    path: str | os.PathLike,
    *,
    tail_bytes: int = 2 << 20,
    head_bytes: int = 64 << 10,
    samples: int = 2000,
) -> Initial:
    """Read a file for display: all of it when small, else head + samples + tail.

    Seeks rather than scans: the number of lines returned is bounded by the byte
    budgets and `samples`, whatever the file's size.
    """
    try:
        fh = open_regular(path)
    except (FileNotFoundError, NotRegularFile):
        return Initial([], [], [], 0, b"", 0, False)
    with fh:
        st = os.fstat(fh.fileno())
        size, ident = st.st_size, (st.st_dev, st.st_ino)
        if size <= tail_bytes + head_bytes:
            data = fh.read(size)
            lines = data.split(b"\n")
            partial = lines.pop()
            return Initial([], [], lines, size - len(partial), partial, size, True, ident)

        head_data = fh.read(head_bytes)
        head = head_data.split(b"\n")
        head_end = len(head_data) - len(head.pop())  # the last piece is cut at the budget

        tail_start = size - tail_bytes
        fh.seek(tail_start)
        tail_data = fh.read(tail_bytes)
        tail = tail_data.split(b"\n")
        tail_first = tail_start + len(tail[0]) + 1  # first byte of the first whole tail line
        tail = tail[1:]
        partial = tail.pop() if tail else b""

        sampled: list[bytes] = []
        span = tail_first - head_end
        if samples > 0 and span > 0:
            stride = span / samples
            last_off = -1
            for i in range(samples):
                off = head_end + int(i * stride)
                fh.seek(max(off - 1, 0))
                block = fh.read(4096)
                # Start at the first line that begins at or after `off`.
                nl = block.find(b"\n")
                if nl < 0:
                    continue
                start = max(off - 1, 0) + nl + 1
                if start <= last_off or start >= tail_first:
                    continue
                rest = block[nl + 1 :]
                end = rest.find(b"\n")
                if end < 0:
                    fh.seek(start)
                    rest = fh.readline(MAX_LINE)
                    end = rest.find(b"\n")
                    if end < 0:
                        continue
                sampled.append(rest[:end])
                last_off = start
        return Initial(head, sampled, tail, size - len(partial), partial, size, True, ident)


def read_last_lines(path: str | os.PathLike, n: int, max_bytes: int = 256 << 10) -> Initial:
    """The last `n` complete lines of a text file (for train.log)."""
    try:
        fh = open_regular(path)
    except (FileNotFoundError, NotRegularFile):
        return Initial([], [], [], 0, b"", 0, False)
    with fh:
        st = os.fstat(fh.fileno())
        size, ident = st.st_size, (st.st_dev, st.st_ino)
        start = max(0, size - max_bytes)
        fh.seek(start)
        data = fh.read(size - start)
    lines = data.split(b"\n")
    partial = lines.pop()
    if start > 0 and lines:
        lines = lines[1:]  # the first one is cut
    return Initial([], [], lines[-n:], size - len(partial), partial, size, True, ident)
