"""User namespaces: root in a sandbox is an unprivileged range of host uids, one range per fork family.

Every sandbox runs in a user namespace of its own (runc makes it) whose ids 0..65535 are the host ids
``base``..``base+65535``: a process that escaped the sandbox's other namespaces would be a uid no host file
belongs to, with no capability over anything the host owns. The image's layers stay shared and untouched:
each is mounted into the sandbox's overlay through an idmapped mount (``hostcalls.idmap_mount``), so a file
that is root's on the host's disk is the sandbox's root's inside it. What the sandbox writes is owned on the host
by its mapped uids.

Why one range per *fork family* and not per sandbox: a fork's children and a restore start from the
parent's files, which belong to the parent's uids on disk; giving each its own range would mean rewriting the
owner of every file (seconds for a large layer) on the critical path of every fork. So a range is chosen when a
sandbox is made from an image and then travels in its ``ContainerSpec`` to its snapshots, forks and restores;
two families never share one while either has a sandbox or a snapshot left. (A warm pool, ``agentenv.sandbox.warm``, is
one family: its sandboxes serve as the children of a files-only fork of one of them.)

A range is held through hard links: ``<home>/uids/<n>`` is its lease file, and every sandbox bundle and
snapshot folder of the family holds a link to it (``hold``). The link count says how many hold it, and
removing a holder's folder (``rm -rf``, recovery, gc) lets it go with nothing else to update. A new family
takes a range whose lease nobody holds (``allocate``, under the lease's flock), the low ones first: each low range's
user namespace, which its idmapped mounts need, is made once and kept (``userns_fd``).

A holder is also its range's *gate*: root's, mode 0710, its group the range's base gid (``config.gate``). The
sandbox's root must walk to its bundle's ``rootfs`` (runc mounts it from inside the user namespace) and to a
restore's images (CRIU reads them as that root), so the folders above let anyone pass but not list (0711); the
gate then lets that range's root in, and no other host user (issue 40: a local user read a sandbox's record and
files, and ran a setuid file the sandbox left, through the bundle's path). Why a group and not an ACL entry per
range: it works on any filesystem the home is on, needs no ``setfacl`` (Debian's ``acl`` package is not installed
by default), and the one group a range's processes hold on the host is its own base gid (runc drops every other
one as it enters the namespace). An entry per range in the home's own ACL would not do: thousands of ranges held
at once pass the ~500 entries an ext4 ACL holds (one 4 KiB block).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path

from agentenv.config import gate, paths
from agentenv.errors import SandboxError
from agentenv.host.hostcalls import idmap_mount, make_userns, umount

log = logging.getLogger("agentenv")

SIZE = 1 << 16  # ids per sandbox: 0..65535, what images use (nobody is 65534)
FIRST = 1 << 28  # the first host uid handed out: far above the ranges /etc/subuid and real users take
COUNT = ((1 << 32) - 2 - FIRST) // SIZE  # ranges there are (61,439): uid 2**32-1 is (uid_t)-1, never mapped
LEASE = "uids"  # a holder's link to its range's lease file
LOW = 256  # a new family tries ranges below this first: their user namespaces are made already (``userns_fd``)


def mapping(base: int) -> list[dict[str, int]]:
    """The OCI uidMappings (and gidMappings) of a sandbox whose root is host uid ``base``."""
    return [{"containerID": 0, "hostID": base, "size": SIZE}]


def base_of(index: int) -> int:
    return FIRST + index * SIZE


def index_of(base: int) -> int:
    index, rest = divmod(base - FIRST, SIZE)
    if rest or not 0 <= index < COUNT:
        raise SandboxError(f"uid {base} is not the start of a range agentenv hands out")
    return index


def _leases() -> Path:
    return paths().uids


@contextlib.contextmanager
def _lease(index: int) -> Iterator[tuple[Path, int]]:
    """The lease file of range ``index`` (made if missing), flocked; with its link count."""
    path = _leases() / str(index)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path, os.fstat(fd).st_nlink
    finally:
        os.close(fd)


@functools.cache
def _passable(home: Path) -> None:
    """SandboxError unless every folder above the home lets others pass (x): a sandbox's root, an unprivileged
    uid, walks them to its gate (``config.Paths``: runc mounts the bundle's root from inside the sandbox's user
    namespace, and CRIU reads a restore's images there as that root)."""
    for parent in home.resolve().parents:
        if not parent.stat().st_mode & 0o001:
            raise SandboxError(f"{parent}, above AGENTENV_HOME, does not let other users through (mode "
                               f"{parent.stat().st_mode & 0o777:o}): sandboxes, whose root is an unprivileged "
                               "uid, could not reach their files",
                               fix=f"chmod o+x {parent}, or set AGENTENV_HOME elsewhere (default /var/lib/agentenv)")


def allocate(holder: Path) -> int:
    """A range no family holds, now held by ``holder`` (a new sandbox's bundle); its base uid.

    Each lease is first looked at without its lock (one stat: a held one is passed over at once, which with
    thousands of families held is most of them); a free-looking one is then taken under its flock and the
    link count checked again, so two processes never take one range."""
    _passable(paths().home)
    leases = str(_leases()) + "/"
    start = random.randrange(LOW)  # spread: processes allocating at once rarely try the same lease
    for step in range(COUNT):
        index = (start + step) % LOW if step < LOW else step
        try:
            if os.stat(leases + str(index)).st_nlink > 1:
                continue  # held now: a holder that lets go meanwhile is only a range this call does not take
        except FileNotFoundError:
            pass  # never used: _lease makes it
        with _lease(index) as (path, links):
            if links == 1:  # nobody but the lease itself
                _link(path, holder, base_of(index))
                return base_of(index)
    raise SandboxError(f"every one of the {COUNT} uid ranges is held by a sandbox or a snapshot",
                       fix="delete snapshots or close sandboxes you no longer need")


def held(base: int) -> bool:
    """True while some sandbox or snapshot holds the range whose root is ``base``."""
    try:
        return (_leases() / str(index_of(base))).stat().st_nlink > 1
    except FileNotFoundError:
        return False


def hold(base: int, holder: Path) -> None:
    """Make ``holder`` (a sandbox bundle or snapshot folder of the family whose root is ``base``) hold its range."""
    _passable(paths().home)
    if (holder / LEASE).exists():
        gate(holder, base)  # linked by an older agentenv: gated now
        return
    with _lease(index_of(base)) as (path, _):
        _link(path, holder, base)


def _link(lease: Path, holder: Path, base: int) -> None:
    """Link ``holder`` to ``lease``, and make it the gate of the range (``config.gate``: the range's root may pass,
    no other user). A holder on another filesystem (a snapshot store mounted apart) cannot be linked: it does not
    hold the range then (said once), which its family's sandboxes still do while any lives."""
    gate(holder, base)
    try:
        os.link(lease, holder / LEASE)
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        _apart(holder.parent)


@functools.cache
def _apart(folder: Path) -> None:
    log.warning("%s is on another filesystem than %s: what is there does not hold its fork family's uid range, "
                "which a new family may then take once none of the family's sandboxes is left", folder, _leases())


def userns_fd(base: int) -> int:
    """A descriptor (the caller's to close) of the user namespace of the range whose root is ``base``, for
    idmapped mounts. A low range's (below ``LOW``) is made once and kept bound beside its lease (``<n>.userns``,
    until a reboot): a start then opens a file instead of making a namespace (~3 ms, from a child process). A
    range past them gets a new one each time, never bound: thousands of kept binds would stay in the host's
    mount table, which every runc start and stop reads (~100 ms more per 3,000 mounts)."""
    index = index_of(base)
    if index >= LOW:
        return _made(base, None)
    path = _leases() / f"{index}.userns"
    with contextlib.suppress(OSError):
        if os.path.ismount(path):
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with _lease(index):  # one process makes it
        if os.path.ismount(path):
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return _made(base, path)


def _made(base: int, path: Path | None) -> int:
    try:
        return make_userns(base, SIZE, path)
    except OSError as e:
        raise SandboxError(f"could not make the user namespace of uids {base}..: {e}",
                           fix="agentenv needs root and a kernel with user namespaces") from e


@contextlib.contextmanager
def as_seen_inside(folder: Path, base: int, view: Path) -> Iterator[Path]:
    """``folder`` (files of the range whose root is ``base``) mounted on the empty folder ``view`` through an idmapped
    mount that shows every owner as the sandbox sees it: host id base+k as k, any id outside the range as nobody
    (65534). What ``tar`` then packs names the sandbox's ids, not this host's (``agentenv.snapshot.transfer``); root
    still reads everything there, ``trusted.`` attributes too. Unmounted (and ``view`` removed) after."""
    ns = make_userns(0, SIZE, None, inside=base)  # its ids base.. are the host's 0..: the inverse of the range's
    try:
        view.mkdir(mode=0o700)
        try:
            idmap_mount(str(folder), view, ns)
        except OSError as e:
            view.rmdir()
            raise SandboxError(f"could not mount {folder} as its sandbox sees it: {e}",
                               fix="agentenv needs a kernel with idmapped mounts (5.12+) on its volume") from e
    finally:
        os.close(ns)
    try:
        yield view
    finally:
        umount(view, lazy=True)
        view.rmdir()


def describe() -> str:
    """The user-namespace mode in one line, for a server's start-up log."""
    return (f"user namespaces: every sandbox's root is an unprivileged host uid, {SIZE} ids per fork family from "
            f"uid {FIRST} (leases in {paths().home / 'uids'})")
