"""CRIU run directly rather than through runc: the dumps of memory snapshots, and running CRIU (dumps and restores).

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

The restore, run the same way, is ``agentenv.snapshot.restore``; both run CRIU with ``run`` (its log, its limits, its
reason when it fails) after ``rundir``.

Tried and dropped, with figures: images written to a tmpfs first (a dump to /dev/shm took longer than to the
home's ext4: memdump+memwrite 114 vs 68 ms for 100 MB), CRIU's log at level 2 instead of 4 (no measurable
difference), ``--manage-cgroups=ignore`` (the restored processes were left outside the sandbox's cgroups).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from agentenv.config import write_private
from agentenv.errors import CheckpointError
from agentenv.host import cgroups
from agentenv.host.hostcalls import run_program

DUMP_TIMEOUT = 300.0  # seconds, as runc's own limit for a checkpoint (and for a restore)
LOG_LEVEL = 4  # as runc's: level 2 measured no faster on a 100 MB dump, and a full log explains failures
CRIU_RUNDIR = "/run/agentenv-criu"
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
            dest = in_root(m["destination"])
            args += ["--external", f"mnt[{dest}]:{dest}"]
    for masked in config.get("mask_paths") or []:
        p = f"/proc/{pid}/root{masked}"
        if os.path.exists(p) and not os.path.isdir(p):
            args += ["--external", f"mnt[{masked}]:/dev/null"]
    for dev in config.get("devices") or []:
        if dev.get("path"):
            args += ["--external", f"mnt[{dev['path']}]:{dev['path']}"]
    return args


def in_root(dest: str) -> str:
    """A mount's destination as CRIU keys it: absolute and normalised (runc resolves it inside the rootfs)."""
    return "/" + os.path.normpath(dest).lstrip("/")


def dump(runc_state: Path, images: Path, work: Path, leave_running: bool, criu: str | None = None) -> None:
    """Dump every process of the runc container whose record is ``runc_state`` (its ``state.json``) into
    ``images``, as ``runc checkpoint`` would; CheckpointError with CRIU's reason if it fails."""
    run(criu, prepare_dump(runc_state, images, work, leave_running), work / "dump.log")


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


def run(criu: str | None, args: list[str], log: Path, pass_fds: tuple[int, ...] = (),
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
