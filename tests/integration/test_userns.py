"""Root in a sandbox is nobody on the host (issue 23): every sandbox runs in a user namespace of its own whose ids
are an unprivileged host range, one per fork family, kept by snapshots, restores and forks."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import agentenv
from agentenv.config import paths
from agentenv.host import userns

pytestmark = pytest.mark.integration


def _uid_map(sb: agentenv.Sandbox) -> tuple[int, int, int]:
    r = sb.exec("cat /proc/self/uid_map")
    assert r.exit_code == 0, r.stderr
    inside, outside, size = (int(x) for x in r.stdout.split())
    return inside, outside, size


def _root_uid(sb: agentenv.Sandbox) -> int:
    uids = sb.container_spec().uids
    assert uids is not None
    return uids


@pytest.fixture
def sb():
    s = agentenv.Sandbox.create()
    yield s
    s.close()


def test_root_in_the_sandbox_is_an_unprivileged_host_uid(sb):
    """uid_map shows 0 mapped to the sandbox's range, never the host's root; its processes are that uid on the
    host, and a file its root writes belongs to that uid on the host's disk."""
    inside, outside, size = _uid_map(sb)
    assert (inside, size) == (0, userns.SIZE) and outside == _root_uid(sb) >= userns.FIRST
    assert sb.exec("id -u").stdout.strip() == "0"  # still root in there: images work as they did
    pid = sb.record.init_pid
    status = Path(f"/proc/{pid}/status").read_text()
    real = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
    assert real == outside  # the agent, the sandbox's PID 1, as the host sees it
    assert sb.exec("echo hi > /root/made-by-root && mkdir /srv/d && chown 1000:1000 /srv/d").exit_code == 0
    st = (sb.lifecycle.container.upper / "root" / "made-by-root").stat()
    assert (st.st_uid, st.st_gid) == (outside, outside)
    st = (sb.lifecycle.container.upper / "srv" / "d").stat()
    assert (st.st_uid, st.st_gid) == (outside + 1000, outside + 1000)
    # the image's files, root's on the host's disk, are the sandbox's root's in there (idmapped layers)
    assert sb.exec("stat -c %u:%g /etc/passwd /usr/bin").stdout.split() == ["0:0", "0:0"]


@pytest.fixture
def host_dir():
    """A folder of the host's root that anyone may pass through (pytest's own tmp folders are closed: a refusal
    there would only say that the path cannot be walked)."""
    d = Path(tempfile.mkdtemp(dir="/var/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_a_process_in_only_the_sandboxs_user_namespace_holds_nothing_on_the_host(sb, host_dir):
    """An escape to the host's mount namespace, as the sandbox's root (a helper that enters only the sandbox's user
    namespace, from the host): every privileged operation on a host path is refused."""
    tmp_path = host_dir
    victim = tmp_path / "host-file"
    victim.write_text("host\n")
    victim.chmod(0o644)
    pid = sb.record.init_pid
    script = (
        "import os, ctypes, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"fd = os.open('/proc/{pid}/ns/user', os.O_RDONLY)\n"
        "assert libc.setns(fd, 0x10000000) == 0, ctypes.get_errno()\n"
        "os.setgid(0); os.setuid(0)\n"  # root of the sandbox's namespace: full capabilities there, none here
        "out = []\n"
        "def attempt(name, fn):\n"
        "    try:\n"
        "        fn(); out.append(name + ':done')\n"
        "    except OSError as e:\n"
        "        out.append(name + ':' + str(e.errno))\n"
        f"attempt('chown', lambda: os.chown('{victim}', 0, 0))\n"
        f"attempt('write', lambda: open('{victim}', 'a').write('pwned'))\n"
        "attempt('shadow', lambda: open('/etc/shadow').read())\n"
        f"attempt('create', lambda: open('{tmp_path}/new', 'w'))\n"
        "rc = libc.mount(b'tmpfs', b'/mnt', b'tmpfs', 0, None)\n"
        "out.append('mount:' + ('done' if rc == 0 else str(ctypes.get_errno())))\n"
        "print(' '.join(out))\n"
    )
    r = subprocess.run(["python3", "-c", script], capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    got = dict(item.split(":") for item in r.stdout.split())
    assert got == {"chown": "1", "write": "13", "shadow": "13", "create": "13", "mount": "1"}, r.stdout
    assert victim.read_text() == "host\n" and victim.stat().st_uid == os.getuid()


def test_forks_snapshots_and_restores_keep_the_family_range_and_families_differ(sb):
    """A fork family shares one range (its files are its uids on disk); another sandbox from an image gets
    another."""
    sb.exec("echo kept > /root/f")
    root = _root_uid(sb)
    other = agentenv.Sandbox.create()
    try:
        assert _uid_map(other)[1] != root
    finally:
        other.close()
    snap = sb.snapshot(memory=True)
    try:
        kids = sb.fork(2) + [agentenv.Sandbox.restore(snap)]
        try:
            for k in kids:
                assert _uid_map(k)[1] == root and k.exec("cat /root/f").stdout == "kept\n"
                assert k.exec("echo mine > /root/g").exit_code == 0
                assert (k.lifecycle.container.upper / "root" / "g").stat().st_uid == root
        finally:
            for k in kids:
                k.close()
    finally:
        snap.delete()


def test_a_range_is_held_while_its_family_lives_and_then_free(sb):
    """The lease of a family's range counts its holders (sandbox bundles, snapshot folders); when the last goes,
    nothing holds it and a new family may take it."""
    lease = paths().home / "uids" / str(userns.index_of(_root_uid(sb)))
    assert lease.stat().st_nlink == 2  # the lease itself and the sandbox's bundle
    snap = sb.snapshot()
    assert lease.stat().st_nlink == 3
    snap.delete()
    assert lease.stat().st_nlink == 2
    sb.close()
    assert lease.stat().st_nlink == 1


ECHO_PAIR = r'''
import os, socket, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 7000)); srv.listen()
cli = socket.create_connection(("127.0.0.1", 7000)); conn, _ = srv.accept()
open("/tmp/ready", "w").close()
while True:  # a line written to /tmp/in goes through the established connection, back into /tmp/out
    if os.path.exists("/tmp/in"):
        cli.sendall(open("/tmp/in", "rb").read()); os.unlink("/tmp/in")
        open("/tmp/out", "ab").write(conn.recv(100))
    time.sleep(0.01)
'''


def test_a_loopback_connection_comes_back_established_in_a_restore(sb):
    """CRIU makes a restored sandbox's network namespace empty; the host brings its loopback up before any socket
    comes back (restore.NamespaceHook), so connections between its own processes survive a pause and a restore."""
    sb.write_file("/tmp/pair.py", ECHO_PAIR)
    sb.spawn("python3 /tmp/pair.py")
    assert sb.exec("for i in $(seq 100); do test -e /tmp/ready && break; sleep 0.1; done; test -e /tmp/ready"
                   ).exit_code == 0
    snap = sb.snapshot(memory=True)
    try:
        with agentenv.Sandbox.restore(snap) as r:
            r.write_file("/tmp/in", "through\n")
            out = r.exec("for i in $(seq 100); do test -s /tmp/out && break; sleep 0.1; done; cat /tmp/out")
            assert out.stdout == "through\n"
    finally:
        snap.delete()


def test_a_range_past_the_low_ones_works_and_leaves_no_bound_namespace(sb, monkeypatch):
    """Past the low ranges a start makes its range's user namespace and binds it nowhere (kept binds would fill
    the mount table runc reads at every start): the image's files are still root's inside, what the sandbox writes
    is its range's on the host, and a fork of its family starts the same way."""
    def pinned() -> set[Path]:  # (the suite's earlier low-range families left pins: those are not this test's)
        return {p for p in (paths().home / "uids").glob("*.userns") if os.path.ismount(p)}

    monkeypatch.setattr(userns, "LOW", 1)
    monkeypatch.setattr(userns.random, "randrange", lambda n: 0)
    before = pinned()
    made = [agentenv.Sandbox.create(), agentenv.Sandbox.create()]  # at most one of them gets the one low range
    try:
        past = next(s for s in made if userns.index_of(_root_uid(s)) >= 1)
        root = _root_uid(past)
        assert _uid_map(past)[1] == root
        assert past.exec("stat -c %u /etc/passwd").stdout == "0\n"  # the idmapped image layer
        assert past.exec("echo mine > /root/g").exit_code == 0
        assert (past.lifecycle.container.upper / "root" / "g").stat().st_uid == root
        bound = paths().home / "uids" / f"{userns.index_of(root)}.userns"
        assert bound not in pinned() - before
        kid = past.fork(1)[0]
        try:
            assert _uid_map(kid)[1] == root and kid.exec("cat /root/g").stdout == "mine\n"
        finally:
            kid.close()
        assert bound not in pinned() - before
    finally:
        for s in made:
            s.close()
