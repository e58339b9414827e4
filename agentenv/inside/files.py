"""The keeper's file calls: stat, list, mkdir, move and remove, and files streamed both ways.

Files move in ``CHUNK``-sized pieces, never whole in the keeper's memory; an upload is written to a temporary
file and renamed, so a reader never sees half of it. The keeper's own folders (its socket, its code) are
refused to every call that would change them.
"""

from __future__ import annotations

import _socket
import errno
import os
import select
import stat

from agentenv.inside.frames import _HEAD, CHUNK, MAX_FILE, _dumps, drain, send_frame, suppress
from agentenv.inside.users import db_rows

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_UNSIZED = 8 << 20  # bytes read from a file whose size stat does not tell (/proc, /sys): held in memory
MAX_ENTRIES = 100_000  # entries of one directory listing
META_PREFIX = "user.e2b."  # the extended attributes that are a file's metadata (E2B's ``X-Metadata-*`` uploads)


def check_own(path: str, own_dirs: tuple[str, ...], tree: bool = False) -> str:
    """``path``, unless it (or a folder it goes through, symlinks resolved) is one of the keeper's own;
    with ``tree``, also unless one of them is inside it (a folder removed or moved whole)."""
    real = os.path.join(os.path.realpath(os.path.dirname(path) or "/"), os.path.basename(path))
    real = os.path.normpath(real)
    for d in own_dirs:
        if real == d or real.startswith(d.rstrip("/") + "/") or (tree and (d + "/").startswith(
                real.rstrip("/") + "/")):
            raise PermissionError(13, f"{path} is or holds the keeper's own folder {d}: refused")
    return path


def fs(h: dict[str, Any], own_dirs: tuple[str, ...]) -> dict[str, Any]:
    """The file system ops: stat, list (down to ``depth`` levels), mkdir, move, remove; with ``resolve``, stat
    and list give a symlink's target resolved and absolute (as E2B's envd does) instead of as written."""
    do, path, resolve = h["do"], str(h["path"]), bool(h.get("resolve"))
    if do == "stat":
        return {"info": file_info(path, resolve=resolve)}
    if do == "list":
        depth = int(h.get("depth", 1))
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"Not a directory: {path!r}")
        return {"entries": _walk(path, depth, resolve)}
    if do == "mkdir":
        check_own(path, own_dirs)
        if os.path.isdir(path):
            return {"made": False}
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, f"File exists: {path!r}")
        os.makedirs(path)
        return {"made": True}
    if do == "move":
        dst = check_own(str(h["dst"]), own_dirs, tree=True)
        move(check_own(path, own_dirs, tree=True), dst)
        return {"info": file_info(dst)}
    if do == "remove":
        check_own(path, own_dirs, tree=True)
        if stat.S_ISDIR(os.lstat(path).st_mode):
            import shutil

            shutil.rmtree(path)
        else:
            os.unlink(path)
        return {"ok": True}
    raise ValueError(f"unknown fs op {do!r}")


def file_info(path: str, names: dict[str, dict[int, str]] | None = None, resolve: bool = False) -> dict[str, Any]:
    """What a file is: its own stat (a symlink's target decides only its type); owner and group by name
    when the sandbox's /etc/passwd and /etc/group have them."""
    st = os.lstat(path)
    kind, target = st.st_mode, None
    if stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(path) if resolve else os.readlink(path)
        with suppress(OSError):
            kind = os.stat(path).st_mode
    names = {} if names is None else names
    for db in ("passwd", "group"):
        if db not in names:
            names[db] = _id_names(f"/etc/{db}")
    return {"name": os.path.basename(path.rstrip("/")) or "/", "path": path,
            "type": "dir" if stat.S_ISDIR(kind) else "file", "size": st.st_size, "mode": st.st_mode & 0o7777,
            "permissions": stat.filemode(st.st_mode), "owner": names["passwd"].get(st.st_uid, str(st.st_uid)),
            "group": names["group"].get(st.st_gid, str(st.st_gid)), "modified": st.st_mtime,
            "symlink_target": target, "metadata": read_metadata(path)}


def read_metadata(path: str | int) -> dict[str, str] | None:
    """The file's ``user.e2b.*`` extended attributes, the prefix dropped (None if it has none, or its file
    system has no xattrs, or they cannot be read as this account); a symlink's are its target's, as in envd.
    Names or values that are not UTF-8 are left out."""
    found: dict[str, str] = {}
    try:
        names = os.listxattr(path)
    except OSError:
        return None
    for name in names:
        if not name.startswith(META_PREFIX):
            continue
        try:
            found[name[len(META_PREFIX):]] = os.getxattr(path, name).decode()
        except (OSError, UnicodeDecodeError):
            continue
    return found or None


def write_metadata(fd: int, metadata: dict[str, str]) -> None:
    """Make ``metadata`` the whole set of ``user.e2b.*`` xattrs of the open file ``fd`` (others of that prefix go).
    A file system without xattrs is an error that says so when metadata is asked for: never dropped."""
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        stale = [n for n in os.listxattr(fd) if n.startswith(META_PREFIX) and n[len(META_PREFIX):] not in metadata]
    except OSError as e:
        if not metadata and e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return
        stale = []
    for name in stale:
        with suppress(FileNotFoundError, OSError):
            os.removexattr(fd, name)
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise ValueError(f"metadata must map non-empty strings to strings, got {key!r}: {value!r}")
        try:
            os.setxattr(fd, META_PREFIX + key, value.encode())
        except OSError as e:
            if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise OSError(e.errno, "the sandbox's file system here has no extended attributes: "
                                       "file metadata cannot be stored") from None
            raise


def _id_names(path: str) -> dict[int, str]:
    """uid (or gid) -> name from a passwd (group) file (``users.db_rows``: read as a file, never through NSS)."""
    found: dict[int, str] = {}
    for parts in db_rows(path):
        if len(parts) > 2 and parts[2].isdigit():
            found.setdefault(int(parts[2]), parts[0])
    return found


def _walk(top: str, depth: int, resolve: bool = False) -> list[dict[str, Any]]:
    """The entries under ``top`` down to ``depth`` levels, by name, each folder before what is in it
    (symlinks not followed); at most MAX_ENTRIES of them (ValueError past that)."""
    names: dict[str, dict[int, str]] = {}
    found: list[dict[str, Any]] = []
    stack: list[tuple[str, bool, int]] = []

    def scan(folder: str, level: int) -> None:
        room = MAX_ENTRIES - len(found) - len(stack)
        with os.scandir(folder) as it:
            got: list[tuple[str, bool]] = []
            for e in it:
                if len(got) >= room:
                    raise ValueError(f"over {MAX_ENTRIES} entries under {top}: list with a smaller depth")
                got.append((e.name, e.is_dir(follow_symlinks=False)))
        stack.extend((os.path.join(folder, n), d, level) for n, d in sorted(got, reverse=True))

    scan(top, 1)
    while stack:
        path, is_dir, level = stack.pop()
        with suppress(FileNotFoundError):  # gone since the scan
            found.append(file_info(path, names, resolve))
            if is_dir and level < depth:
                with suppress(PermissionError, NotADirectoryError):
                    scan(path, level + 1)
    return found


def move(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` (creating its parent folders), copying across file systems."""
    os.makedirs(os.path.dirname(dst) or "/", exist_ok=True)
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        import shutil

        if stat.S_ISDIR(os.lstat(src).st_mode):
            shutil.copytree(src, dst, symlinks=True)
            shutil.rmtree(src)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
            os.unlink(src)


def write_stream(path: str, conn: _socket.socket, n: int, mode: int, metadata: dict[str, str] | None = None) -> None:
    """Write the next ``n`` bytes of ``conn`` to ``path`` atomically (temporary file and rename), creating
    parent folders, a ``CHUNK`` at a time: an upload never sits in the keeper's memory. ``metadata`` becomes
    the new file's ``user.e2b.*`` xattrs; the file replaced takes its own with it (an overwrite clears them).

    On a failure (disk full, say) the rest of the bytes are read and dropped, so the connection stays
    in step, and the error is raised.
    """
    left = n
    # a fresh name, made only if nothing is there (O_EXCL: never through a symlink that the sandbox's code
    # planted at a name it could guess, which would send a root write and chmod wherever it points); written here,
    # not by ``agentenv.config.replacing``: what runs in a sandbox imports the standard library alone
    tmp = os.path.join(os.path.dirname(path), f".agentenv-tmp-{os.urandom(8).hex()}")  # short, whatever the name
    try:
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                buf = bytearray(min(n, CHUNK))
                view = memoryview(buf)
                while left > 0:
                    got = conn.recv_into(view[:min(left, CHUNK)])
                    if not got:
                        raise ConnectionError("connection closed")
                    left -= got
                    done = 0
                    while done < got:
                        done += f.write(view[done:got])
                write_metadata(f.fileno(), metadata or {})
                os.fchmod(f.fileno(), mode)  # the file written, not what the name may lead to by now
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
    except ConnectionError:
        raise
    except BaseException:
        drain(conn, left)
        raise


def send_file(conn: _socket.socket, path: str) -> None:
    """Answer a read: the file's bytes, streamed from the file when big (never two copies in memory).

    Only regular files: a device (/dev/zero), a FIFO or a socket could be endless or block forever.
    One whose size stat does not tell (/proc, /sys) is read into memory up to MAX_UNSIZED.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        header = {"ok": True, "mode": st.st_mode & 0o7777}
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, f"Is a directory: {path!r}")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file (a device, FIFO or socket): read it with exec")
        if st.st_size > MAX_FILE:
            raise ValueError(f"{path} is {st.st_size} bytes, over read_file's limit of {MAX_FILE}: "
                             "read it in parts (e.g. exec 'split' or 'dd')")
        if st.st_size < CHUNK:  # small, or /proc and /sys (size 0 in stat)
            send_frame(conn, header, _read_capped(f, st.st_size, path, MAX_FILE if st.st_size else MAX_UNSIZED))
            return
        size = st.st_size
        head = _dumps(header).encode()
        conn.sendall(_HEAD.pack(len(head), size) + head)
        sent = _sendfile(conn, fd, size)
        if sent < size:  # the file shrank under us: the frame cannot be completed
            raise ConnectionError(f"{path} shrank while being read")


def _sendfile(conn: _socket.socket, fd: int, size: int) -> int:
    """Send ``size`` bytes of the file ``fd`` by os.sendfile (socket.sendfile's work): how many went before
    the file ended. A connection with a timeout is non-blocking underneath: wait for room within it."""
    sent = 0
    while sent < size:
        try:
            n = os.sendfile(conn.fileno(), fd, sent, min(size - sent, 1 << 30))
        except BlockingIOError:
            poll = select.poll()
            poll.register(conn.fileno(), select.POLLOUT)
            timeout = conn.gettimeout()
            if not poll.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError("timed out") from None
            continue
        if not n:
            break
        sent += n
    return sent


def _read_capped(f: Any, hint: int, path: str, cap: int) -> bytes:
    """The rest of ``f``, at most ``cap`` bytes, reading ``hint`` + 1 bytes first (a small file: one read)."""
    parts = [f.read(min(hint + 1, cap + 1) if hint else min(CHUNK, cap + 1))]
    total = len(parts[0])
    while parts[-1] and total <= cap:
        parts.append(f.read(min(CHUNK, cap + 1 - total)))
        total += len(parts[-1])
    if total > cap:
        raise ValueError(f"{path} is over read_file's limit of {cap} bytes for a file of this kind")
    return parts[0] if len(parts) <= 2 else b"".join(parts)


