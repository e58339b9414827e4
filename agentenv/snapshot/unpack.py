"""An imported snapshot's archive unpacked into the store's staging folders, checked as it streams (issue 40).

Two tar processes, one per part of the archive (``agentenv.snapshot.transfer``), are fed its bytes in order, each piece
checked first (``agentenv.snapshot.tarcheck``: a refused member never reaches tar):

- the record and CRIU's images into the staging folder, by root, as root's files (``--no-same-owner``);
- the sandbox's files into its layer's ``upper`` folder (a subvolume where the volume has quotas, so that restores
  clone it whole) by a process of the range leased to the snapshot, inside that range's user namespace
  (``nsenter``, its folder opened as root first): every owner is one of the range's ids, a device node cannot be
  made, file capabilities are tied to the range's root. Only ``user.*`` and ``security.capability`` attributes are
  written there; the folders overlay must see as opaque get ``trusted.overlay.opaque`` from root afterwards (an
  unprivileged process cannot set a ``trusted.`` attribute), through folders opened without following links.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentenv.errors import TransferError, UntrustedSnapshot
from agentenv.host import userns, volume
from agentenv.snapshot import store, tarcheck

NOT_A_SNAPSHOT = "holds no valid snapshot"
_EXTRACT = ["tar", "--extract", "--file=-", "--numeric-owner"]


def unpack_failed(e: TransferError) -> bool:
    """True for an archive whose chunks all matched but which is refused or is no snapshot (not a damaged chunk):
    a later try would get the same bytes."""
    return isinstance(e, UntrustedSnapshot) or "could not unpack" in str(e) or NOT_A_SNAPSHOT in str(e)


class Unpacker:
    """The two tar processes of an archive whose manifest is ``m``, unpacking into the staging folder ``tmp``;
    ``base()`` gives the uid range leased to the snapshot (asked once its files begin)."""

    def __init__(self, m: dict[str, Any], tmp: Path, base: Callable[[], int]) -> None:
        self.m, self.tmp, self.base = m, tmp, base
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.checks: dict[str, tarcheck.Archive] = {"meta": tarcheck.Record(m["id"]), "files": tarcheck.Files(m["id"])}
        self.upper: Path | None = None

    def __enter__(self) -> Unpacker:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
            for pipe in (p.stdin, p.stderr):
                if pipe is not None:
                    pipe.close()

    def _tar(self, part: str) -> subprocess.Popen[bytes]:
        if part not in self.procs:
            self.procs[part] = self._files() if part == "files" else subprocess.Popen(
                [*_EXTRACT, "--no-same-owner", "--same-permissions", "-C", str(self.tmp)],
                stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        return self.procs[part]

    def _files(self) -> subprocess.Popen[bytes]:
        """The files' tar, in the leased range's user namespace, unpacking into the layer's upper folder."""
        base = self.base()
        files = store.files_of(self.tmp)
        files.rmdir()  # the volume, if not mounted yet, must find its folders empty
        if volume.ensure().quotas:  # a subvolume, as a sandbox's layer: a restore clones it whole
            volume.make_layer(files, None)
            (files / "work").mkdir()  # as a sandbox's layer has it (a restore empties it)
            self.upper = files / "upper"
            self.upper.mkdir(mode=0o755)
        else:
            files.mkdir()
            self.upper = files
        os.chown(self.upper, base, base)
        ns = userns.userns_fd(base)
        try:
            return subprocess.Popen(
                ["nsenter", f"--user=/proc/self/fd/{ns}", "--setuid=0", "--setgid=0", "--", *_EXTRACT,
                 "--same-owner", "--same-permissions", "--xattrs", "--xattrs-include=user.*",
                 "--xattrs-include=security.capability", "-C", "."],
                cwd=self.upper, pass_fds=(ns,), stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                stdout=subprocess.DEVNULL)
        finally:
            os.close(ns)

    def feed(self, offset: int, data: bytes) -> None:
        """The archive's bytes at ``offset``: each part's checked, then handed to its tar."""
        for part in ("meta", "files"):
            span = self.m[part]
            if span is None:
                continue
            lo, hi = max(offset, span[0]), min(offset + len(data), span[0] + span[1])
            if lo < hi:
                piece = data[lo - offset:hi - offset]
                self.checks[part].feed(piece)
                p = self._tar(part)
                assert p.stdin is not None
                try:
                    p.stdin.write(piece)
                except BrokenPipeError:
                    self._failed(part)

    def close(self) -> None:
        """Every part complete and unpacked (UntrustedSnapshot or TransferError otherwise); the opaque folders set."""
        for part in ("meta", "files"):
            if self.m[part] is not None:
                self.checks[part].close()
                p = self._tar(part)
                assert p.stdin is not None
                with contextlib.suppress(BrokenPipeError):
                    p.stdin.close()
                if p.wait() != 0:
                    self._failed(part)
        if self.upper is not None:
            check = self.checks["files"]
            assert isinstance(check, tarcheck.Files)
            for folder in check.opaque:
                _mark_opaque(self.upper, folder)

    def _failed(self, part: str) -> None:
        p = self.procs[part]
        p.kill()
        p.wait()
        err = p.stderr.read().decode(errors="replace")[-500:] if p.stderr else ""
        raise TransferError(f"could not unpack the {part} of {self.m['id']}: {err}; nothing was kept")


def _mark_opaque(root: Path, parts: tuple[str, ...]) -> None:
    """Set ``trusted.overlay.opaque`` on the folder ``parts`` below ``root``, every step opened without following a
    link (what the sandbox's range unpacked there is not followed anywhere else)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in parts:
            step = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = step
        os.setxattr(fd, tarcheck.OPAQUE, b"y")
    except OSError as e:
        raise TransferError(f"could not mark {'/'.join(parts)} of a snapshot's files opaque ({e}); nothing was "
                            "kept") from e
    finally:
        os.close(fd)
