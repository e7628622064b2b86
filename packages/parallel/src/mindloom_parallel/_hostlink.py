"""Two ranks of one host talking over a Unix socket: the CPU backend's point-to-point.

Why not the collectives: on the CPU backend MindSpore has no Send/Receive, so a pipeline
exchange was an AllReduce of both ranks' buffers. Measured on the 2-core machine under
msrun: an AllReduce took 3-10 ms whatever its size (4 bytes to 512 KB), and a rank waiting
in one burns a whole core (3.16 CPU-s over a 3 s wait), the core the other pipeline stage
was computing on. Over this socket the waiting rank sleeps in ``select``; the compiled pp2
step (debug preset) went from ~74 to ~49 ms in a harness alternating both transports in
one launch.

A link is made at the first exchange between two ranks: one AllReduce on their group (the
caller's ``reduce``) agrees a random rendezvous name and compares the ranks' host
identities (host name, boot id, the socket directory's device and inode). On one host
the lower rank listens on ``<socket_dir>/mlk-<name>.sock`` and the other connects; the
path is unlinked as soon as they are connected, so nothing is left on disk. On different
hosts, or with ``MINDLOOM_HOST_LINK=0``, there is no link and the caller keeps the
AllReduce.

Every message carries a header (magic, sequence number, byte count); a message that is not
the one the schedule expects is refused with both descriptions instead of read as data.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import tempfile
import time
import zlib

import numpy as np

__all__ = ["HostLink", "HostLinkError", "host_links_enabled", "link_between", "set_host_links"]

_HEADER = struct.Struct("<4sIQ")  # magic, sequence number, payload bytes
_MAGIC = b"MLK1"
_CONNECT_TIMEOUT_S = 120.0  # the peer may still be compiling when this rank gets here

_links: dict[tuple[int, int], HostLink | None] = {}
_enabled: bool | None = None


class HostLinkError(RuntimeError):
    """The link broke (peer gone) or carried a message the schedule did not expect."""


def host_links_enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return os.environ.get("MINDLOOM_HOST_LINK", "1") != "0"


def set_host_links(enabled: bool | None) -> None:
    """Use links for the exchanges set up from now on (None: back to the environment's
    ``MINDLOOM_HOST_LINK``). Both ranks of a pair must make the same choice."""
    global _enabled
    _enabled = enabled
    for link in _links.values():
        if link is not None:
            link.close()
    _links.clear()


class HostLink:
    """A connected socket to one peer; ``exchange`` sends and receives at once."""

    def __init__(self, sock: socket.socket, peer: int):
        self.sock, self.peer = sock, peer
        self.sock.setblocking(False)
        self._sent = 0
        self._received = 0

    def close(self) -> None:
        self.sock.close()

    def exchange(self, out: np.ndarray | None, shape, dtype) -> np.ndarray | None:
        """Send ``out`` (or nothing) and receive an array of ``shape``/``dtype`` (or None).
        Full duplex: a send larger than the socket's buffers cannot deadlock against the
        peer's own send."""
        pending = b""
        if out is not None:
            payload = np.ascontiguousarray(out).tobytes()
            pending = _HEADER.pack(_MAGIC, self._sent & 0xFFFFFFFF, len(payload)) + payload
            self._sent += 1
        want = None if shape is None else int(np.prod(shape)) * np.dtype(dtype).itemsize
        head = bytearray(_HEADER.size)
        body = bytearray(want or 0)
        got, sent = 0, 0
        total = 0 if want is None else _HEADER.size + want
        view = memoryview(pending)
        while sent < len(pending) or got < total:
            readable, writable, _ = select.select(
                [self.sock] if got < total else [], [self.sock] if sent < len(pending) else [], []
            )
            if writable:
                sent += self._io(self.sock.send, view[sent:])
            if readable:
                if got < _HEADER.size:
                    got += self._recv(memoryview(head)[got:])
                    if got == _HEADER.size:
                        self._check(head, want)
                else:
                    got += self._recv(memoryview(body)[got - _HEADER.size :])
        if want is None:
            return None
        self._received += 1
        return np.frombuffer(body, dtype).reshape(tuple(shape))

    def _recv(self, view) -> int:
        n = self._io(self.sock.recv_into, view)
        if n == 0:
            raise HostLinkError(f"host link to rank {self.peer}: the peer closed the connection")
        return n

    def _io(self, fn, view) -> int:
        try:
            return fn(view)
        except BlockingIOError:
            return 0
        except OSError as e:  # reset or broken pipe: the peer process is gone
            raise HostLinkError(f"host link to rank {self.peer}: {e}") from e

    def _check(self, head, want) -> None:
        magic, seq, n = _HEADER.unpack(head)
        expect = self._received & 0xFFFFFFFF
        if magic != _MAGIC or seq != expect or n != want:
            raise HostLinkError(
                f"host link to rank {self.peer}: expected message {expect} of {want} bytes, "
                f"got {magic!r} message {seq} of {n} bytes (the ranks' schedules differ)"
            )


def socket_dir() -> str:
    """Where the rendezvous socket goes: the temporary directory, or /tmp where that path is
    too long for a Unix socket's name (108 bytes on Linux)."""
    d = tempfile.gettempdir()
    return d if len(d) <= 80 or not os.path.isdir("/tmp") else "/tmp"


def _host_identity() -> int:
    """A 40-bit digest of what makes two processes share the socket directory and a kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    st = os.stat(socket_dir())
    text = f"{socket.gethostname()}|{boot}|{st.st_dev}|{st.st_ino}"
    return zlib.crc32(text.encode()) << 8 | zlib.adler32(text.encode()) & 0xFF


def _split20(v: int) -> list[float]:  # float32 carries 24 bits exactly: 20-bit pieces
    return [float((v >> s) & 0xFFFFF) for s in (0, 20)]


def link_between(ranks: tuple[int, int], index: int, reduce) -> HostLink | None:
    """The link of this rank (``ranks[index]``) to the other of ``ranks``, made on first use
    (both ranks must call this at the same point), or None where there can be none.

    ``reduce(np.ndarray float32) -> np.ndarray``: a sum over the two ranks (an AllReduce on
    their group), used once to agree the rendezvous name and compare hosts."""
    key = tuple(sorted(ranks))
    if key in _links:
        return _links[key]
    if not host_links_enabled():
        return None
    me, peer = ranks[index], ranks[1 - index]
    lower = me == key[0]
    token = secrets.randbits(40) if lower else 0
    slots = np.zeros(6, np.float32)
    slots[0:2] = _split20(token)
    slots[(2 if lower else 4) : (4 if lower else 6)] = _split20(_host_identity())
    got = np.asarray(reduce(slots), np.float64).astype(np.int64)
    if got[2] != got[4] or got[3] != got[5]:
        _links[key] = None  # different hosts
        return None
    name = f"{int(got[0]) | int(got[1]) << 20:010x}"
    path = os.path.join(socket_dir(), f"mlk-{name}.sock")
    sock = _listen(path) if lower else _connect(path)
    _links[key] = link = HostLink(sock, peer)
    return link


def _listen(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
        server.listen(1)
        server.settimeout(_CONNECT_TIMEOUT_S)
        try:
            sock, _ = server.accept()
        except TimeoutError as e:
            raise HostLinkError(f"host link: no peer connected to {path} in "
                                f"{_CONNECT_TIMEOUT_S:.0f} s") from e  # fmt: skip
    finally:
        server.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return sock


def _connect(path: str) -> socket.socket:
    deadline = time.monotonic() + _CONNECT_TIMEOUT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as e:
            sock.close()
            if time.monotonic() > deadline:
                raise HostLinkError(f"host link: could not connect to {path} in "
                                    f"{_CONNECT_TIMEOUT_S:.0f} s") from e  # fmt: skip
            time.sleep(0.005)
