"""Issue 40, finding 8: strangers at a post-copy migration's page server. Another local user (``nobody``), or a
root process that is not the receiver, connects to the page server before the receiver does, holds the
connection or asks it for pages; or takes the page server's port once it is gone and feeds a receiver pages of its
own. The receiver must still get every page, the strangers none, and no receiver takes a page from a stranger."""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import agentenv
from agentenv.config import paths
from agentenv.errors import CheckpointError
from agentenv.sandbox import migration

pytestmark = pytest.mark.integration

MARK = b"issue40-pagemark"  # at the start of every page of the sandbox's 16 MiB
# the sandbox's process: its pid (in the sandbox) and the address of its bytes in /tmp/ready; each connection to
# port 7001 answers the sha256 of the bytes as they are in memory now
HOLDER = f"""import ctypes, hashlib, os, socket
data = bytearray(os.urandom(16 << 20))
for i in range(0, len(data), 4096):
    data[i:i + 16] = {MARK!r}
addr = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
srv = socket.create_server(("127.0.0.1", 7001))
open("/tmp/ready", "w").write(f"{{os.getpid()}} {{addr}}")
while True:
    c, _ = srv.accept()
    c.sendall(hashlib.sha256(data).hexdigest().encode()); c.close()
"""
QUERY = "python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', 7001)).recv(100).decode())\""

# A stranger, run as its own process. "talk": connects and asks for 16 pages of the process (CRIU's page server
# protocol: struct page_server_iov {u32 cmd; u32 nr_pages; u64 vaddr; u64 dst_id}, PS_IOV_GET = 7), then reads.
# "hold": connects and says nothing. "serve": listens on the port itself and answers every request with forged
# pages, saying "served" each time. Each says "ready" once it is in place (or "refused": nothing listens on the
# port), works until its stdin closes, then writes what it read ("talk", "hold") or "done <pages served>".
STRANGER = r"""import select, socket, struct, sys
mode, port = sys.argv[1], int(sys.argv[2])
got, served = b"", 0
if mode == "serve":
    srv = socket.create_server(("127.0.0.1", port))
    print("ready", flush=True)
    conns = []
    while True:
        ready = select.select([srv, sys.stdin, *conns], [], [])[0]
        if sys.stdin in ready:
            break
        if srv in ready:
            conns.append(srv.accept()[0])
        for c in [c for c in conns if c in ready]:
            head = c.recv(24, socket.MSG_WAITALL)
            cmd = struct.unpack("<I", head[:4])[0] & 0xFFFF if len(head) == 24 else 0
            if cmd == 7:  # PS_IOV_GET: PS_IOV_ADD_F with PE_PRESENT, then the pages
                nr = struct.unpack("<I", head[4:8])[0]
                c.sendall(struct.pack("<I", 1 << 16 | 6) + head[4:] + b"FORGED!!" * 512 * nr)
                served += nr
                print("served", flush=True)
            elif cmd in (0x1023, 0x1024):  # PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE: the final status
                c.sendall(struct.pack("<i", 0))
            else:
                c.close()
                conns.remove(c)
    print(f"done {served}", flush=True)
    sys.exit(0)
try:
    sk = socket.create_connection(("127.0.0.1", port))
except ConnectionRefusedError:
    print("refused", flush=True)
    sys.exit(0)
if mode == "talk":
    vpid, vaddr = int(sys.argv[3]), int(sys.argv[4])
    sk.sendall(struct.pack("<IIQQ", 7, 16, (vaddr + 4095) & ~4095, vpid))
print("ready", flush=True)
while True:
    ready = select.select([sk, sys.stdin], [], [])[0]
    if sk in ready:
        data = sk.recv(1 << 20)
        if not data:
            break
        got += data
    if sys.stdin in ready:
        break
sys.stdout.buffer.write(got)
"""


class Stranger:
    """A STRANGER process as ``user`` ("nobody" or "root"), in place once constructed."""

    def __init__(self, mode: str, port: int, user: str, *args: int) -> None:
        ids = {} if user == "root" else {"user": pwd.getpwnam(user).pw_uid, "group": pwd.getpwnam(user).pw_gid,
                                         "extra_groups": []}
        self.proc = subprocess.Popen([os.path.realpath(sys.executable), "-I", "-c", STRANGER, mode, str(port),
                                      *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, cwd="/", **ids)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line in (b"ready\n", b"refused\n"), line + self.proc.stderr.read() if self.proc.stderr else line
        self.connected = line == b"ready\n"

    def finish(self) -> bytes:
        """Everything it wrote after its first line, once it ended (closing its stdin ends it)."""
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err
        return out


@pytest.fixture
def marked():
    sb = agentenv.Sandbox.create(memory="256m")
    sb.write_file("/tmp/holder.py", HOLDER)
    sb.spawn("python3 /tmp/holder.py")
    assert sb.exec("while [ ! -s /tmp/ready ]; do sleep 0.05; done", timeout=60).exit_code == 0
    vpid, addr = map(int, sb.read_file("/tmp/ready").split())
    yield sb, vpid, addr
    sb.close()


def query(sb: agentenv.Sandbox) -> str:
    r = sb.exec(QUERY, timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("user", ["nobody", "root"])
def test_strangers_connecting_first_neither_take_the_page_server_nor_read_a_page(marked, user):
    sb, vpid, addr = marked
    before = query(sb)
    out = migration.send(sb)
    strangers: list[Stranger] = []
    try:
        strangers.append(Stranger("talk", out.server.port, user, vpid, addr))
        strangers.append(Stranger("hold", out.server.port, user))
        assert all(s.connected for s in strangers) and out.server.listening(), \
            "a stranger took the page server: it no longer listens for the receiver"
        moved = agentenv.Sandbox.restore(out.snapshot, page_server_key=out.key)
        try:
            assert query(moved) == before  # every page the receiver faulted in is the sandbox's
            assert migration.all_in(moved, 120)
            assert out.finish(True)
            assert query(moved) == before
        finally:
            moved.close()
    finally:
        got = [s.finish() for s in strangers]
        if out.moved is None:
            out.finish(False)
        assert not any(MARK in g for g in got), "a stranger read the sandbox's memory from its page server"


def end_restores_fed_by(squatter: Stranger, said: list[bytes]) -> threading.Thread:
    """A thread that collects what the squatter says into ``said`` and, once it served a page, kills the receiving
    CRIU of this test's home: a restore fed forged pages may wait forever for its dying processes."""
    def watch() -> None:
        assert squatter.proc.stdout is not None
        home = str(paths().sandboxes).encode()
        for line in squatter.proc.stdout:
            said.append(line)
            if line != b"served\n" or said.count(line) > 1:
                continue
            for pid in filter(str.isdigit, os.listdir("/proc")):
                with contextlib.suppress(OSError):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if cmd[0].endswith(b"criu") and cmd[1:2] in ([b"restore"], [b"lazy-pages"]) and any(home in a for a in cmd):
                        os.kill(int(pid), signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_stranger_on_the_port_of_a_page_server_that_is_gone_feeds_no_receiver(marked):
    sb, _, _ = marked
    before = query(sb)
    out = migration.send(sb)
    out.server.abandon()  # the page server ended (its deadline, say) while the receiver still holds the snapshot
    squatter = Stranger("serve", out.server.port, "nobody")
    said: list[bytes] = []
    watch = end_restores_fed_by(squatter, said)
    try:
        try:
            moved = agentenv.Sandbox.restore(out.snapshot, page_server_key=out.key)
        except Exception as e:  # noqa: BLE001 - which error it was is asserted below
            refused: Exception | None = e
        else:
            moved.close()
            refused = None
    finally:
        squatter.proc.stdin.close()
        watch.join()
        assert squatter.proc.wait() == 0
        assert not out.finish(False)
    assert said == [b"done 0\n"], f"the receiver took pages from a stranger: {said}"
    assert isinstance(refused, CheckpointError) and "page server" in str(refused), refused
    assert query(sb) == before  # the source runs on, whole
