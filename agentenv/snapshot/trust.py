"""Which snapshot archives a server believes: the manifest of every archive it hands out is sealed with an
HMAC-SHA256 keyed by a secret the servers share, and one it imports is refused unless its seal checks out.

Why: an import's CRIU images restore processes, mounts and namespaces exactly as they say, and nothing on the
receiving server can rebuild them; the chunks' sha256 only prove that the bytes are those the sender (or whoever
wrote the shared store) advertised. The manifest lists the sha256 of every chunk (``agentenv.snapshot.transfer``), so
a seal over the manifest covers every byte of the record, the images and the files. Only servers holding the key
can seal: a peer without it, or a writer of the shared store, cannot make an archive a server imports (issue 40).

The key: ``agentenv serve --transfer-key FILE`` (``configure``), else the file ``$AGENTENV_TRANSFER_KEY_FILE``
names, else the home's own ``<home>/transfer.key``, made on first use. Never the key itself in argv or the
environment, where every local user reads it. The file is the server's user's (root's) and 0600, and holds at least
32 characters (``openssl rand -hex 32 > FILE``). With the home's key, exports to and imports from the same home work
(a server restarted, two servers of one home); anything else is refused until the servers share a key file.

The seal: ``key_id`` (a digest of the key, which names it in errors and tells nothing of it) and ``mac``, the
HMAC-SHA256 of ``DOMAIN`` and the manifest's canonical JSON (sorted keys, no spaces) without ``mac``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from agentenv.config import paths
from agentenv.errors import TransferError, UntrustedSnapshot

KEY_ENV = "AGENTENV_TRANSFER_KEY_FILE"
HOME_KEY = "transfer.key"
MIN_KEY = 32  # characters of a key file
DOMAIN = b"agentenv snapshot manifest v1\n"
_FIX = ("give every server that exchanges snapshots (directly, or through a shared store) the same key file: "
        "agentenv serve --transfer-key FILE (or $AGENTENV_TRANSFER_KEY_FILE=FILE), FILE 0600 holding e.g. "
        "'openssl rand -hex 32'")
_configured: list[Path] = []


def configure(path: str | Path | None) -> None:
    """Seal and check with the key in ``path`` from now on (None: ``$AGENTENV_TRANSFER_KEY_FILE``, else the home's
    key). ValueError, saying what to do, for a file that cannot be the key."""
    if path is None:
        _configured.clear()
        return
    try:
        _read(Path(path))
    except TransferError as e:
        raise ValueError(str(e)) from None
    _configured[:] = [Path(path)]


def key_file() -> Path:
    """The file of the key this process seals and checks with (see the module doc)."""
    if _configured:
        return _configured[0]
    named = os.environ.get(KEY_ENV)
    return Path(named) if named else paths().home / HOME_KEY


def key() -> bytes:
    """The key this process seals and checks with (the home's is made on first use)."""
    path = key_file()
    if not _configured and not os.environ.get(KEY_ENV):
        _make_home_key(path)
    return _read(path)


def _read(path: Path) -> bytes:
    """A key file's key; TransferError (saying what to do) for one any other user may read, or too short."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise TransferError(f"the transfer key file {path} cannot be read ({e.strerror})", fix=_FIX) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise TransferError(f"the transfer key file {path} is not a file of this server's user that only it may "
                                f"read (mode {st.st_mode & 0o7777:o}, owner {st.st_uid})",
                                fix=f"chown {os.geteuid()} {path} && chmod 600 {path}")
        value = f.read(1 << 16).strip()
    if len(value) < MIN_KEY:
        raise TransferError(f"the transfer key file {path} holds {len(value)} characters, fewer than {MIN_KEY}",
                            fix=f"write a longer key: openssl rand -hex 32 > {path}")
    return value


def _make_home_key(path: Path) -> None:
    """The home's key, made once (0600, by a link: two processes making it at once agree on one)."""
    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def key_id(value: bytes) -> str:
    """What names a key in a manifest and in errors (16 hex digits of a digest: nothing of the key)."""
    return hashlib.sha256(b"agentenv transfer key id\n" + value).hexdigest()[:16]


def _mac(body: dict[str, Any], value: bytes) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(value, DOMAIN + text, hashlib.sha256).hexdigest()


def seal(manifest: dict[str, Any], value: bytes | None = None) -> dict[str, Any]:
    """``manifest`` sealed with this server's key (or ``value``): its ``key_id`` and ``mac`` set."""
    value = key() if value is None else value
    body = {k: v for k, v in manifest.items() if k != "mac"}
    body["key_id"] = key_id(value)
    return {**body, "mac": _mac(body, value)}


def verify(manifest: dict[str, Any], source: str) -> None:
    """UntrustedSnapshot (nothing was kept) unless ``manifest`` (from ``source``) is sealed with this server's key."""
    sid, value = manifest.get("id"), key()
    mac, named = manifest.get("mac"), manifest.get("key_id")
    if not isinstance(mac, str) or not isinstance(named, str):
        raise UntrustedSnapshot(f"snapshot {sid} from {source} is not sealed: a server imports only snapshots sealed "
                                "with the key it shares with their sender (an agentenv from before issue 40 seals "
                                "none); nothing was kept", fix=_FIX)
    if not hmac.compare_digest(named, key_id(value)):
        raise UntrustedSnapshot(f"snapshot {sid} from {source} is sealed with another key (key {named}; this "
                                f"server's is {key_id(value)}, from {key_file()}); nothing was kept", fix=_FIX)
    body = {k: v for k, v in manifest.items() if k != "mac"}
    if not hmac.compare_digest(mac, _mac(body, value)):
        raise UntrustedSnapshot(f"snapshot {sid} from {source} does not match its seal (key {named}): it was changed "
                                "after a server sealed it; nothing was kept",
                                fix="take the snapshot again on a server that has it; if it happens again, something "
                                    "between the servers (or with write access to the shared store) changes copies")
