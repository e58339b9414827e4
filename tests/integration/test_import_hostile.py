"""An imported snapshot is untrusted input (issue 40, finding 2): a peer server, a writer of the shared store or any
other source decides every byte of what a server imports. One real server (in this process, with a shared store
and a transfer key) publishes a real snapshot; the test copies it under a new id with its record or archive
changed, as such a source could, and asks the server to restore the copy.

- a record naming a host folder as a layer, extra capabilities and another uid range: the sandbox restores with the
  image's own layers, the default capabilities and a range of its own;
- a record asking for what a create here is refused (no memory or pids limit, a CPU quota of nothing, rules that
  reach the metadata address): refused;
- an archive planting a setuid file owned by the host's root, an owner outside the sandbox's ids, a device node:
  neutralised (the file is the sandbox's root's) or refused, and nothing of the kind is left on the host;
- a record or image changed by someone without the key (the chunks' digests recomputed to match), one not sealed,
  one sealed with another key: refused before anything is unpacked."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentenv.errors import AgentEnvError, TransferError
from agentenv.host import userns
from agentenv.remote.client import Client
from agentenv.snapshot.trust import KEY_ENV, seal

from .server_fixtures import TOKEN, threaded_server

DEFAULT_CAPS = 0x405FB  # CapEff of a process run as root in a sandbox: runtime.DEFAULT_CAPS
CAP_SYS_PTRACE, CAP_SYS_ADMIN = 19, 21
SECRET = b"only the host may read this\n"


Edit = Callable[[dict[str, Any]], None]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Client, Path, Path]]:
    """The server's client, its shared store, and a scratch folder of the host (outside every sandbox)."""
    from agentenv.snapshot import shared

    folder = Path(tempfile.mkdtemp(prefix="agentenv-hostile-import-", dir="/var/tmp"))
    store, scratch = folder / "shared", folder / "host"
    store.mkdir()
    scratch.mkdir()
    (scratch / "host-secret.txt").write_bytes(SECRET)
    key = folder / "transfer.key"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    old = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = str(key)
    try:
        with threaded_server(shared_store=store) as url, Client(url, TOKEN) as client:
            try:
                yield client, store, scratch
            finally:
                for sb in client.Sandbox.list():
                    sb.close()
                for snap in client.Snapshot.list():
                    snap.delete()
    finally:
        shared.configure(None)
        if old is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = old
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def published(server) -> tuple[str, str]:
    """A files-only and a memory snapshot of one sandbox, both published in the shared store."""
    client, _, _ = server
    with client.Sandbox.create(memory="256m", ttl=None) as sb:  # the module's: closed at its teardown, no deadline
        sb.write_file("/srv/kept.txt", "kept\n")
        assert sb.exec("chown 1000:1001 /srv/kept.txt").exit_code == 0  # an owner other than the sandbox's root
        files = sb.snapshot()
        memory = sb.snapshot(memory=True)
    return files.id, memory.id


def _parts(store: Path, sid: str) -> tuple[dict[str, Any], bytes, bytes]:
    """A published copy's manifest, and its archive's two tar streams (record and images, files)."""
    manifest = json.loads(next((store / sid).glob("manifest-*.json")).read_text())
    archive = (store / sid / "archive").read_bytes()
    lo, n = manifest["meta"]
    files = b"" if manifest["files"] is None else archive[manifest["files"][0]:sum(manifest["files"])]
    return manifest, archive[lo:lo + n], files


def _retar(meta: bytes, new_id: str, edit: Edit | None, image_edit: bool = False) -> bytes:
    """The record's tar again, its record renamed ``new_id`` and passed through ``edit``; with ``image_edit`` a
    byte of one of CRIU's page images flipped."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(meta)) as src, tarfile.open(fileobj=out, mode="w",
                                                                     format=tarfile.PAX_FORMAT) as dst:
        flipped = False
        for m in src:
            data = src.extractfile(m).read() if m.isreg() else None  # type: ignore[union-attr]
            m.pax_headers = {k: v for k, v in m.pax_headers.items() if not k.startswith("GNU.sparse.")}
            if data is not None and m.name.endswith("meta.json"):
                record = json.loads(data)
                record["id"] = new_id
                record["spec"]["uids"] = userns.base_of(1000 + secrets.randbelow(9000))  # not held here: any will do
                if edit is not None:
                    edit(record)
                data = json.dumps(record).encode()
            elif data is not None and image_edit and not flipped and "/pages-" in m.name and len(data) > 4096:
                data = data[:4096] + bytes([data[4096] ^ 0xFF]) + data[4097:]
                flipped = True
            if data is not None:
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
        assert flipped or not image_edit
    return out.getvalue()


def _plant(files: bytes, planted: list[tarfile.TarInfo]) -> bytes:
    """The files' tar with ``planted`` members (no data) added at its end. Before issue 40 the files part held the
    layer folder (upper/ inside), since then it holds the sandbox's files themselves."""
    with tarfile.open(fileobj=io.BytesIO(files)) as t:
        names = [m.name for m in t]
        end = t.offset
    prefix = "./upper/" if "./upper" in names else "./"
    out = bytearray(files[:end])
    for m in planted:
        m.name = prefix + m.name
        out += m.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    out += b"\0" * 1024
    return bytes(out + b"\0" * (-len(out) % 10240))


def craft(store: Path, sid: str, *, edit: Edit | None = None, planted: list[tarfile.TarInfo] | None = None,
          image_edit: bool = False, sealing: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> str:
    """A copy of the published ``sid`` under a new id, changed as asked, its manifest's digests computed again to
    match (what anyone who can write the shared store can do); sealed with the servers' key unless ``sealing``
    says otherwise. Its id."""
    manifest, meta, files = _parts(store, sid)
    new_id = f"snap-{secrets.token_hex(6)}"
    meta = _retar(meta, new_id, edit, image_edit)
    if planted:
        files = _plant(files, planted)
    archive = meta + files
    chunk = manifest["chunk"]
    body = {**manifest, "id": new_id, "size": len(archive), "meta": [0, len(meta)],
            "files": [len(meta), len(files)] if files else None,
            "digests": [hashlib.sha256(archive[i:i + chunk]).hexdigest() for i in range(0, len(archive), chunk)]}
    body = sealing(body) if sealing is not None else seal({k: v for k, v in body.items() if k != "mac"})
    folder = store / new_id
    folder.mkdir()
    (folder / "archive").write_bytes(archive)
    (folder / f"manifest-{chunk}.json").write_text(json.dumps(body))
    info = json.loads((store / sid / "info.json").read_text())
    (folder / "info.json").write_text(json.dumps({**info, "id": new_id}))
    return new_id


def _gone(client: Client, sid: str) -> None:
    """The crafted snapshot is not in the server's store (nothing of a refused import is listed)."""
    assert sid not in {s.id for s in client.Snapshot.list()}


def planted_on_host(home: Path) -> list[str]:
    """Device nodes (but overlay whiteouts, 0/0) and setuid/setgid files of the host's root under ``home``."""
    found = []
    for root, dirs, files in os.walk(home / "volume"):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            if (stat.S_ISCHR(st.st_mode) and st.st_rdev != 0) or stat.S_ISBLK(st.st_mode):
                found.append(f"device {root}/{name}")
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and (st.st_uid == 0 or st.st_gid == 0):
                found.append(f"setuid {root}/{name}")
    return found


def test_a_crafted_record_gets_the_images_layers_the_default_capabilities_and_a_range_of_its_own(server, published):
    client, store, scratch = server
    claimed = userns.base_of(1000)  # a range no family here holds: the record claims it

    def edit(record: dict[str, Any]) -> None:
        spec = record["spec"]
        spec["layers"] = [str(scratch), *spec["layers"]]
        spec["caps"] = [*spec["caps"], "CAP_SYS_ADMIN", "CAP_SYS_PTRACE"]
        spec["uids"] = claimed

    source = client.Snapshot.get(published[0])
    crafted = craft(store, source.id, edit=edit)
    with client.Sandbox.restore(crafted) as sb:
        assert sb.read_file("/srv/kept.txt") == b"kept\n"  # its own files came over, owners as they were inside
        assert sb.exec("stat -c %u:%g /srv/kept.txt").stdout.strip() == "1000:1001"
        seen = sb.exec("cat /host-secret.txt")
        assert seen.exit_code != 0 and SECRET.decode() not in seen.stdout
        caps = int(sb.exec("grep CapEff /proc/self/status").stdout.split()[1], 16)
        assert caps & (1 << CAP_SYS_ADMIN | 1 << CAP_SYS_PTRACE) == 0 and caps == DEFAULT_CAPS
        base = int(sb.exec("cat /proc/self/uid_map").stdout.split()[1])
        assert base != claimed
        with client.Sandbox.restore(source.id) as original:  # the source's family, here
            assert base != int(original.exec("cat /proc/self/uid_map").stdout.split()[1])
    client.Snapshot.get(crafted).delete()


REFUSED: dict[str, Edit] = {
    "no-memory-limit": lambda r: r["spec"]["limits"].update(memory=0),  # runc: 0 is no limit at all
    "no-pids-limit": lambda r: r["spec"]["limits"].update(pids=0),
    "no-cpu-quota": lambda r: r["spec"]["limits"].update(cpus=1e-6),  # a quota of 0 µs: none
    "rules-reach-metadata": lambda r: r["spec"].update(network=True, rules={
        "allow_out": ["169.254.169.254/32"], "deny_out": [], "resolved": {}}),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_a_record_asking_for_what_a_create_is_refused_is_refused(server, published, what):
    client, store, _ = server
    crafted = craft(store, published[0], edit=REFUSED[what])
    with pytest.raises(TransferError, match="record"):
        client.Sandbox.restore(crafted).close()
    _gone(client, crafted)
    assert not client.Sandbox.list()
    client.Snapshot.get(crafted).delete()


def _member(name: str, kind: bytes, mode: int, uid: int = 0, major: int = 0, minor: int = 0) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.mode, m.uid, m.gid, m.devmajor, m.devminor = kind, mode, uid, uid, major, minor
    return m


@pytest.mark.parametrize("what", ["setuid-root-file", "owner-outside-the-range", "device-node"])
def test_an_archive_planting_a_setuid_root_file_or_a_device_node_is_neutralised_or_refused(server, published, what):
    client, store, _ = server
    planted = {"setuid-root-file": _member("srv/su", tarfile.REGTYPE, 0o4755),
               "owner-outside-the-range": _member("srv/far", tarfile.REGTYPE, 0o4755, uid=70_000),
               "device-node": _member("srv/null", tarfile.CHRTYPE, 0o666, major=1, minor=3)}[what]
    crafted = craft(store, published[0], planted=[planted])
    home = Path(os.environ["AGENTENV_HOME"])
    try:
        if what == "setuid-root-file":  # the sandbox's own root's setuid file: it may have one, the host's is never
            with client.Sandbox.restore(crafted) as sb:
                base = int(sb.exec("cat /proc/self/uid_map").stdout.split()[1])
                st = next(p for p in (home / "volume" / "snapshots" / crafted).rglob("su")).stat()
                assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (base, base, 0o4755)  # not the host's root's
                assert sb.exec("stat -c %u:%a /srv/su").stdout.strip() == "0:4755"
        else:
            with pytest.raises(TransferError, match="device" if what == "device-node" else "owner"):
                client.Sandbox.restore(crafted).close()
            _gone(client, crafted)
        assert not planted_on_host(home)
    finally:
        with contextlib.suppress(AgentEnvError):
            client.Snapshot.get(crafted).delete()


def _unsealed(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("mac", "key_id")}


def _other_key(body: dict[str, Any]) -> dict[str, Any]:
    return seal(_unsealed(body), secrets.token_hex(32).encode())


@pytest.mark.parametrize("how", ["image-changed", "not-sealed", "sealed-with-another-key"])
def test_a_record_or_image_not_sealed_with_the_servers_key_is_refused(server, published, how):
    client, store, _ = server
    sealing = {"image-changed": lambda body: body,  # the seal the sender made, over other digests
               "not-sealed": _unsealed, "sealed-with-another-key": _other_key}[how]
    crafted = craft(store, published[1], image_edit=True, sealing=sealing)
    with pytest.raises(TransferError, match="key"):
        client.Sandbox.restore(crafted).close()
    _gone(client, crafted)
    assert not client.Sandbox.list()
    client.Snapshot.get(crafted).delete()
