"""The kernel calls that set up a sandbox's root and network namespace, made from this process.

Each sandbox start (create, fork child, restore, resume) mounts its overlay root over its image's layers, each
seen through the sandbox's user namespace (an idmapped mount), and names the network namespace runc made for it.
Done with mount(8), unshare(1) and ip(8), that was three fork+execs, 10-15 ms on an idle 2-core machine and
several times that under load, on the critical path of every fork; the same work as direct system calls (libc
through ctypes) costs well under a millisecond.

The programs this process still runs on that path (runc) are waited for with ``run_program``: woken the
instant the program exits, through a pidfd, where ``subprocess.run(timeout=...)`` polls with sleeps that
double up to 50 ms (a runc start done in 33 ms was seen 31 ms later).

Work inside a namespace (loopback up in a restored sandbox's, its address and rules) is done by a short-lived
thread that enters it with ``setns`` and ends: no other thread of the process ever changes namespace. A user
namespace, which a multithreaded process cannot enter or make, is made by a child process (``make_userns``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

from agentenv.errors import SandboxError

_T = TypeVar("_T")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
MS_BIND = 0x1000
MS_NOSUID, MS_NODEV = 0x2, 0x4  # a sandbox's files are never setuid nor a device on the host
MNT_DETACH = 0x2
CLONE_NEWNET = 0x40000000
CLONE_FS, CLONE_NEWNS = 0x200, 0x20000
MS_MOVE, MS_REC, MS_PRIVATE = 0x2000, 0x4000, 1 << 18
AT_FDCWD, OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH, AT_EMPTY_PATH, AT_RECURSIVE = -100, 1, 0x4, 0x1000, 0x8000
CLONE_NEWUSER = 0x10000000
MOUNT_ATTR_IDMAP = 0x00100000
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x2, 0x4
_NR_OPEN_TREE, _NR_MOVE_MOUNT, _NR_MOUNT_SETATTR = 428, 429, 442  # numbers from 424 on: every architecture's
_NR_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
NEW_ROOT = "/.agentenv-root"  # where swap_root puts the new root in the old one, before pivoting to it
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _SIOCSIFADDR, _SIOCSIFNETMASK, _SIOCADDRT = 0x8913, 0x8914, 0x8916, 0x891C, 0x890B
_IFF_UP = 0x1
_RTF_UP, _RTF_GATEWAY = 0x1, 0x2
_IFREQ = struct.Struct("16sH22x")  # struct ifreq: the interface name, then ifr_flags (the rest of the union)
_IFREQ_ADDR = struct.Struct("16sH2s4s8x")  # struct ifreq with a struct sockaddr_in: name, AF_INET, port, address


class _MountAttr(ctypes.Structure):  # struct mount_attr (<linux/mount.h>), for mount_setattr
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_ushort), ("addr", ctypes.c_uint32),  # network order
                ("zero", ctypes.c_ubyte * 8)]


class _RtEntry(ctypes.Structure):  # struct rtentry (<net/route.h>), for SIOCADDRT
    _fields_ = [("pad1", ctypes.c_ulong), ("dst", _SockaddrIn), ("gateway", _SockaddrIn), ("genmask", _SockaddrIn),
                ("flags", ctypes.c_ushort), ("pad2", ctypes.c_short), ("pad3", ctypes.c_ulong),
                ("pad4", ctypes.c_void_p), ("metric", ctypes.c_short), ("dev", ctypes.c_char_p),
                ("mtu", ctypes.c_ulong), ("window", ctypes.c_ulong), ("irtt", ctypes.c_ushort)]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: Path, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    """mount(2); OSError with the kernel's errno."""
    _check(_libc.mount(source.encode(), str(target).encode(), fstype.encode() if fstype else None, flags,
                       data.encode() if data is not None else None), f"mount {source} on {target}")


def umount(target: Path, lazy: bool = False) -> None:
    """umount2(2) (``lazy``: MNT_DETACH); OSError with the kernel's errno."""
    _check(_libc.umount2(str(target).encode(), MNT_DETACH if lazy else 0), f"umount {target}")


def mount_overlay(lowers: list[str], upper: Path, work: Path, target: Path) -> None:
    """Mount the overlay of ``lowers`` (top first) under ``upper`` on ``target``, ``nosuid,nodev``: a setuid file
    or a device node the sandbox holds does nothing on the host (inside, no-new-privileges already ignores setuid
    bits, the sandbox's runc bind keeps these flags, and its /dev is a tmpfs of its own). ``volatile`` where the
    kernel has it (5.10+): a sync in the sandbox does not flush the volume every sandbox shares."""
    opts = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    try:
        mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, opts + ",volatile")
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, opts)  # a kernel older than 5.10


def seal_mount(target: Path) -> None:
    """Add ``nosuid,nodev`` to the mount on ``target`` (mount_setattr, Linux 5.12+: its other flags stay); OSError
    with the errno."""
    attr = _MountAttr(attr_set=MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    _check(_libc.syscall(_NR_MOUNT_SETATTR, AT_FDCWD, str(target).encode(), 0, ctypes.byref(attr),
                         ctypes.c_size_t(ctypes.sizeof(attr))), f"mount_setattr nosuid,nodev {target}")


def idmap_mount(source: str, target: Path, userns: int) -> None:
    """Mount ``source`` on ``target`` (an empty folder) as seen through the user namespace ``userns`` (an idmapped
    mount, Linux 5.12+: a file owned by host uid k on disk shows as k's image there); OSError with the errno."""
    tree = _check_fd(_libc.syscall(_NR_OPEN_TREE, AT_FDCWD, source.encode(), OPEN_TREE_CLONE | os.O_CLOEXEC),
                     f"open_tree {source}")
    try:
        attr = _MountAttr(attr_set=MOUNT_ATTR_IDMAP, userns_fd=userns)
        _check(_libc.syscall(_NR_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH, ctypes.byref(attr),
                             ctypes.c_size_t(ctypes.sizeof(attr))), f"idmapping {source}")
        _check(_libc.syscall(_NR_MOVE_MOUNT, tree, b"", AT_FDCWD, str(target).encode(), MOVE_MOUNT_F_EMPTY_PATH),
               f"move_mount {source} to {target}")
    finally:
        os.close(tree)


def make_userns(base: int, size: int, path: Path | None, timeout: float = 10.0, inside: int = 0) -> int:
    """A descriptor (the caller's to close) of a new user namespace whose ids ``inside``.. (size of them) are host ids
    base.., also bound on ``path`` unless None: ``unshare --user`` makes it (a multithreaded process cannot, and forking this one
    costs ~100 ms once it holds gigabytes), this process writes its maps once the child is in it and opens (and
    binds) it, then the child is killed. OSError if it cannot be made."""
    own = os.stat("/proc/self/ns/user").st_ino
    with subprocess.Popen(["unshare", "--user", "--", "sleep", str(int(timeout) + 1)], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as child:
        try:
            deadline = time.monotonic() + timeout
            while os.stat(f"/proc/{child.pid}/ns/user").st_ino == own:  # until it has unshared (a state, not a time)
                if child.poll() is not None or time.monotonic() > deadline:
                    raise OSError(errno.EPERM, "unshare --user did not make a user namespace (needs root and "
                                               "user namespaces: sysctl user.max_user_namespaces)")
                time.sleep(0.0001)
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{child.pid}/{name}", "w") as f:
                    f.write(f"{inside} {base} {size}\n")
            fd = os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            if path is not None:
                try:
                    path.touch()
                    mount(f"/proc/{child.pid}/ns/user", path, None, MS_BIND)
                except BaseException:
                    os.close(fd)
                    raise
            return fd
        finally:
            child.kill()


def on_thread(fn: Callable[[], _T], name: str) -> _T:
    """Run ``fn`` on a thread of its own and hand back its result or exception: for work that changes the calling
    thread's namespaces (unshare, setns), which dies with that thread and touches no other."""
    result: list[_T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            failed.append(e)

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if failed:
        raise failed[0]
    return result[0]


def bind_netns(pid: int, path: Path, loopback: bool = False) -> None:
    """Bind the network namespace of process ``pid`` (runc made it) on ``path``, so that the host can set it up and
    tear it down by name; ``loopback``: bring its ``lo`` up too (a CRIU restore makes it down)."""
    if not os.path.ismount(path):
        path.touch()
        mount(f"/proc/{pid}/ns/net", path, None, MS_BIND)
    if loopback:
        def inside() -> None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _check(_libc.setns(fd, CLONE_NEWNET), "setns(net)")
            finally:
                os.close(fd)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                _link_up(s, b"lo")

        on_thread(inside, "agentenv-netns-lo")


def _link_up(s: socket.socket, name: bytes) -> None:
    req = bytearray(_IFREQ.pack(name, 0))
    fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)
    flags = _IFREQ.unpack(req)[1]
    fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, bytearray(_IFREQ.pack(name, flags | _IFF_UP)))


def configure_ipv4(name: str, address: str, netmask: str, gateway: str) -> None:
    """Give the interface ``name`` of the calling thread's network namespace an IPv4 address, bring it up and
    route everything through ``gateway`` (ioctls: no ``ip`` to run); OSError with the kernel's errno."""
    dev = name.encode()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), _SIOCSIFADDR, _IFREQ_ADDR.pack(dev, socket.AF_INET, b"", socket.inet_aton(address)))
        fcntl.ioctl(s.fileno(), _SIOCSIFNETMASK, _IFREQ_ADDR.pack(dev, socket.AF_INET, b"", socket.inet_aton(netmask)))
        _link_up(s, dev)
        route = _RtEntry(dst=_SockaddrIn(socket.AF_INET), genmask=_SockaddrIn(socket.AF_INET),
                         gateway=_SockaddrIn(socket.AF_INET, 0, struct.unpack("=I", socket.inet_aton(gateway))[0]),
                         flags=_RTF_UP | _RTF_GATEWAY)
        fcntl.ioctl(s.fileno(), _SIOCADDRT, bytes(route))


def proc_start_time(pid: int) -> int:
    """When a process started (clock ticks since boot, field 22 of ``/proc/<pid>/stat``): with the pid,
    a name no later process gets. ProcessLookupError when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ProcessLookupError(3, f"no process {pid}") from None
    return int(data[data.rindex(b")") + 2:].split()[19])  # after the command name, which may hold anything


def swap_root(pid: int, rootfs: Path, alive: Callable[[], bool]) -> None:
    """Make the mount on ``rootfs`` (in this process's namespace) the root of ``pid``'s mount namespace, with the
    mounts on the old root (/proc, /dev, /sys, binds, each with what is mounted under it) moved onto it, and the
    old root detached. Every process there whose root was the old root has the new one; cwds elsewhere stay
    in the old tree (the caller moves them). For a namespace that runs nothing untrusted yet (a pooled sandbox):
    it is read from /proc. ``alive``: whether the process the caller pinned as ``pid`` (a pidfd) still lives;
    asked once its /proc files are open, so that they cannot be those of a later process given the same number
    (ProcessLookupError then). The new root is made private in that namespace before anything moves onto it:
    a clone of a shared mount (the host's mounts on systemd) would have the moves copied back to the host, and
    pivot_root refuses it. SandboxError if a mount point in the new root goes through a symbolic link (checked
    before anything moves; the new root is taken out again), OSError (the kernel's errno) if a step fails."""
    if _NR_PIVOT_ROOT is None:
        raise OSError(errno.ENOSYS, f"swap_root is not supported on {platform.machine()}")
    mounts = mountinfo(pid)
    root_id = next(m.id for m in mounts if m.point == "/")
    tops = [m.point for m in mounts if m.parent == root_id and m.point != NEW_ROOT]
    ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if not alive():  # its pid may name another process now (another sandbox's, the host's)
            raise ProcessLookupError(errno.ESRCH, f"the process {pid} whose root was to be swapped is gone")
        tree = _check_fd(_libc.syscall(_NR_OPEN_TREE, AT_FDCWD, str(rootfs).encode(),
                                       OPEN_TREE_CLONE | os.O_CLOEXEC), f"open_tree {rootfs}")
    except BaseException:
        os.close(ns)
        raise
    failed: list[BaseException] = []

    def inside() -> None:  # this thread alone enters the namespace (its root and cwd become the old root)
        try:
            _check(_libc.unshare(CLONE_FS), "unshare(CLONE_FS)")
            _check(_libc.setns(ns, CLONE_NEWNS), "setns(mnt)")
            mount("none", Path("/"), None, MS_REC | MS_PRIVATE)  # moves and pivot_root need private parents
            os.makedirs(NEW_ROOT, exist_ok=True)
            _check(_libc.syscall(_NR_MOVE_MOUNT, tree, b"", AT_FDCWD, NEW_ROOT.encode(), MOVE_MOUNT_F_EMPTY_PATH),
                   "move_mount")
            mount("none", Path(NEW_ROOT), None, MS_PRIVATE)  # the clone is a peer of the host's mount, if shared
            for point in tops:  # every mount point checked before anything moves: a refusal leaves all in place
                target = NEW_ROOT + point
                if not os.path.lexists(target):
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    if os.path.isdir(point):
                        os.mkdir(target)
                    else:
                        os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o644))
                if os.path.realpath(target) != target:  # the new root's files are the sandbox's: no detours
                    raise SandboxError(f"the mount point {point} in the sandbox's files goes through a symbolic link")
            for point in tops:
                mount(point, Path(NEW_ROOT + point), None, MS_MOVE)
            os.chdir(NEW_ROOT)
            _check(_libc.syscall(_NR_PIVOT_ROOT, b".", b"."), "pivot_root")
            umount(Path("."), lazy=True)  # the old root, stacked under the new one by pivot_root(".", ".")
            os.chdir("/")
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            failed.append(e)
            with contextlib.suppress(OSError):  # the new root goes, so that its layer can be mounted afresh
                umount(Path(NEW_ROOT), lazy=True)

    try:
        t = threading.Thread(target=inside, name="agentenv-swap-root")
        t.start()
        t.join()
    finally:
        os.close(ns)
        os.close(tree)
    if failed:
        raise failed[0]


class Mount(NamedTuple):
    """One line of a mountinfo table: the mount's id, its parent's, where it is mounted and its type."""

    id: int
    parent: int
    point: str
    fstype: str


def mountinfo(pid: int | str = "self") -> list[Mount]:
    """The mounts of ``pid``'s mount namespace (this process's by default), as that namespace names them."""
    rows = []
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
            rows.append(Mount(int(fields[0]), int(fields[1]), point, right.split()[0]))
    return rows


def _check_fd(rc: int, what: str) -> int:
    _check(0 if rc >= 0 else -1, what)
    return rc


def drop_netns(path: Path) -> None:
    """Unmount a namespace ``bind_netns`` bound on ``path`` (it ends with its last user) and remove the file."""
    if os.path.ismount(path):
        with contextlib.suppress(OSError):
            umount(path, lazy=True)
    path.unlink(missing_ok=True)


def run_program(cmd: list[str], timeout: float, capture: bool = False, pass_fds: tuple[int, ...] = (),
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (stdin and stderr /dev/null; stdout too unless ``capture``; ``pass_fds`` kept open in it; ``env``
    added to this process's environment) and wait for it to exit, at most ``timeout`` seconds (then it is killed
    and ``subprocess.TimeoutExpired`` raised), waking when it exits."""
    out: list[bytes] = []
    with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, pass_fds=pass_fds,
                          env={**os.environ, **env} if env else None) as proc:
        pidfd = os.pidfd_open(proc.pid)
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            if proc.stdout is not None:
                os.set_blocking(proc.stdout.fileno(), False)
                poller.register(proc.stdout.fileno(), select.POLLIN)
            deadline = time.monotonic() + timeout
            exited = False
            while not exited:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    proc.wait()
                    raise subprocess.TimeoutExpired(cmd, timeout)
                for fd, _ in poller.poll(max(1, int(remaining * 1000))):
                    if fd == pidfd:
                        exited = True
                    elif not _drain(fd, out):
                        poller.unregister(fd)
            if proc.stdout is not None:  # what it wrote before exiting (not what a child it left may write later)
                _drain(proc.stdout.fileno(), out)
        finally:
            os.close(pidfd)
        returncode = proc.wait()
    return subprocess.CompletedProcess(cmd, returncode, b"".join(out).decode(errors="replace") if capture else "", "")


def _drain(fd: int, out: list[bytes]) -> bool:
    """Read what the non-blocking pipe ``fd`` holds into ``out``; False once it is at its end."""
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        if not data:
            return False
        out.append(data)
