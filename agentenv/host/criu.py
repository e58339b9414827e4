"""CRIU run directly rather than through runc: the dumps of memory snapshots and the restores of them.

A memory snapshot is a CRIU dump of every process of the sandbox. ``runc checkpoint`` did it through
CRIU's RPC with settings runc fixes. Measured on a 100 MB sandbox (2 cores, kernel 6.18, CRIU 4.1.1), CRIU's
network lock was the largest fixed cost after the memory itself: it locks the sandbox's network namespace with
``iptables-restore`` and unlocks it with several more runs of iptables (52 ms of a ~190 ms dump, the sandbox
frozen all along), and a restore pays it again (~60 ms: CRIU restores with the lock method the dump recorded).
runc 1.1 has no flag for it, and CRIU's configuration-file route (the ``org.criu.config`` annotation) crashes
CRIU 4.1.1 in RPC mode as soon as the file names ``network-lock`` (its check reads ``argv[optind]``, which RPC
mode does not have).

So ``dump`` runs ``criu dump`` itself, with what runc's ``Checkpoint`` (libcontainer, runc 1.1) passes, read
from runc's own record of the container (``state.json`` in runc's root: init pid, rootfs, bind mounts, masked
files, devices, the external network namespace, the freezer cgroup, the init's stdio), and it writes
``descriptors.json`` as runc does, so ``runc restore`` takes these images exactly as it took its own. A dump
leaves runc's record untouched (``--leave-running``), or, for a pause, ends the processes, after which
``runc delete`` removes the container as before. What differs from runc's dump:

- ``--network-lock skip`` where the sandbox has a network namespace of its own (``network=False``: it holds only
  loopback, made by agentenv, and nothing outside can reach it): nothing can send into it while CRIU works,
  since every process in it is frozen. A sandbox on the host's network keeps CRIU's iptables lock.
- ``--empty-ns net`` there too: the namespace is agentenv's to make (a restore joins the one agentenv made
  for the new sandbox), so nothing of it is saved. With our CRIU build (scripts/criu-patches/0002) that also
  skips its conntrack tables, two netlink dumps of ~9 ms each on this kernel, for a namespace whose processes
  cannot add netfilter rules (no CAP_NET_ADMIN) and so track nothing; an unpatched CRIU ignores the option for a
  namespace it is told is external.
- ``--cgroup-yard /sys/fs/cgroup`` where the host's cgroup v1 hierarchies are all mounted there: CRIU reads the
  sandbox's cgroup settings from them instead of mounting each hierarchy again for every dump (~13 ms).
- no round trip to runc for CRIU's notifications (runc acts on none of them for a checkpoint of ours) and no
  ``criu swrk`` version probe before the dump.

The command lines name the container (the dump's freezer cgroup path, the restore's cgroup root), so recovery
still finds a CRIU that a killed process left working on a sandbox (``recovery._orphans``).

``restore`` does the same for the other half: ``runc restore`` spent ~25-35 ms of a ~90 ms restore around
CRIU (its own start, a ``criu swrk`` version probe, the cgroups, the mount points, its record). The dump keeps
runc's record of the container with the images (``runc-state.json``); a restore makes the new sandbox's cgroups
and limits as runc would (``agentenv.host.cgroups``), runs ``criu restore`` with runc's options (the cgroups given as
the new root, the sandbox's network namespace inherited, the bind mounts mapped; plus ``--cgroup-yard``, which
runc cannot pass), then writes runc's record of the restored container (from the dumped one's, with the new
id, init, cgroups, namespaces and root), so that ``runc state``, ``delete`` and later dumps know it. Where it
cannot do what runc would (images without runc's record, a cgroup v2 host, stdio pipes, hooks, a mount point
missing or behind a symbolic link in the root), or with ``$AGENTENV_DIRECT_RESTORE=0``, ``runc restore`` runs
as before. A restore cut short before runc's record is written leaves processes runc does not know:
``Container.destroy`` ends whatever is in the sandbox's cgroups and removes them.

Tried and dropped, with figures: images written to a tmpfs first (a dump to /dev/shm took longer than to the
home's ext4: memdump+memwrite 114 vs 68 ms for 100 MB), CRIU's log at level 2 instead of 4 (no measurable
difference), ``--manage-cgroups=ignore`` (the restored processes were left outside the sandbox's cgroups).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentenv.config import crash_point, write_private
from agentenv.errors import CheckpointError
from agentenv.host import cgroups
from agentenv.host.hostcalls import proc_start_time, run_program

DUMP_TIMEOUT = 300.0  # seconds, as runc's own limit for a checkpoint (and for a restore)
LOG_LEVEL = 4  # as runc's: level 2 measured no faster on a 100 MB dump, and a full log explains failures
CRIU_RUNDIR = "/run/agentenv-criu"
DIRECT_RESTORE_ENV = "AGENTENV_DIRECT_RESTORE"  # "0": every restore through ``runc restore``, as before
RUNC_STATE = "runc-state.json"  # runc's record of the dumped container, kept with its images
_NS_KEYS = {"NEWNET": ("net", "extRootNetNS"), "NEWPID": ("pid", "extRootPidNS")}  # runc's criuNsToKey


def dump_args(state: dict[str, Any], images: Path, work: Path, leave_running: bool,
              yard: str | None = None) -> list[str]:
    """The ``criu dump`` arguments for the runc container whose ``state.json`` is ``state`` (see the module doc);
    ``yard``: where the host's cgroup hierarchies are mounted, as CRIU's ``--cgroup-yard`` wants them."""
    config = state["config"]
    pid = int(state["init_process_pid"])
    args = ["dump", "--tree", str(pid), "--images-dir", str(images), "--work-dir", str(work),
            "--log-file", "dump.log", f"-v{LOG_LEVEL}", "--root", config["rootfs"], "--manage-cgroups",
            "--tcp-established", "--file-locks"]
    if leave_running:
        args.append("--leave-running")
    paths = state.get("cgroup_paths") or {}
    freezer = paths.get("freezer") or paths.get("")
    if freezer:
        args += ["--freeze-cgroup", freezer]
    if yard:
        args += ["--cgroup-yard", yard]
    own_netns = False
    for ns in config.get("namespaces") or []:
        kind = _NS_KEYS.get(ns.get("type", ""))
        if kind and ns.get("path"):
            args += ["--external", f"{kind[0]}[{os.stat(ns['path']).st_ino}]:{kind[1]}"]
        own_netns = own_netns or ns.get("type") == "NEWNET"
    if own_netns:
        args += ["--network-lock", "skip", "--empty-ns", "net"]
    for m in config.get("mounts") or []:
        if m.get("device") == "bind":
            dest = _in_root(m["destination"])
            args += ["--external", f"mnt[{dest}]:{dest}"]
    for masked in config.get("mask_paths") or []:
        p = f"/proc/{pid}/root{masked}"
        if os.path.exists(p) and not os.path.isdir(p):
            args += ["--external", f"mnt[{masked}]:/dev/null"]
    for dev in config.get("devices") or []:
        if dev.get("path"):
            args += ["--external", f"mnt[{dev['path']}]:{dev['path']}"]
    return args


def _in_root(dest: str) -> str:
    """A mount's destination as CRIU keys it: absolute and normalised (runc resolves it inside the rootfs)."""
    return "/" + os.path.normpath(dest).lstrip("/")


def dump(runc_state: Path, images: Path, work: Path, leave_running: bool, criu: str | None = None) -> None:
    """Dump every process of the runc container whose record is ``runc_state`` (its ``state.json``) into
    ``images``, as ``runc checkpoint`` would; CheckpointError with CRIU's reason if it fails."""
    _run(criu, prepare_dump(runc_state, images, work, leave_running), work / "dump.log")


def prepare_dump(runc_state: Path, images: Path, work: Path, leave_running: bool) -> list[str]:
    """The ``criu dump`` arguments for the container whose record is ``runc_state``, with runc's files written
    beside the images (``descriptors.json``, its record); CheckpointError where runc's record is unreadable."""
    try:
        state = json.loads(runc_state.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"runc has no record of the container to dump ({runc_state}: {e})",
                              fix="the sandbox's processes are gone; close it") from e
    for d in (images, work):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        args = dump_args(state, images, work, leave_running, cgroup_yard())
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise CheckpointError(f"runc's record of the container ({runc_state}) is not in the form runc 1.1 writes: "
                              f"{e!r}", fix="agentenv reads runc 1.1's state.json to dump a sandbox; check "
                                            "'runc --version'") from e
    write_private(images / "descriptors.json", json.dumps(state.get("external_descriptors") or []))
    write_private(images / RUNC_STATE, json.dumps(state))  # what a direct restore makes runc's record from
    return args


def _run(criu: str | None, args: list[str], log: Path, pass_fds: tuple[int, ...] = (),
         env: dict[str, str] | None = None) -> None:
    """Run CRIU (``args[0]``: dump or restore) to the end; CheckpointError with its reason (from ``log``) if it
    fails, takes longer than DUMP_TIMEOUT or is not installed."""
    rundir()
    binary, verb = criu or "criu", args[0]
    try:
        r = run_program([binary, *args], DUMP_TIMEOUT, capture=True, pass_fds=pass_fds, env=env)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"the CRIU {verb} did not finish within {DUMP_TIMEOUT:g} s (killed)",
                              fix="a process of the sandbox may be stuck (stopped, traced, or in "
                                  "uninterruptible sleep); check the sandbox, or close it") from None
    except FileNotFoundError:
        raise CheckpointError(f"CRIU ({binary}) is not installed", fix=fix(criu)) from None
    if r.returncode != 0:
        raise CheckpointError(f"CRIU {verb} failed: {reason(r.stdout, log)}", fix=fix(criu))


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
            args += ["--external", f"mnt[{_in_root(m['destination'])}]:{m['source']}"]
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
                _run(criu, args, work / "restore.log", tuple(fds), {"CRTOOLS_SCRIPT_ACTIONS": "setup-namespaces"})
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


LINK = "link.json"  # a networked sandbox's link (agentenv.host.network) as it was at the dump, kept with its images


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
        dest = _in_root(m["destination"])
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


@functools.cache
def cgroup_yard() -> str | None:
    """``/sys/fs/cgroup`` where every cgroup hierarchy of this host is mounted there under the name CRIU gives
    it ("name=" dropped, "unified" for the v2 one), as on a cgroup v1 host; else None (CRIU mounts its own)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        names = line.split(":", 2)[1] if line.count(":") >= 2 else ""
        name = names.removeprefix("name=") or "unified"
        if not os.path.ismount(cgroups.CGROUP_ROOT / name):
            return None
    return str(cgroups.CGROUP_ROOT) if lines else None


@functools.cache
def rundir() -> None:
    """Mount the small tmpfs where our CRIU build caches its kernel probe (saves ~30 ms a run).

    CRIU keeps the cache only on a tmpfs; a dedicated root-only one, since /run may be a disk.
    Best effort: without it CRIU probes the kernel every time.
    """
    if os.path.ismount(CRIU_RUNDIR):
        return
    with contextlib.suppress(OSError):
        os.makedirs(CRIU_RUNDIR, mode=0o700, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", CRIU_RUNDIR],
                       capture_output=True, check=False)


def dump_stats(images: Path) -> dict[str, int]:
    """CRIU's own account of a dump (``stats-dump``, read with pycriu): frozen time and memory
    figures in microseconds and pages. Empty when pycriu or the file is missing."""
    try:
        from pycriu import images as criu_images

        with open(images / "stats-dump", "rb") as f:
            entry = criu_images.load(f)["entries"][0]["dump"]
    except Exception:  # noqa: BLE001 - statistics are best effort: they never fail a snapshot
        return {}
    return {k: int(v) for k, v in entry.items()}


def fix(criu: str | None) -> str:
    """What to do when CRIU fails: where it is missing, install it; otherwise read its log."""
    binary = criu or "criu"
    if shutil.which(binary) is None:
        return f"CRIU ({binary}) is not installed: run scripts/bootstrap.sh, which installs CRIU >= 4"
    return "run 'criu check' and read the CRIU log named above; filesystem snapshots (memory=False) still work"


def reason(stderr: str, log: Path) -> str:
    """The last line of what CRIU (or runc) said, with the first errors of CRIU's log and where the log is."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else "unknown error"
    if log.exists():
        errors = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln or "rror" in ln]
        if errors:
            text += "; CRIU says: " + " | ".join(e.strip() for e in errors[:3])
        text += f" (log: {log})"
    return text
