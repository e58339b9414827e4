"""The files of a template's COPY step, placed by a process inside its build sandbox (the image's ``python3``,
standard library only; the host runs this file's source with ``python3 -I -S -c``).

Why inside: the sandbox's root is a user namespace's, so every path and link met while writing resolves in the
sandbox's own root, and everything written is owned by its uid range, never a host file. The host checked the
upload first (``agentenv.host.archives``) and sends, on stdin, a tar of just the files the step copies (see
``agentenv.server.e2b.template_copy``): names relative to the destination, owners 0, no devices, no hard links.

argv: ``DEST MODE OWNER``. MODE ``into``: the members go under the folder DEST (made if missing). MODE ``as``:
the one member is the file DEST, or goes inside it when DEST ends with '/' or is a folder (as Docker's COPY).
OWNER: empty for root, else ``user[:group]`` of the image's /etc/passwd and /etc/group (names or numbers; a
user alone takes the group of its name where there is one, else its primary group). What is replaced is
removed first, so nothing is written through a link that was there. Exit 3 with "unable to find user NAME"
(or group) on stderr for an owner the image lacks; 1 with the error for anything else.
"""

import os
import shutil
import sys
import tarfile


class NoSuchOwner(Exception):
    pass


def rows(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n").split(":") for line in f if line.strip() and not line.startswith("#")]
    except OSError:
        return []


def owner_ids(spec):
    """(uid, gid) of ``user[:group]`` in the image."""
    if not spec:
        return 0, 0
    user, _, group = spec.partition(":")
    found = [r for r in rows("/etc/passwd") if len(r) >= 4 and r[0] == user and r[2].isdigit() and r[3].isdigit()]
    if found:
        uid, gid = int(found[0][2]), int(found[0][3])
    elif user.isdigit():
        uid, gid = int(user), int(user)
    else:
        raise NoSuchOwner("unable to find user " + user)
    name = group or user
    groups = [r for r in rows("/etc/group") if len(r) >= 3 and r[0] == name and r[2].isdigit()]
    if groups:
        gid = int(groups[0][2])
    elif group.isdigit():
        gid = int(group)
    elif group:
        raise NoSuchOwner("unable to find group " + group)
    return uid, gid


def make_dirs(path, uid, gid):
    """Make ``path`` and its missing parents (0755, owned by uid:gid)."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path.rstrip("/"))
    for d in reversed(missing):
        if os.path.lexists(d):
            os.unlink(d)  # a file or a dangling link where a folder must be
        os.mkdir(d, 0o755)
        os.lchown(d, uid, gid)


def clear(path, keep_dir):
    """Remove what is at ``path`` (a folder stays when ``keep_dir``: a folder is merged into)."""
    if os.path.isdir(path) and not os.path.islink(path):
        if not keep_dir:
            shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def place(tar, member, path, uid, gid):
    make_dirs(os.path.dirname(path.rstrip("/")), uid, gid)
    clear(path, member.isdir())
    if member.isdir():
        if not os.path.isdir(path):
            os.mkdir(path, 0o700)
    elif member.issym():
        os.symlink(member.linkname, path)
    elif member.isreg():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(tar.extractfile(member), out, 1 << 20)
    else:
        raise ValueError(f"member {member.name!r} is of a kind this does not place")
    os.lchown(path, uid, gid)
    if not member.issym():
        os.chmod(path, member.mode & 0o7777)
        if not member.isdir():
            os.utime(path, (member.mtime, member.mtime))


def main(dest, mode, owner):
    uid, gid = owner_ids(owner)
    dirs = []
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        if mode == "as":
            member = tar.next()
            if member is None:
                raise ValueError("nothing to copy")
            path = dest
            if dest.endswith("/") or os.path.isdir(dest):
                path = os.path.join(dest, member.name)
            place(tar, member, path, uid, gid)
            return
        make_dirs(dest, uid, gid)
        for member in tar:
            path = os.path.join(dest, member.name)
            place(tar, member, path, uid, gid)
            if member.isdir():
                dirs.append((path, member.mtime))
    for path, mtime in reversed(dirs):  # once their contents are in
        os.utime(path, (mtime, mtime))


if __name__ == "__main__":
    try:
        main(*sys.argv[1:4])
    except NoSuchOwner as e:
        sys.stderr.write(str(e) + "\n")
        sys.exit(3)
    except Exception as e:  # noqa: BLE001 - reported to the host, which names the step
        sys.stderr.write(f"{type(e).__name__}: {e}\n")
        sys.exit(1)
