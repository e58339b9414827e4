"""A snapshot store that outlives a node: two real servers (separate homes) with the same ``--shared-store``. A
sandbox paused on A resumes on B once A is killed and its home deleted (its files and a process's memory
intact); a damaged shared copy is refused with nothing kept; deleting a snapshot drops its shared copy."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import agentenv
from agentenv.errors import SnapshotNotFound, TransferError

from .conftest import cleanup, leaked
from .server_fixtures import TOKEN, free_port, start_server_process, write_transfer_key
from .test_transfer import has_memory, holder


@pytest.fixture
def pair() -> Iterator[tuple[list[str], list[Path], list[subprocess.Popen[bytes]], Path]]:
    """Servers A and B, each its own home, one shared store; yields urls, homes, processes, the shared store."""
    homes = [Path(tempfile.mkdtemp(prefix="agentenv-shared-", dir="/var/tmp")) for _ in range(2)]
    shared = Path(tempfile.mkdtemp(prefix="agentenv-shared-store-", dir="/var/tmp"))
    token = shared.parent / f"{shared.name}.token"
    token.write_text(TOKEN + "\n")
    key = write_transfer_key(homes[1])  # the key the servers of one shared store share (A's home goes)
    procs: list[subprocess.Popen[bytes]] = []
    ports = [free_port() for _ in homes]
    try:
        for home, port in zip(homes, ports, strict=True):
            procs.append(start_server_process(port, token, "--shared-store", str(shared), "--transfer-key", str(key),
                                              env={"AGENTENV_HOME": str(home)}))
        yield [f"http://127.0.0.1:{p}" for p in ports], homes, procs, shared
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
        left = {str(home): leaked(home) for home in homes if home.exists()}
        for home in homes:
            cleanup(home)
        shutil.rmtree(shared, ignore_errors=True)
        token.unlink(missing_ok=True)
        assert not any(left.values()), left


def shared_ids(shared: Path) -> set[str]:
    """The snapshots in the shared store; nothing else may be left beside them (in the hosts' staging folders)."""
    staged = [p.name for d in shared.glob(".staging-*") for p in d.iterdir()]
    assert not staged, staged
    return {d.name for d in shared.iterdir() if not d.name.startswith(".staging-")}


def test_a_sandbox_paused_on_a_dead_server_resumes_on_another(pair):
    urls, homes, procs, shared = pair
    with agentenv.Pool(urls, TOKEN) as pool:
        a = pool.clients[0].Sandbox.create(memory="256m")
        a.write_file("/srv/state.txt", "kept on the shared store\n")
        holder(a, "n0de-l0ss")
        snap = a.pause()
        assert shared_ids(shared) == {snap.id}  # published, nothing hidden left beside it
        assert (shared / snap.id).stat().st_mode & 0o077 == 0  # the sandbox's memory: for the servers only
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        cleanup(homes[0])  # A's node is gone: its home (store, records, volume) with it
        assert not homes[0].exists()
        b = pool.Sandbox.restore(snap)  # the pool finds A down and B sees the snapshot
        assert b.client.url == urls[1]
        assert b.read_file("/srv/state.txt") == b"kept on the shared store\n"
        has_memory(b, "n0de-l0ss")
        assert snap.id in {s.id for s in pool.clients[1].Snapshot.list()}  # imported into B's store
        b.close()
        pool.clients[1].Snapshot.get(snap.id).delete()
        assert shared_ids(shared) == set()  # its shared copy went with it
        with pytest.raises(SnapshotNotFound):
            pool.clients[1].Snapshot.get(snap.id)


def test_a_damaged_shared_copy_is_refused_and_nothing_is_kept(pair):
    urls, homes, _, shared = pair
    with agentenv.Pool(urls, TOKEN) as pool:
        a = pool.clients[0].Sandbox.create(memory="256m")
        a.write_file("/srv/state.txt", "x" * 100_000)
        snap = a.snapshot()
        a.close()
        archive = shared / snap.id / "archive"
        data = bytearray(archive.read_bytes())
        data[len(data) // 2] ^= 0xFF
        archive.write_bytes(bytes(data))
        b = pool.clients[1]
        with pytest.raises(TransferError, match="damaged"):
            b.Sandbox.restore(snap.id)
        assert snap.id not in {s.id for s in b.Snapshot.list()}
        assert not [p.name for p in (homes[1] / "snapshots").iterdir() if p.name.startswith(".")]
        assert not list((homes[1] / "imports").glob(".part-*"))  # no part file: a local read is not resumed
        assert not b.Sandbox.list()
        b.Snapshot.get(snap.id).delete()  # B answers for it from the shared store, and deletes it there
        assert shared_ids(shared) == set()
        pool.clients[0].Snapshot.get(snap.id).delete()
