"""The host link (`_hostlink`): two real Unix sockets of one process, each end driven by
its own thread as a rank would be. Its use under msrun (pipeline exchanges, the step's
two-rank sums, `gather_rows`) is checked by every two-worker layout in
`test_parallel_msrun.py` against one process; the engine's layouts there run with links
off, so the AllReduce transport keeps its own check."""

from __future__ import annotations

import os
import tempfile
import threading

import numpy as np
import pytest
from mindloom_parallel import _hostlink as H


@pytest.fixture()
def pair():
    """(link of rank 0, link of rank 1), connected through a socket under a fresh dir."""
    d = tempfile.mkdtemp(prefix="mlk-test-", dir="/tmp")
    path = os.path.join(d, "s.sock")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("server", H._listen(path)))
    t.start()
    client = H._connect(path)
    t.join(10)
    a, b = H.HostLink(got["server"], 1), H.HostLink(client, 0)
    assert not os.path.exists(path), "the rendezvous path stays on disk after connecting"
    yield a, b
    a.close()
    b.close()
    os.rmdir(d)


def _both(fa, fb, timeout=20.0):
    """Run fa and fb at once (the two ranks); their results, or their exceptions raised."""
    out = {}

    def run(key, fn):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out[key] = e

    ts = [threading.Thread(target=run, args=(k, f), daemon=True) for k, f in (("a", fa), ("b", fb))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "the exchange did not finish (deadlock)"
    return out["a"], out["b"]


def test_both_ways_at_once_larger_than_the_socket_buffers(pair):
    # 8 MB each way: a send-then-receive exchange fills both sockets' buffers and hangs
    a, b = pair
    rng = np.random.default_rng(0)
    xa = rng.standard_normal((2048, 1024)).astype(np.float32)
    xb = rng.standard_normal((2048, 1024)).astype(np.float32)
    ga, gb = _both(lambda: a.exchange(xa, xb.shape, np.float32),
                   lambda: b.exchange(xb, xa.shape, np.float32))  # fmt: skip
    np.testing.assert_array_equal(ga, xb)
    np.testing.assert_array_equal(gb, xa)


def test_one_way_messages_arrive_in_order_with_their_dtype(pair):
    a, b = pair
    msgs = [np.arange(5, dtype=np.float32), np.arange(7, dtype=np.int32).reshape(7, 1),
            np.full((3, 2), 2.5, np.float64)]  # fmt: skip

    def send():
        for m in msgs:
            assert a.exchange(m, None, None) is None
        return True

    def receive():
        return [b.exchange(None, m.shape, m.dtype) for m in msgs]

    _, got = _both(send, receive)
    for m, g in zip(msgs, got):
        assert g.dtype == m.dtype
        np.testing.assert_array_equal(g, m)


def test_a_message_of_another_size_is_refused_not_read(pair):
    a, b = pair
    _, err = _both(lambda: a.exchange(np.zeros(50, np.float32), None, None),
                   lambda: b.exchange(None, (100,), np.float32))  # fmt: skip
    assert isinstance(err, H.HostLinkError)
    assert "expected message 0 of 400 bytes" in str(err) and "of 200 bytes" in str(err)


def test_a_peer_that_is_gone_raises_instead_of_waiting(pair):
    a, b = pair
    a.close()
    with pytest.raises(H.HostLinkError, match="rank 0"):
        b.exchange(None, (4,), np.float32)


def test_links_can_be_switched_off():
    try:
        H.set_host_links(False)
        calls = []
        assert H.link_between((0, 1), 0, lambda x: calls.append(x) or x) is None
        assert calls == [], "a disabled link still ran its handshake collective"
        H.set_host_links(None)
        os.environ["MINDLOOM_HOST_LINK"] = "0"
        assert not H.host_links_enabled()
    finally:
        os.environ.pop("MINDLOOM_HOST_LINK", None)
        H.set_host_links(None)
    assert H.host_links_enabled()


def test_the_handshake_pieces_carry_40_bits_through_float32():
    for v in (0, 1, (1 << 40) - 1, 0x9ABCDEF012, H._host_identity()):
        lo, hi = (np.float32(p) for p in H._split20(v))
        assert int(lo) | int(hi) << 20 == v
    assert H._host_identity() == H._host_identity()


def test_a_temporary_directory_too_long_for_a_socket_name_falls_back_to_tmp(monkeypatch):
    long_dir = tempfile.mkdtemp(prefix="x" * 90, dir="/tmp")
    try:
        monkeypatch.setattr(tempfile, "tempdir", long_dir)
        assert H.socket_dir() == "/tmp"
        monkeypatch.setattr(tempfile, "tempdir", "/tmp")
        assert H.socket_dir() == "/tmp"
    finally:
        os.rmdir(long_dir)
