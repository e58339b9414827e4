"""Snapshots that move between hosts: packed once into an archive, sent in chunks that each carry a sha256,
unpacked into the receiving store atomically.

The sending side (``export``) packs a snapshot's record and CRIU images (its store folder, root's files) and its
files (what the sandbox's overlay upper folder held, its owners written as the sandbox sees them: 0..65535, not its
range's host ids) as two tar archives, one after the other in ``<home>/exports/<id>/archive`` (numeric owners,
xattrs, overlay's whiteouts), and lists the sha256 of every chunk in a manifest, which it seals with the key the
servers share (``agentenv.snapshot.trust``). The receiving side (``receive``) refuses a manifest not sealed with its
key before it asks for a chunk, then writes each chunk, once its digest matches, to a hidden part file under
``<home>/imports/``: a dropped connection leaves the chunks already checked, and the next try asks from the first
one missing. A chunk that does not match is refused (TransferError) and never written. Checked chunks are unpacked
as they come (``agentenv.snapshot.unpack``: every member checked before tar sees it, the files unpacked inside the
user namespace of a uid range leased to the import), into the store's own staging folders (``store.writing``); the
record is rebuilt from this server's facts (``agentenv.snapshot.imported``) and the whole renamed into place once
the last chunk is in: nothing half-made is ever listed.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from agentenv.config import paths, write_json
from agentenv.errors import SandboxError, SnapshotNotFound, TransferError
from agentenv.host import userns
from agentenv.snapshot import imported, store, trust
from agentenv.snapshot.store import FORK_KIND, Snapshot
from agentenv.snapshot.unpack import NOT_A_SNAPSHOT, Unpacker, unpack_failed

CHUNK = 8 << 20  # bytes per chunk unless the receiver asks otherwise
MIN_CHUNK, MAX_CHUNK = 64 << 10, 16 << 20  # the server answers bodies up to 32 MiB
AHEAD = 3  # chunk requests a receiver keeps in flight
FORMAT = 2  # the archive's layout: 2 since the files' owners are the sandbox's ids (issue 40), not the host's
SNAPSHOT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a snapshot id as a manifest and the shared store name it
_HEX = re.compile(r"^[0-9a-f]{64}$")


def check_chunk(chunk: int) -> int:
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise ValueError(f"a chunk of {chunk} bytes is outside {MIN_CHUNK}..{MAX_CHUNK}; ask for one in that range")
    return chunk


def export(snapshot_id: str, chunk: int = CHUNK) -> dict[str, Any]:
    """The manifest of a snapshot's archive (packed on first use), sealed with this server's key: its size, chunk
    size, every chunk's sha256, and where its two tar archives (``meta``, ``files``) begin and end."""
    check_chunk(chunk)
    snap = Snapshot.get(snapshot_id)
    if snap.labels.get("agentenv.kind") == FORK_KIND:
        raise ValueError(f"{snap.id} is a fork's working snapshot (deleted when the fork is done); "
                         "take a snapshot of a child to move it")
    folder = store.exports() / snap.id
    if not (folder / "parts.json").exists():
        pack(snap, folder)
    return trust.seal(manifest_of(folder, snap.id, chunk))


def manifest_of(folder: Path, snapshot_id: str, chunk: int) -> dict[str, Any]:
    """The manifest of the archive packed in ``folder`` (computed once per chunk size, written atomically; not
    sealed: ``trust.seal`` it to hand it out)."""
    manifest = folder / f"manifest-{chunk}.json"
    with contextlib.suppress(FileNotFoundError):
        return dict(json.loads(manifest.read_text()))
    digests = _Digests(chunk)
    with open(folder / "archive", "rb") as f:
        while piece := f.read(chunk):
            digests.update(piece)
    return _write_manifest(folder, snapshot_id, digests, json.loads((folder / "parts.json").read_text()))


def _write_manifest(folder: Path, snapshot_id: str, digests: _Digests, parts: dict[str, Any]) -> dict[str, Any]:
    out = {"id": snapshot_id, "size": digests.size, "chunk": digests.chunk, "digests": digests.digests(), **parts}
    write_json(folder / f"manifest-{digests.chunk}.json", out)
    return out


class _Digests:
    """The sha256 of every ``chunk`` bytes of a stream, taken as it passes (packing needs no second read)."""

    def __init__(self, chunk: int) -> None:
        self.chunk, self.size, self.h = chunk, 0, hashlib.sha256()
        self.done: list[str] = []

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.chunk - self.size % self.chunk)
            self.h.update(view[:take])
            self.size, view = self.size + take, view[take:]
            if self.size % self.chunk == 0:
                self.done.append(self.h.hexdigest())
                self.h = hashlib.sha256()

    def digests(self) -> list[str]:
        return self.done + ([self.h.hexdigest()] if self.size % self.chunk else [])


def pack(snap: Snapshot, folder: Path) -> None:
    """Write ``archive`` (the store folder's tar, then the files' tar), ``parts.json`` and the manifest of
    CHUNK-sized chunks (hashed as the archive is written) into ``folder``, built in a hidden folder and renamed
    into place."""
    base = snap.spec.get("uids")
    if not isinstance(base, int):
        raise ValueError(f"{snap.id} was taken before sandboxes ran in user namespaces: no server can restore it")
    tmp = folder.parent / f".tmp-{snap.id}-{threading.get_ident()}-{os.getpid()}"  # two requests may pack at once
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        parts: dict[str, Any] = {"format": FORMAT, "files": None}
        digests = _Digests(CHUNK)
        with open(tmp / "archive", "wb") as out:
            record = ["meta.json", *(["criu"] if snap.criu_dir.is_dir() else [])]  # not the folder: its mode is ours
            _tar_create(snap.path, out, digests, ["--owner=0", "--group=0"], record)  # the record: root's files
            parts["meta"] = [0, out.tell()]
            if snap.fs_dir.is_dir():  # owners as the sandbox sees them (overlay's whiteouts, the host's root's: nobody)
                view = paths().tmp / f".view-{tmp.name}"
                with userns.as_seen_inside(snap.fs_dir, base, view):
                    start = out.tell()
                    _tar_create(view, out, digests, ["--xattrs", "--xattrs-include=*"])
                    parts["files"] = [start, out.tell() - start]
        (tmp / "parts.json").write_text(json.dumps(parts))
        _write_manifest(tmp, snap.id, digests, parts)
        try:
            os.rename(tmp, folder)
        except OSError:  # another request packed it meanwhile: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tar_create(src: Path, out: BinaryIO, digests: _Digests, options: list[str], names: list[str] | None = None) -> None:
    # deterministic: packed again (the sender restarted, its archive was dropped) it has the same digests, so
    # a receiver's chunks stay good; pax headers without tar's pid, atime or ctime
    args = ["tar", "--create", "--file=-", "--format=posix", "--sparse", "--numeric-owner", *options, "-C", str(src),
            "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime"]
    with tempfile.TemporaryFile() as err:  # not a pipe: tar's complaints cannot fill it while we read its output
        p = subprocess.Popen([*args, *(names or ["."])], stdout=subprocess.PIPE, stderr=err)
        assert p.stdout is not None
        with contextlib.suppress(OSError):  # a larger pipe: fewer switches between tar and this copy
            fcntl.fcntl(p.stdout.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
        with p.stdout:
            while data := p.stdout.read(1 << 20):
                out.write(data)
                digests.update(data)
        if p.wait() != 0:
            err.seek(0)
            raise SandboxError(f"could not pack {src}: {err.read().decode(errors='replace')[-500:]}")


def read_chunk(snapshot_id: str, index: int, chunk: int = CHUNK) -> bytes:
    """Chunk ``index`` of a snapshot's archive (``export`` packs it first)."""
    check_chunk(chunk)
    blob = store.exports() / os.path.basename(snapshot_id) / "archive"
    try:
        with open(blob, "rb") as f:
            f.seek(index * chunk)
            return f.read(chunk)
    except FileNotFoundError:
        raise SnapshotNotFound(f"no export of {snapshot_id!r} here", fix="ask for its manifest first") from None


def drop_export(snapshot_id: str) -> bool:
    """Remove a snapshot's packed archive (once a receiver has it all); False if there was none."""
    folder = store.exports() / os.path.basename(snapshot_id)
    if not folder.exists():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


def _checked(manifest: Any) -> dict[str, Any]:
    """The manifest, its fields checked (bad input from the sender is a TransferError, not a crash)."""
    try:
        sid, size, chunk, digests = manifest["id"], manifest["size"], manifest["chunk"], manifest["digests"]
        ok = (isinstance(sid, str) and SNAPSHOT_ID.match(sid) and isinstance(size, int) and isinstance(chunk, int)
              and MIN_CHUNK <= chunk <= MAX_CHUNK and isinstance(digests, list)
              and len(digests) == -(-size // chunk) and all(isinstance(d, str) and _HEX.match(d) for d in digests))
        for part in ("meta", "files"):
            p = manifest[part]
            ok = ok and (p is None and part == "files" or isinstance(p, list) and len(p) == 2
                         and all(type(v) is int and 0 <= v <= size for v in p) and p[0] + p[1] <= size)
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise TransferError("the sending server's manifest is malformed; nothing was kept",
                            fix="check that both servers run the same agentenv version")
    return dict(manifest)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def receive(manifest: Any, fetch: Callable[[int], bytes], origin: str,
            resumable: bool = True) -> tuple[Snapshot, dict[str, int]]:
    """Bring the snapshot of ``manifest`` into this store, ``fetch(i)`` giving chunk ``i``; resumes from the
    chunks an earlier, cut-off try checked in. Returns it and ``{chunks, fetched, resumed_at}``. With
    ``resumable=False`` (a local source: a shared store; a spread fork's one-shot pull) the checked chunks are not
    kept for a later try, and a failed try leaves no part file.

    UntrustedSnapshot before anything is asked unless the manifest is sealed with this server's key. The chunks are
    unpacked as they come (``Unpacker``), into the store's staging folders, the files into a uid range leased to the
    snapshot here: a damaged chunk, a refused member or a cut stops it and the staging folders go; the part file
    keeps what was checked (but for an archive refused for what it holds)."""
    m = _checked(manifest)
    trust.verify(m, origin)
    if m.get("format") != FORMAT:
        raise TransferError(f"snapshot {m['id']} was packed by an agentenv that writes the files' owners as its host's "
                            "ids (before issue 40); nothing was kept", fix="run the same agentenv version on both")
    sid, chunk, digests = m["id"], m["chunk"], m["digests"]
    if (done := _present(sid, len(digests))) is not None:
        return done
    staging = paths().imports  # made private by paths()
    part, key = staging / f".part-{sid}", staging / f".part-{sid}.json"
    mine = {"size": m["size"], "chunk": chunk, "digests": digests}
    with _locked(staging / f".lock-{sid}"):
        if (done := _present(sid, len(digests))) is not None:  # a concurrent import finished while this waited
            return done
        same = key.exists() and json.loads(key.read_text()) == mine
        have = min(part.stat().st_size // chunk, len(digests)) if same and part.exists() else 0
        if not same:
            key.write_text(json.dumps(mine))
        try:
            with store.writing(sid) as tmp:
                base = functools.cache(lambda: userns.allocate(tmp))  # a range of its own: the files' tar asks
                with Unpacker(m, tmp, base) as unpack, open(part, "ab" if have else "wb") as f:
                    f.truncate(have * chunk)
                    with open(part, "rb") as kept:  # what an earlier try checked in, unpacked first
                        for i in range(have):
                            unpack.feed(i * chunk, kept.read(chunk))
                    _pipeline(fetch, range(have, len(digests)), m, f if resumable else None, unpack)
                    unpack.close()
                snap = _finish(tmp, m, origin, base)
        except BaseException as e:
            # not resumable: nothing is kept; every chunk matched yet it is no snapshot: start afresh next time
            if not resumable or (isinstance(e, TransferError) and unpack_failed(e)):
                part.unlink(missing_ok=True)
                key.unlink(missing_ok=True)
            raise
        part.unlink()
        key.unlink()
    return snap, {"chunks": len(digests), "fetched": len(digests) - have, "resumed_at": have}


def _present(sid: str, chunks: int) -> tuple[Snapshot, dict[str, int]] | None:
    """The snapshot if this store has it already (then nothing is fetched), else None."""
    try:
        return Snapshot.get(sid), {"chunks": chunks, "fetched": 0, "resumed_at": chunks}
    except SnapshotNotFound:
        return None


def _pipeline(fetch: Callable[[int], bytes], indices: range, m: dict[str, Any], part: BinaryIO | None,
              unpack: Unpacker) -> None:
    """Fetch ``indices`` (AHEAD requests in flight), check each in order, and hand it to a thread of its own that
    appends it to the part file and feeds the tar processes: the download, the checks and the unpacking overlap."""
    pending: collections.deque[Future[bytes]] = collections.deque()
    fed: Future[None] | None = None
    with ThreadPoolExecutor(AHEAD, thread_name_prefix="agentenv-pull") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="agentenv-unpack") as feeder:
        try:
            ahead = iter(indices)
            for i in itertools.islice(ahead, AHEAD):
                pending.append(pool.submit(fetch, i))
            for i in indices:
                data = pending.popleft().result()
                for j in itertools.islice(ahead, 1):
                    pending.append(pool.submit(fetch, j))
                _verify(data, i, m)
                if fed is not None:
                    fed.result()
                fed = feeder.submit(_keep, part, unpack, i * m["chunk"], data)
            if fed is not None:
                fed.result()
        finally:
            for p in pending:
                p.cancel()


def _keep(part: BinaryIO | None, unpack: Unpacker, offset: int, data: bytes) -> None:
    """A checked chunk: appended to the part file (what a later try resumes from), then unpacked."""
    if part is not None:
        part.write(data)
    unpack.feed(offset, data)


def _verify(data: bytes, i: int, m: dict[str, Any]) -> None:
    want, digest = min(m["chunk"], m["size"] - i * m["chunk"]), hashlib.sha256(data).hexdigest()
    if len(data) != want or digest != m["digests"][i]:
        raise TransferError(f"chunk {i} of snapshot {m['id']} arrived damaged ({len(data)} bytes, sha256 "
                            f"{digest[:12]}..., not {m['digests'][i][:12]}...); it was refused and nothing was kept",
                            fix="retry: the chunks before it are kept and the next try resumes there")


def _finish(tmp: Path, m: dict[str, Any], origin: str, base: Callable[[], int]) -> Snapshot:
    """The record of the snapshot unpacked in ``tmp``, rebuilt from this server's facts (``imported.rebuild``),
    its files in the range whose root is ``base()`` (leased now if its files did not); written last."""
    try:
        record = json.loads((tmp / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise TransferError(f"the archive of {m['id']} {NOT_A_SNAPSHOT} record ({e}); nothing was kept",
                            fix="check that both servers run the same agentenv version") from e
    if not isinstance(record, dict) or record.get("id") != m["id"]:
        raise TransferError(f"the archive of {m['id']} {NOT_A_SNAPSHOT} record of its own; nothing was kept")
    snap = imported.rebuild(tmp, record, origin, base())
    store.write_meta(tmp, snap)
    return snap
