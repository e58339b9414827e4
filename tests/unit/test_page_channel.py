"""The post-copy page server's authenticated connection (agentenv.snapshot.page_channel), without CRIU: the test holds
CRIU's end of the socket pair; and which snapshots take a migration's key (agentenv.sandbox.migration)."""

from __future__ import annotations

import socket
import threading

import pytest

from agentenv.errors import CheckpointError, PageServerKeyError, status_of
from agentenv.sandbox import migration
from agentenv.snapshot import page_channel
from agentenv.snapshot.page_channel import Endpoint, Listener
from agentenv.snapshot.store import Snapshot


@pytest.fixture
def channel():
    ch = Listener("127.0.0.1")
    criu = ch.pair()
    ch.serve()
    yield ch, criu
    ch.close()
    criu.close()


def read_all(sock: socket.socket) -> bytes:
    got = b""
    while data := sock.recv(1 << 16):
        got += data
    return got


def test_the_receiver_with_the_key_is_relayed_both_ways_past_strangers_that_came_first(channel):
    ch, criu = channel
    silent = socket.create_connection(("127.0.0.1", ch.port))  # connects and says nothing
    talker = socket.create_connection(("127.0.0.1", ch.port))  # speaks CRIU's protocol at once
    talker.sendall(b"\x07\x00\x00\x00" + b"\x00" * 20)
    wrong = Endpoint("127.0.0.1", ch.port, page_channel.new_key())
    with pytest.raises(CheckpointError, match="not this migration's"):
        page_channel.connect(wrong)
    assert ch.listening()  # none of them took it
    with page_channel.connect(ch.endpoint) as sock:
        sock.sendall(b"GET pages")
        assert criu.recv(100) == b"GET pages"
        criu.sendall(b"the pages" * 100_000)  # more than one splice, both ways
        sock.sendall(b"x" * 3_000_000)
        got = b""
        while len(got) < 900_000:
            got += sock.recv(1 << 20)
        assert got == b"the pages" * 100_000
        left = 3_000_000
        while left:
            left -= len(criu.recv(1 << 20))
        assert not ch.listening()
        criu.close()  # CRIU ends: the receiver reads the end
        assert read_all(sock) == b""
    assert read_all(talker) == b""  # closed, having read nothing
    assert read_all(silent) == b""  # closed once the receiver came
    silent.close()
    talker.close()
    with pytest.raises(ConnectionRefusedError):  # the listener closed with it
        socket.create_connection(("127.0.0.1", ch.port), timeout=5)


def test_a_flood_of_silent_connections_does_not_keep_the_receiver_out(channel):
    ch, criu = channel
    flood = [socket.create_connection(("127.0.0.1", ch.port)) for _ in range(page_channel.MAX_PENDING + 20)]
    with page_channel.connect(ch.endpoint) as sock:
        sock.sendall(b"hello")
        assert criu.recv(100) == b"hello"
    for s in flood:
        s.close()


def test_close_ends_the_relay_and_the_listener(channel):
    ch, criu = channel
    sock = page_channel.connect(ch.endpoint)
    ch.close()
    assert read_all(sock) == b""
    assert criu.recv(10) == b""  # CRIU reads the end of its socket
    sock.close()
    assert not ch.listening()


def test_a_listener_never_served_closes_and_frees_its_port():
    ch = Listener("127.0.0.1")
    ch.pair().close()
    ch.close()
    ch.close()  # once
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", ch.port), timeout=5)


def test_a_receiver_refuses_a_stranger_on_the_port():
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        port = squatter.getsockname()[1]

        def answer() -> None:
            conn, _ = squatter.accept()
            with conn:
                conn.recv(100)
                conn.sendall(b"\x00" * 64 + page_channel.ACCEPTED)  # a nonce and a "proof" of its own

        stranger = threading.Thread(target=answer, daemon=True)
        stranger.start()
        with pytest.raises(CheckpointError, match="not this migration's"):
            page_channel.connect(Endpoint("127.0.0.1", port, page_channel.new_key()))
        stranger.join()
    with pytest.raises(CheckpointError, match="could not connect"):  # nobody there at all
        page_channel.connect(Endpoint("127.0.0.1", port, page_channel.new_key()))


def test_a_post_copy_snapshot_takes_its_migrations_key_and_no_other_snapshot_takes_one():
    moving = Snapshot(id="snap-a", parent_id=None, created_at=0.0, size_bytes=0, has_memory=True,
                      labels={migration.PAGE_SERVER: "127.0.0.1:4321"})
    plain = Snapshot(id="snap-b", parent_id=None, created_at=0.0, size_bytes=0, has_memory=True)
    key = page_channel.new_key()
    assert migration.page_server_of(moving, key) == Endpoint("127.0.0.1", 4321, key)
    for wrong in (None, b"", key[:-1]):
        with pytest.raises(PageServerKeyError, match="receive it with the key") as refused:
            migration.page_server_of(moving, wrong)
        assert status_of(refused.value) == 400  # the request is wrong, not the restore
    assert migration.page_server_of(plain) is None
    with pytest.raises(PageServerKeyError, match="not a post-copy"):
        migration.page_server_of(plain, key)
