"""Snapshots that move between two real servers (separate homes, so separate stores, volumes and uid leases; the
same Docker engine): a restore elsewhere has the files and the memory; a damaged chunk, in flight or on disk, is
refused with nothing kept; a cut-off import resumes where it stopped."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import agentenv
from agentenv.errors import ConnectionLost, TransferError
from agentenv.remote.client import Client
from agentenv.remote.pool import import_snapshot

from .server_fixtures import TOKEN, separate_servers

SMALL = 64 << 10  # chunk size for the tests: a small memory snapshot still spans many chunks
# a process whose secret lives only in its memory (the file is gone): on SIGUSR1 it writes it out
HOLDER = ("import os, signal\nv = open('/tmp/v').read(); open('/tmp/pid', 'w').write(str(os.getpid()))\n"
          "os.unlink('/tmp/v')\n"
          "signal.signal(signal.SIGUSR1, lambda *a: open('/tmp/out', 'w').write(v))\nwhile True: signal.pause()\n")


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[list[str], list[Path]]]:
    with separate_servers(("1", "4"), "agentenv-xfer-") as found:  # A holds one sandbox at a time
        yield found


class Proxy:
    """A loopback TCP proxy that damages the replies once ``after`` bytes of them (all connections together) have
    passed: ``cut`` closes that connection there, ``flip`` inverts that byte."""

    def __init__(self, target: str, after: int, mode: str) -> None:
        self.port = int(target.rsplit(":", 1)[1])
        self.after, self.mode, self.done = after, mode, threading.Event()
        self.seen, self.lock = 0, threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while data := src.recv(65536):
                if reply:
                    with self.lock:  # the reply bytes of every connection, counted together
                        at, self.seen = self.after - self.seen, self.seen + len(data)
                    if not self.done.is_set() and 0 <= at < len(data):
                        self.done.set()
                        if self.mode == "cut":
                            dst.sendall(data[:at])
                            break
                        data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):  # shutdown first: it wakes the other direction's recv (close alone would not)
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.sock.close()


def holder(sb: Any, secret: str) -> None:
    sb.write_file("/tmp/v", secret)
    sb.write_file("/tmp/holder.py", HOLDER)
    sb.spawn("python3 /tmp/holder.py")
    assert sb.exec("while [ -e /tmp/v ]; do sleep 0.05; done; echo gone", timeout=30).stdout == "gone\n"


def has_memory(sb: Any, secret: str) -> None:
    r = sb.exec("kill -USR1 $(cat /tmp/pid) && while [ ! -s /tmp/out ]; do sleep 0.05; done; cat /tmp/out", timeout=30)
    assert r.stdout == secret


def test_restore_and_move_to_another_server_keep_files_and_memory(servers):
    urls, _ = servers
    with agentenv.Pool(urls, TOKEN) as pool:
        a = pool.clients[0].Sandbox.create(memory="256m")
        a.write_file("/srv/data.bin", os.urandom(300_000))
        data = a.read_file("/srv/data.bin")
        holder(a, "s3cret")
        snap = a.snapshot(memory=True)
        b = pool.Sandbox.restore(snap)  # A, the owner, is full: the restore goes to B, which pulls the snapshot
        assert b.client.url == urls[1]
        assert b.read_file("/srv/data.bin") == data
        has_memory(b, "s3cret")
        assert snap.id in {s.id for s in pool.clients[1].Snapshot.list()}
        b.close()
        again = pool.Sandbox.restore(snap, server=urls[1])  # B has it now: no pull, the same state
        has_memory(again, "s3cret")
        again.close()
        a.set_ttl(3000)
        moved = pool.Sandbox.move(a, urls[1])  # pause on A, restore on B
        assert moved.client.url == urls[1] and moved.read_file("/srv/data.bin") == data
        assert moved.expires_at is not None and moved.expires_at > time.time() + 2000  # what was left of a's deadline
        has_memory(moved, "s3cret")
        assert a.id not in {s.id for s in pool.clients[0].Sandbox.list()}
        moved.close()
        for c in pool.clients:
            for s in c.Snapshot.list():
                s.delete()


@pytest.fixture
def snapshot_on_a(servers) -> Iterator[tuple[Client, Client, str, bytes]]:
    urls, _ = servers
    ca, cb = Client(urls[0], TOKEN, retries=0), Client(urls[1], TOKEN, retries=0)
    sb = ca.Sandbox.create(memory="256m")
    sb.write_file("/srv/f", os.urandom(200_000))
    data = sb.read_file("/srv/f")
    holder(sb, "x")
    snap = sb.snapshot(memory=True)
    sb.close()
    try:
        yield ca, cb, snap.id, data
    finally:
        for c in (ca, cb):
            for s in c.Snapshot.list():
                s.delete()
            c.close()


def test_a_chunk_damaged_in_flight_or_on_disk_is_refused(servers, snapshot_on_a):
    ca, cb, sid, data = snapshot_on_a
    proxy = Proxy(ca.url, 300_000, "flip")
    try:
        with pytest.raises(TransferError, match="damaged"):
            import_snapshot(cb, Client(proxy.url, TOKEN), sid, chunk_size=SMALL, retries=0)
    finally:
        proxy.close()
    assert proxy.done.is_set()
    assert sid not in {s.id for s in cb.Snapshot.list()}  # nothing half-made is listed
    manifest = ca.request("GET", f"/v1/snapshots/{sid}/export", params={"chunk": SMALL})
    archive = servers[1][0] / "exports" / sid / "archive"
    with open(archive, "r+b") as f:  # on the sender's disk, after its digests were taken
        f.seek(manifest["size"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(TransferError, match="damaged"):
        import_snapshot(cb, ca, sid, chunk_size=SMALL, retries=0)
    assert sid not in {s.id for s in cb.Snapshot.list()}
    ca.request("DELETE", f"/v1/snapshots/{sid}/export")  # packed again from the store: good
    done = import_snapshot(cb, ca, sid, chunk_size=SMALL)
    assert done["resumed_at"] > 0  # the chunks before the damaged one were kept
    with cb.Sandbox.restore(sid) as sb:
        assert sb.read_file("/srv/f") == data


def test_a_cut_off_import_resumes_and_gives_the_same_snapshot(servers, snapshot_on_a):
    ca, cb, sid, data = snapshot_on_a
    manifest = ca.request("GET", f"/v1/snapshots/{sid}/export", params={"chunk": SMALL})
    assert len(manifest["digests"]) >= 8
    proxy = Proxy(ca.url, manifest["size"] // 2, "cut")
    try:
        with pytest.raises(ConnectionLost):
            import_snapshot(cb, Client(proxy.url, TOKEN), sid, chunk_size=SMALL, retries=0)
    finally:
        proxy.close()
    assert sid not in {s.id for s in cb.Snapshot.list()}
    done = import_snapshot(cb, ca, sid, chunk_size=SMALL)
    assert 0 < done["resumed_at"] < done["chunks"] and done["fetched"] == done["chunks"] - done["resumed_at"]
    sb = cb.Sandbox.restore(sid)
    assert sb.read_file("/srv/f") == data
    has_memory(sb, "x")
    sb.close()
    assert not (servers[1][1] / "imports" / f".part-{sid}").exists()
