"""The direct restore of a memory snapshot: ``criu restore`` run by agentenv rather than through ``runc restore``.

Done as the dump is (``agentenv.snapshot.criu``): ``runc restore`` spent ~25-35 ms of a ~90 ms restore around CRIU
(its own start, a ``criu swrk`` version probe, the cgroups, the mount points, its record). The dump keeps
runc's record of the container with the images (``runc-state.json``); a restore makes the new sandbox's cgroups
and limits as runc would (``agentenv.host.cgroups``), runs ``criu restore`` with runc's options (the cgroups given as
the new root, the sandbox's network namespace inherited, the bind mounts mapped; plus ``--cgroup-yard``, which
runc cannot pass), then writes runc's record of the restored container (from the dumped one's, with the new
id, init, cgroups, namespaces and root), so that ``runc state``, ``delete`` and later dumps know it. Where it
cannot do what runc would (images without runc's record, a cgroup v2 host, stdio pipes, hooks, a mount point
missing or behind a symbolic link in the root), or with ``$AGENTENV_DIRECT_RESTORE=0``, ``runc restore`` runs
as before. A restore cut short before runc's record is written leaves processes runc does not know:
``Container.destroy`` ends whatever is in the sandbox's cgroups and removes them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentenv.config import crash_point, write_private
from agentenv.errors import CheckpointError
from agentenv.host import cgroups
from agentenv.host.hostcalls import proc_start_time
from agentenv.host.runtime import LINK
from agentenv.snapshot.criu import LOG_LEVEL, RUNC_STATE, cgroup_yard, fix, in_root, run

DIRECT_RESTORE_ENV = "AGENTENV_DIRECT_RESTORE"  # "0": every restore through ``runc restore``, as before


def restore(images: Path, work: Path, bundle: Path, cid: str, runc_root: Path, lazy: bool,
            criu: str | None = None, setup: Callable[[int], None] | None = None,
            address: str | None = None) -> int | None:
    """Restore the dump in ``images`` into the prepared bundle as runc container ``cid``, running ``criu restore``
    directly (see the module doc); the host pid of its init, or None where only ``runc restore`` can (the caller
    runs it then). ``setup(pid)`` sets up the sandbox's new (empty) network namespace once CRIU has made it, before
    any socket or process is restored (``NamespaceHook``); ``address``: the one it will give the sandbox.
    CheckpointError with CRIU's reason if the restore fails; nothing of it is left then."""
    plan = _restore_plan(images, bundle)
    if plan is None:
        return None
    template, oci, paths, descriptors = plan
    rootfs = bundle / oci["root"]["path"]
    new_cg = oci["linux"]["cgroupsPath"]
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    pidfile = work / "restore.pid"
    pidfile.unlink(missing_ok=True)
    args = ["restore", "--images-dir", str(images), "--work-dir", str(work), "--log-file", "restore.log",
            f"-v{LOG_LEVEL}", "--root", str(rootfs), "--restore-detached", "--pidfile", str(pidfile),
            "--manage-cgroups", "--cgroup-root", new_cg, tcp_mode(images, address), "--file-locks",
            "--evasive-devices"]
    if lazy:
        args.append("--lazy-pages")
    if any(ns.get("type") == "network" and not ns.get("path") for ns in oci["linux"].get("namespaces") or []):
        args += ["--empty-ns", "net"]  # made empty, as it was dumped: the host sets it up (Container.connect)
    yard = cgroup_yard()
    if yard:
        args += ["--cgroup-yard", yard]
    for m in oci.get("mounts") or []:
        if m.get("type") == "bind":
            args += ["--external", f"mnt[{in_root(m['destination'])}]:{m['source']}"]
    if oci["linux"].get("maskedPaths"):
        args += ["--external", "mnt[/dev/null]:/dev/null"]
    for dev in template["config"].get("devices") or []:
        args += ["--external", f"mnt[{dev['path']}]:{dev['path']}"]
    fds: list[int] = []
    hook = NamespaceHook(work, setup) if setup is not None else None
    if hook is not None:
        args += ["--action-script", str(hook.script)]
    try:
        for ns in oci["linux"].get("namespaces") or []:
            if ns.get("type") == "network" and ns.get("path"):
                fds.append(os.open(ns["path"], os.O_RDONLY | os.O_CLOEXEC))
                args += ["--inherit-fd", f"fd[{fds[-1]}]:extRootNetNS"]
        try:
            try:
                cgroups.create(paths, template["config"]["cgroups"].get("devices") or [], oci["linux"]["resources"])
            except OSError as e:
                raise CheckpointError(f"could not make the sandbox's cgroups for the restore: {e}",
                                      fix="check /sys/fs/cgroup (cgroup v1) is writable") from e
            try:
                # our CRIU build runs the script for this action alone (scripts/criu-patches/0006)
                run(criu, args, work / "restore.log", tuple(fds), {"CRTOOLS_SCRIPT_ACTIONS": "setup-namespaces"})
            except CheckpointError as e:
                if hook is not None and hook.error is not None:
                    raise CheckpointError(f"setting up the restored sandbox's network failed: {hook.error}",
                                          fix=getattr(hook.error, "fix", None) or fix(criu)) from e
                raise
            pid = int(pidfile.read_text())
            crash_point("restore:criu-done")
            _write_runc_state(runc_root / cid, template, oci, bundle, cid, pid, paths, descriptors)
        except BaseException:
            cgroups.remove(paths.values())  # and whatever CRIU left in them
            raise
    finally:
        for fd in fds:
            os.close(fd)
        if hook is not None:
            hook.close()
    return pid


class NamespaceHook:
    """CRIU's ``setup-namespaces`` action, served by this process: CRIU runs ``script`` once it has made the
    restored sandbox's namespaces and before it restores a socket or runs a process; the script names the
    restored init through one FIFO and waits on another while ``setup`` (run on a thread here) gives the empty
    network namespace its loopback, rules and link. Sockets bound to its addresses and connections through them
    then come back as they were, and no restored process ever runs without its rules.

    Both FIFOs are opened read-write here first, so that no open blocks whoever comes first, and ``close``
    wakes the thread by writing to them itself when CRIU never ran the action (it failed before)."""

    def __init__(self, work: Path, setup: Callable[[int], None]) -> None:
        self.script, self._setup = work / "setup-namespaces.sh", setup
        ready, done = work / "ns-ready.fifo", work / "ns-done.fifo"
        for f in (ready, done):
            f.unlink(missing_ok=True)
            os.mkfifo(f, 0o600)
        self._ready = os.open(ready, os.O_RDWR | os.O_CLOEXEC)
        self._done = os.open(done, os.O_RDWR | os.O_CLOEXEC)
        self.script.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = setup-namespaces ] || exit 0\n'
                               f'echo "$CRTOOLS_INIT_PID" >{ready}\nread -r answer <{done}\n[ "$answer" = ok ]\n')
        self.script.chmod(0o700)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="agentenv-criu-setup-ns", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        text = os.read(self._ready, 64).decode().strip()
        if not text:  # close(): CRIU is done without asking
            return
        answer = b"ok\n"
        try:
            self._setup(int(text))
        except BaseException as e:  # noqa: BLE001 - handed to the restoring thread
            self.error, answer = e, b"failed\n"
        os.write(self._done, answer)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._ready, b"\n")  # wakes the thread if it still waits (else nobody reads it)
        self._thread.join()
        os.close(self._ready)
        os.close(self._done)


def hand_over(images: Path, work: Path, bundle: Path) -> None:
    """Give a restore's images and work folders to the sandbox's root (its host uid, from the bundle's config.json):
    CRIU reads and writes them again from inside the sandbox's user namespace. Others may pass through them too
    (0711): CRIU's first task opens some images while its ids are still the host's root's, before the namespace's
    maps are written, when the folders' owner is no one it knows. No other host user gets that far: both are in
    gates of the sandbox's range (its bundle, the snapshot's folder: ``config.Paths``). Their files stay the host's
    root's (CRIU writes its images 0644, its logs 0600; runc's records here are 0600)."""
    oci = json.loads((bundle / "config.json").read_text())
    maps = oci.get("linux", {}).get("uidMappings") or []
    owner = next((int(m["hostID"]) for m in maps if int(m.get("containerID", -1)) == 0), None)
    if owner is not None:
        for d in (images, work):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chown(d, owner, owner)
            os.chmod(d, 0o711)



def tcp_mode(images: Path, address: str | None) -> str:
    """How established TCP connections come back: as they were (``--tcp-established``) where the sandbox gets the
    address it had at the dump (``address``: a resume), else closed (``--tcp-close``: a fork child or a restore has
    an address of its own, and a connection cannot be bound back to another's; its process sees it reset)."""
    try:
        before = json.loads((images / LINK).read_text()).get("address")
    except (OSError, ValueError):
        return "--tcp-established"  # loopback only: its connections are between its own sockets
    return "--tcp-established" if before == address else "--tcp-close"


def _restore_plan(images: Path, bundle: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Path],
                                                         list[str]] | None:
    """What a direct restore needs (runc's record of the dumped container, the new config.json, the new
    cgroups' paths, the init's stdio), or None where it cannot do what ``runc restore`` would: images dumped
    without runc's record (older snapshots), a cgroup v2 host, stdio pipes to pass, hooks, network devices,
    or a mount point missing or behind a symbolic link in the sandbox's root (runc makes those safely)."""
    try:
        template = json.loads((images / RUNC_STATE).read_text())
        oci = json.loads((bundle / "config.json").read_text())
        descriptors = json.loads((images / "descriptors.json").read_text())
        config = template["config"]
        paths = cgroups.v1_paths(template.get("cgroup_paths") or {}, config["cgroups"]["path"],
                                 oci["linux"]["cgroupsPath"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if paths is None or any("pipe:" in d for d in descriptors):
        return None
    if any(n.get("type") != "loopback" for n in config.get("networks") or []):  # runc's own netns: loopback
        return None
    if any(v for v in (config.get("Hooks") or {}).values()):
        return None
    rootfs = bundle / oci["root"]["path"]
    tmpfs = [m["destination"] for m in oci.get("mounts") or [] if m.get("type") == "tmpfs"]
    for m in oci.get("mounts") or []:
        dest = in_root(m["destination"])
        if not any(dest.startswith(t.rstrip("/") + "/") for t in tmpfs) and not _plain_path(rootfs, dest):
            return None
    return template, oci, paths, descriptors


def _plain_path(root: Path, dest: str) -> bool:
    """True if ``dest`` exists under ``root`` with no symbolic link on the way (never followed)."""
    p = root
    for part in dest.strip("/").split("/"):
        p = p / part
        try:
            if os.lstat(p).st_mode & 0o170000 == 0o120000:
                return False
        except OSError:
            return False
    return True


def _write_runc_state(folder: Path, template: dict[str, Any], oci: dict[str, Any], bundle: Path, cid: str,
                      pid: int, paths: dict[str, Path], descriptors: list[str]) -> None:
    """runc's record of the restored container, as ``runc restore`` writes it (from the dumped container's, with
    what differs: id, init, cgroups, namespaces, root), so that ``runc state``, ``delete`` and later dumps work.
    ``template`` (read for this restore alone) is changed in place."""
    state = template
    config = state["config"]
    config["rootfs"] = str(bundle / oci["root"]["path"])
    config["hostname"] = oci.get("hostname", config.get("hostname"))
    config["labels"] = [f"bundle={bundle}"]
    config["cgroups"]["path"] = oci["linux"]["cgroupsPath"]
    net = {ns.get("type"): ns.get("path", "") for ns in oci["linux"].get("namespaces") or []}.get("network")
    for ns in config.get("namespaces") or []:
        if ns.get("type") == "NEWNET" and net is not None:
            ns["path"] = net
    sources = {m["destination"]: m["source"] for m in oci.get("mounts") or [] if m.get("type") == "bind"}
    for m in config.get("mounts") or []:
        if m.get("device") == "bind" and m.get("destination") in sources:
            m["source"] = sources[m["destination"]]
    state.update(id=cid, init_process_pid=pid, init_process_start=proc_start_time(pid),
                 created=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                 cgroup_paths={k: str(v) for k, v in paths.items()}, external_descriptors=descriptors,
                 namespace_paths={k: f"/proc/{pid}/ns/{os.path.basename(v)}"
                                  for k, v in (state.get("namespace_paths") or {}).items()})
    folder.mkdir(mode=0o711, parents=True, exist_ok=True)  # as runc makes it (in its root, 0700)
    write_private(folder / "state.json", json.dumps(state))  # as runc writes it


