"""The kernel calls that set up a sandbox's root and network namespace, made from this process.

Each sandbox start (create, fork child, restore, resume) mounts its overlay root and makes a network
namespace holding only loopback. Done with mount(8), unshare(1) and ip(8), that was three fork+execs, 10-15 ms
on an idle 2-core machine and several times that under load, on the critical path of every fork; the same
work as direct system calls (libc through ctypes) costs well under a millisecond.

The programs this process still runs on that path (runc) are waited for with ``run_program``: woken the
instant the program exits, through a pidfd, where ``subprocess.run(timeout=...)`` polls with sleeps that
double up to 50 ms (a runc start done in 33 ms was seen 31 ms later).

The network namespace is made by a short-lived thread: ``unshare(CLONE_NEWNET)`` moves only the calling
thread, which bind-mounts its namespace on the sandbox's ``netns`` file, brings loopback up through an ioctl
on a socket it opens there, and ends. No other thread of the process ever changes namespace, and if any
step fails the namespace dies with the thread (nothing is left but the empty file, which ``drop_netns``
removes).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

from agentenv.errors import SandboxError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
MS_BIND = 0x1000
MNT_DETACH = 0x2
CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_IFF_UP = 0x1
_IFREQ = struct.Struct("16sH22x")  # struct ifreq: the interface name, then ifr_flags (the rest of the union)


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
    """Mount the overlay of ``lowers`` (top first) under ``upper`` on ``target``. ``volatile`` where the kernel
    has it (5.10+): a sync in the sandbox does not flush the volume every sandbox shares."""
    opts = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    try:
        mount("overlay", target, "overlay", 0, opts + ",volatile")
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        mount("overlay", target, "overlay", 0, opts)  # a kernel older than 5.10


def make_netns(path: Path) -> None:
    """A persistent network namespace bound on ``path``, holding only loopback (up); SandboxError if the
    kernel refuses (the error names the step)."""
    if os.path.ismount(path):
        return
    path.touch()
    failed: list[BaseException] = []

    def inside() -> None:  # this thread alone enters the new namespace, and ends with it
        try:
            _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            mount(f"/proc/self/task/{threading.get_native_id()}/ns/net", path, None, MS_BIND)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = bytearray(_IFREQ.pack(b"lo", 0))
                fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)
                flags = _IFREQ.unpack(req)[1]
                fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, bytearray(_IFREQ.pack(b"lo", flags | _IFF_UP)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            failed.append(e)

    t = threading.Thread(target=inside, name="agentenv-netns")
    t.start()
    t.join()
    if failed:
        if os.path.ismount(path):
            drop_netns(path)
        raise SandboxError(f"could not create the sandbox's network namespace: {failed[0]}",
                           fix="agentenv needs root (CAP_SYS_ADMIN) on a kernel with network namespaces")


def drop_netns(path: Path) -> None:
    """Unmount a namespace ``make_netns`` bound on ``path`` (it ends with its last user) and remove the file."""
    if os.path.ismount(path):
        with contextlib.suppress(OSError):
            umount(path, lazy=True)
    path.unlink(missing_ok=True)


def run_program(cmd: list[str], timeout: float, capture: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (stdin and stderr /dev/null; stdout too unless ``capture``) and wait for it to exit, at most
    ``timeout`` seconds (then it is killed and ``subprocess.TimeoutExpired`` raised), waking when it exits."""
    out: list[bytes] = []
    with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL) as proc:
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
