"""The container runtime under a sandbox: an overlayfs root over the Docker image's layers, run by runc.

Docker owns the images; runc (the runtime Docker itself uses) runs the sandbox directly so that
CRIU checkpoints and restores skip Docker's checkpoint plumbing, which copies every checkpoint
through containerd's content store (seconds instead of a few hundred milliseconds).
The OCI spec keeps Docker's safe defaults and more: own pid/ipc/uts/mount/network/cgroup namespaces, a user
namespace whose root is an unprivileged host uid (``agentenv.host.userns``; a sandbox with network
is linked to the outside by ``agentenv.host.network``, never through the host's own namespace), a small
capability set, no-new-privileges, a seccomp allowlist modelled on Docker's default profile, masked
/proc paths and cgroup limits.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv import netpolicy
from agentenv.api import Limits
from agentenv.config import paths, write_private
from agentenv.errors import CheckpointError, SandboxError
from agentenv.host import cgroups, ksm, network, userns
from agentenv.host.cgroups import vfork_waiters
from agentenv.host.hostcalls import (
    bind_netns,
    drop_netns,
    idmap_mount,
    mount_overlay,
    run_program,
    swap_root,
    umount,
)
from agentenv.host.keeper_process import KeeperProcess
from agentenv.host.keeper_start import KEEPER_DEST, keeper_command, keeper_env, keeper_file
from agentenv.host.seccomp import seccomp_profile
from agentenv.host.trees import copy_tree
from agentenv.phases import phase

DEFAULT_CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
                "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT"]
_MASKED = ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
           "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware"]
_READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
CPU_PERIOD = 100_000
FREEZE_ATTEMPTS = 20
LINK = "link.json"  # a networked sandbox's link (network.attach's record) in its bundle, and with a dump's images
DEV_SIZE = 256 << 20  # the /dev tmpfs (with /dev/shm): at most this, and at most half the memory limit

@dataclass
class ContainerSpec:
    """Everything needed to (re)build the OCI bundle of a sandbox; stored with it and its snapshots."""

    image_id: str
    layers: list[str]               # overlay lower dirs, top first
    env: list[str]
    workdir: str
    limits: Limits
    network: bool = False           # a link to the outside (agentenv.host.network); loopback only without
    caps: list[str] = field(default_factory=lambda: list(DEFAULT_CAPS))
    rules: dict[str, Any] | None = None  # with network: its outbound rules (netpolicy.Rules.to_json())
    uids: int | None = None  # the host uid of the sandbox's root (agentenv.host.userns): its fork family's range
    share_memory: bool = False  # its keeper marks its pages mergeable (agentenv.host.ksm); kept by forks and snapshots

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["limits"] = self.limits.to_wire()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ContainerSpec:
        return cls(**{**d, "limits": Limits.from_wire(d["limits"])})


def oci_config(spec: ContainerSpec, hostname: str, cgroup: str, resolv: str | None = None) -> dict[str, Any]:
    """The runc config.json of a sandbox whose PID 1 is the keeper.

    Every namespace is new, the user namespace too: the sandbox's ids 0..65535 are ``spec.uids``.. on the host
    (``agentenv.host.userns``), never the host's root. Its network namespace (runc makes it, owned by that user
    namespace) holds loopback, or with network also the link ``agentenv.host.network`` gives it once it runs, and
    ``resolv`` (its resolv.conf) on /etc/resolv.conf. Never the host's namespace.
    """
    if spec.uids is None:
        raise ValueError("every sandbox runs in a user namespace of its own: its spec needs its uids")
    if spec.network and not resolv:
        raise ValueError("a sandbox with network needs its resolv.conf")
    namespaces: list[dict[str, str]] = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network", "user",
                                                              "cgroup")]
    caps = sorted(set(spec.caps))
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        # one tmpfs for /dev, which also holds /dev/shm and the keeper's socket and logs: CRIU saves each
        # tmpfs with tar, so every extra one costs a fork and exec on both dump and restore
        # at most half the memory limit: tmpfs pages count against it, and a full /dev/shm must leave room
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", f"size={dev_size(spec.limits.memory)}"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": KEEPER_DEST, "type": "bind", "source": str(keeper_file(paths().agents)),
         "options": ["rbind", "ro"]},
    ]
    if spec.network:
        mounts.append({"destination": "/etc/resolv.conf", "type": "bind", "source": resolv,
                       "options": ["rbind", "ro"]})
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": keeper_command(),
            "env": spec.env + ["AGENTENV_KEEPER=1", keeper_env()] + ([f"{ksm.MERGE_ENV}=1"] if spec.share_memory else []),
            "cwd": spec.workdir or "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": False},
        "hostname": hostname,
        "mounts": mounts,
        "linux": {
            "namespaces": namespaces,
            "uidMappings": userns.mapping(spec.uids),
            "gidMappings": userns.mapping(spec.uids),
            "cgroupsPath": cgroup,
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                "memory": {"limit": spec.limits.memory},
                "cpu": {"quota": int(spec.limits.cpus * CPU_PERIOD), "period": CPU_PERIOD},
                "pids": {"limit": spec.limits.pids},
            },
            "maskedPaths": _MASKED,
            "readonlyPaths": _READONLY,
            "seccomp": seccomp_profile(caps, share_memory=spec.share_memory),
        },
    }


def dev_size(memory: int) -> int:
    """Bytes of the sandbox's /dev tmpfs: ``DEV_SIZE``, or half the memory limit when that is less."""
    return max(1 << 20, min(DEV_SIZE, memory // 2))


class Container:
    """One runc container in a bundle folder (``rootfs/``, ``config.json``, logs) whose overlay's ``upper/`` and
    ``work/`` folders are in ``layer`` (on the volume; the bundle itself in older sandboxes)."""

    def __init__(self, cid: str, bundle: Path, runc_root: Path, layer: Path | None = None) -> None:
        self.cid, self.bundle, self.runc_root = cid, bundle, runc_root
        self.layer = layer or bundle

    @property
    def upper(self) -> Path:
        return self.layer / "upper"

    @property
    def work(self) -> Path:
        return self.layer / "work"

    @property
    def rootfs(self) -> Path:
        return self.bundle / "rootfs"

    @property
    def netns(self) -> Path:
        return self.bundle / "netns"

    @property
    def link_file(self) -> Path:
        """Where a networked sandbox's link (``network.attach``'s record) is noted, for ``destroy``."""
        return self.bundle / LINK

    def link(self) -> dict[str, Any] | None:
        """The sandbox's link to the outside (address, veth), or None without network."""
        try:
            return json.loads(self.link_file.read_text())
        except (OSError, ValueError):
            return None

    @property
    def cgroup(self) -> str:
        return f"/agentenv/{self.cid}"

    def runc(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run runc; its errors come back in ``stderr``. The container's own stdio is /dev/null.

        runc's log goes to a file of this call's own outside the bundle, read and removed at once: a call racing
        ``close()`` must not bring the removed sandbox folder back (runc creates its log's folder).
        """
        fd, name = tempfile.mkstemp(prefix=f"agentenv-runc-{self.cid}.", suffix=".log")
        os.close(fd)
        log = Path(name)
        try:
            r = run_program(["runc", "--root", str(self.runc_root), "--log", str(log), "--log-format", "json", *args],
                            timeout, capture=args[0] == "state")
        except subprocess.TimeoutExpired:
            log.unlink(missing_ok=True)
            verb = next((a for a in args if a in ("run", "state", "delete", "checkpoint", "restore")), args[0])
            error = CheckpointError if verb in ("checkpoint", "restore") else SandboxError
            raise error(f"runc {verb} of {self.cid} did not finish within {timeout:g} s (killed)",
                        fix="a process of the sandbox may be stuck (stopped, traced, or in uninterruptible "
                            "sleep); check the sandbox, or close it") from None
        try:
            if r.returncode != 0:
                text = log.read_text(errors="replace")
                msgs = [json.loads(line).get("msg", "") for line in text.splitlines() if line.startswith("{")]
                r.stderr = "\n".join(m for m in msgs if m)
        finally:
            log.unlink(missing_ok=True)
        return r

    # --- filesystem ------------------------------------------------------------------------

    def prepare(self, spec: ContainerSpec, fs_from: Path | None = None) -> None:
        """Create the bundle: an empty (or copied) upper dir owned by the sandbox's root, the overlay mount, the
        resolv.conf of a sandbox with network and config.json. (Its network comes once it runs: ``connect``.)"""
        if spec.uids is None:
            raise ValueError("every sandbox runs in a user namespace of its own: its spec needs its uids")
        cgroups.favor_dynmods()  # once a process: starts move processes into cgroups
        for d in (self.upper, self.work, self.rootfs):
            d.mkdir(parents=True, exist_ok=True)
        if fs_from is not None:
            with phase("fs copy"):
                copy_tree(fs_from, self.upper)
        if not spec.uids <= self.upper.stat().st_uid < spec.uids + userns.SIZE:  # a new layer: the host's root's
            os.chown(self.upper, spec.uids, spec.uids)
        with phase("mount"):
            self.mount(spec)
        resolv = None
        if spec.network:  # readable by others (0644): the sandbox's root reads it through its bind mount
            resolv = self.bundle / "resolv.conf"
            resolv.write_text(network.resolv_conf(network.nameservers()))
        config = oci_config(spec, hostname=self.cid[-12:], cgroup=self.cgroup, resolv=str(resolv) if resolv else None)
        fd = os.open(self.bundle / "config.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "w") as f:  # the host's alone (its env may hold secrets): runc reads it as root
            f.write(json.dumps(config))

    def connect(self, spec: ContainerSpec, pid: int, restored: bool, address: str | None = None) -> None:
        """Name the network namespace runc (or CRIU) made for the running sandbox whose init is ``pid`` (``netns``
        in the bundle) and, with network, give it its link: its rules first, then ``eth0`` (on ``address`` where
        that is free). A restore's namespace comes empty: its loopback is brought up first. Done once: a direct
        restore has CRIU call it before anything of the sandbox runs (``criu.NamespaceHook``)."""
        if os.path.ismount(self.netns) and (not spec.network or self.link_file.exists()):
            return
        with phase("netns"):
            bind_netns(pid, self.netns, loopback=restored)
        if spec.network:
            with phase("network"):
                dns = network.nameservers_in(self.bundle / "resolv.conf")  # what prepare gave it: one reading
                link = network.attach(self.netns, str(self.bundle), netpolicy.Rules.from_json(spec.rules), dns,
                                      address)
                link["dns"] = dns
                write_private(self.link_file, json.dumps(link))

    def set_rules(self, rules: netpolicy.Rules) -> None:
        """Replace a running networked sandbox's outbound rules (atomically)."""
        link = self.link()
        if link is None:
            raise SandboxError("the sandbox has no network link to set rules on")
        network.apply(self.netns, rules, link)

    def mount(self, spec: ContainerSpec) -> None:
        """The sandbox's root: an overlay of the image's layers under its own upper folder (``volatile``: a sync
        in the sandbox does not flush the volume every sandbox shares; its files live as long as it does, and
        snapshots are copies)."""
        if os.path.ismount(self.rootfs):
            return
        assert spec.uids is not None
        lowers = self.bundle / "lower"
        made: list[Path] = []
        fd = userns.userns_fd(spec.uids)
        try:
            for i, layer in enumerate(spec.layers):  # each seen through the sandbox's ids (the disk's stay)
                made.append(lowers / str(i))
                made[-1].mkdir(parents=True, exist_ok=True)
                idmap_mount(layer, made[-1], fd)
            mount_overlay([str(m) for m in made], self.upper, self.work, self.rootfs)
        except OSError as e:
            raise SandboxError(f"overlay mount failed: {e}",
                               fix="check that the image's layers still exist (docker image inspect)") from e
        finally:
            os.close(fd)
            for m in made:  # the overlay holds its own private clones of its layers' mounts
                with contextlib.suppress(OSError):
                    umount(m, lazy=True)
                with contextlib.suppress(OSError):
                    m.rmdir()  # never a recursive delete: a mount left there would be an image's layer
            with contextlib.suppress(OSError):
                lowers.rmdir()

    def unmount(self) -> None:
        if os.path.ismount(self.rootfs):
            try:
                umount(self.rootfs)
            except OSError:
                with contextlib.suppress(OSError):
                    umount(self.rootfs, lazy=True)

    def take_root(self, spec: ContainerSpec, init: KeeperProcess) -> None:
        """Give the running container a new root: the overlay of ``spec``'s image over ``self.layer`` (which a fork
        just cloned), mounted here and swapped in under its processes (``swap_root``; ``init``: its init, pinned)."""
        self.unmount()  # this namespace's copy; the container has its own until the swap
        self.mount(spec)
        swap_root(init.pid, self.rootfs, init.alive)

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> int:
        """Run the container detached; returns the host pid of its init (the keeper)."""
        pidfile = self.bundle / "init.pid"
        r = self.runc("run", "--detach", "--bundle", str(self.bundle), "--pid-file", str(pidfile), self.cid)
        if r.returncode != 0:
            raise SandboxError(f"runc run failed: {r.stderr.strip()}")
        return int(pidfile.read_text())

    def state(self) -> dict[str, Any] | None:
        """runc's view of the container (status, pid), or None if runc does not know it."""
        r = self.runc("state", self.cid)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def destroy(self) -> None:
        """Kill every process, delete the runc container and unmount; tolerant of half-made state."""
        self.runc("delete", "--force", self.cid)
        cgroups.remove(cgroups.existing(self.cgroup))  # what runc had no record of (a direct restore cut short)
        self.unmount()
        network.detach(self.link())
        drop_netns(self.netns)

    def pids(self) -> list[int]:
        """The host pids of the processes in the container's cgroup (the v1 pids controller's, or v2's); empty
        when there is no such cgroup."""
        for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
            with contextlib.suppress(FileNotFoundError):
                return sorted(int(p) for p in (base / self.cgroup.lstrip("/") / "cgroup.procs").read_text().split())
        return []

    def freezer(self) -> Path | None:
        """The freezer control file of the container's cgroup (v1 freezer.state or v2 cgroup.freeze)."""
        v1 = Path("/sys/fs/cgroup/freezer") / self.cgroup.lstrip("/") / "freezer.state"
        if v1.exists():
            return v1
        v2 = Path("/sys/fs/cgroup") / self.cgroup.lstrip("/") / "cgroup.freeze"
        return v2 if v2.exists() else None

    def freeze(self, frozen: bool) -> None:
        """Stop or resume every process of the sandbox at once, for a consistent filesystem copy.

        The v1 freezer can stick in FREEZING, and it counts a parent waiting for its vfork child to exec as
        frozen, a task CRIU then cannot seize ("Unseizable non-zombie state D": a snapshot taken while a process
        spawns one). Either way, like CRIU, thaw and try again (the child execs once thawed), and never leave the
        sandbox half-frozen when giving up; one frozen with such a waiter after the last attempt (a child that
        never execs) is left frozen, and a memory dump of it (``checkpoint``) is then refused.
        """
        f = self.freezer()
        if f is None:
            raise SandboxError("no freezer cgroup for the sandbox")
        if f.name != "freezer.state":  # cgroup v2: cgroup.freeze settles by itself
            f.write_text("1" if frozen else "0")
            return
        if not frozen:
            f.write_text("THAWED")
            return
        for attempt in range(FREEZE_ATTEMPTS):
            f.write_text("FROZEN")
            deadline = time.monotonic() + 0.1
            while time.monotonic() < deadline:
                if f.read_text().strip() == "FROZEN":
                    if attempt == FREEZE_ATTEMPTS - 1 or not vfork_waiters(f.parent / "tasks"):
                        return
                    break
                time.sleep(0.0005)
            f.write_text("THAWED")
            time.sleep(0.01)
        raise SandboxError(f"could not freeze the sandbox in {FREEZE_ATTEMPTS} attempts (left running)",
                           fix="retry the snapshot; a process stuck in uninterruptible sleep blocks the freezer")

    def frozen(self) -> bool:
        """True while the freezer holds (or is taking) the sandbox."""
        f = self.freezer()
        if f is None:
            return False
        state = f.read_text().strip()
        return state != "THAWED" if f.name == "freezer.state" else state == "1"
