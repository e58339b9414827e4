"""The host's KSM switch for sandboxes that share memory (``Sandbox.create(share_memory=...)``).

KSM (kernel samepage merging) merges identical pages of the processes that asked for it: a sandbox's keeper
sets ``PR_SET_MEMORY_MERGE`` on itself (every process it starts inherits it; CRIU restores each mapping's
mergeable bit, and a restored keeper sets its flag again), so the children of one memory fork share the pages
they have not written. Host processes do not set it, and sandboxes made without sharing may not (seccomp), so
nothing of theirs is scanned.

Who shares. KSM merges every flagged process of the host alike: a write to a merged page takes longer
(copy-on-write), which tells one flagged sandbox whether another holds the same page (docs/security.md). Linux
has no per-family KSM, so the unit that may share is the *owner*: one agentenv home (its server, its rollouts, its
trainer). The host's merging belongs to one owner at a time (``claim``, ``holder``): a sandbox of another owner
asking for sharing by default (``share_memory=None``, what the envs ask for) gets none, and one asking for it
explicitly (True) is refused. Where the host cannot merge (``unsupported``), the default falls back to no sharing
and True is refused (``choose``, ``decide``).

What it costs. ksmd runs only while a process of the host has mergeable memory (``sync``, host-wide, whatever
agentenv home or process made the sandboxes): ``switch(True)`` saves the settings it finds and applies throttled
ones, ``switch(False)`` puts back what it found (``run=0`` on a host that had KSM off). Its scan rate follows the
mergeable memory present (``pages_for``): a full pass every ``SCAN_S`` seconds, so one sandbox alone costs little
and a forked group is scanned at up to ~1 GB/s; ``sync`` re-tunes it whenever a sharing sandbox starts, pauses or
closes (a fork's children start). ``Stats.ksmd_cpu_s`` is what a run reports.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import paths, write_json
from agentenv.errors import MemorySharingUnsupported
from agentenv.host.hostcalls import proc_start_time

KSM = Path("/sys/kernel/mm/ksm")
PR_SET_MEMORY_MERGE, PR_GET_MEMORY_MERGE = 67, 68
STATE = Path(os.environ.get("AGENTENV_KSM_STATE", "/run/agentenv-ksm"))  # host-wide: .lock, .json (found
# settings), .owner (the last claim: the owner's home, when and by which process it last started a sharing one)
MERGE_ENV = "AGENTENV_SHARE_MEMORY"  # in the keeper's environment: set the flag on itself (the keeper pops it)
# While on: up to PAGES per SLEEP_MS wake (~1 GB/s; ksmd then takes at most one CPU, less once smart_scan skips
# pages that never merge), scaled down to a full pass of the mergeable memory every SCAN_S seconds (``pages_for``),
# at least MIN_PAGES. Not the kernel's scan-time advisor: it re-tunes only at the end of a full scan and refuses
# pages_to_scan meanwhile, so after a scan of little memory it wakes for a handful of pages and a fork family
# arriving then waited minutes to merge (measured: 18 pages per wake, nothing merged in 45 s).
PAGES = os.environ.get("AGENTENV_KSM_PAGES", "5000")
SLEEP_MS = os.environ.get("AGENTENV_KSM_SLEEP_MS", "20")
SCAN_S = float(os.environ.get("AGENTENV_KSM_SCAN_S", "5"))
MIN_PAGES = 100
TUNED = {"advisor_mode": "none", "pages_to_scan": PAGES, "sleep_millisecs": SLEEP_MS}
# A claim holds the host's merging for its owner while any process of the host has mergeable memory, and for
# CLAIM_HOLD_S after the owner's process last started a sharing sandbox while that process lives, though nothing
# is flagged yet (a start in flight: the claim is made once admitted, before the layer and the runtime, and the
# keeper flags itself as it starts).
CLAIM_HOLD_S = 60.0


@dataclass(frozen=True)
class Stats:
    """What KSM does now: whether it runs, pages shared (deduplicated) and the references that share them,
    full scans so far, and ksmd's CPU seconds since boot (None where ksmd is not found)."""

    run: bool
    pages_shared: int
    pages_sharing: int
    full_scans: int
    ksmd_cpu_s: float | None

    @property
    def saved_bytes(self) -> int:
        """Memory KSM saves now: each sharing reference is a page not held twice."""
        return self.pages_sharing * os.sysconf("SC_PAGE_SIZE")


def _read(name: str) -> str:
    return (KSM / name).read_text().strip()


def _write(name: str, value: str) -> None:
    (KSM / name).write_text(value)


def unsupported() -> MemorySharingUnsupported | None:
    """Why this host cannot merge a sandbox's pages, or None where it can: KSM present, writable by this process,
    a kernel with PR_SET_MEMORY_MERGE (6.4) and /proc/<pid>/ksm_stat (6.7), which the host reads to check the
    flag took."""
    if not (KSM / "run").is_file():
        return MemorySharingUnsupported("this kernel has no KSM (/sys/kernel/mm/ksm is missing)",
                                        fix="build the kernel with CONFIG_KSM=y, or create the sandbox without "
                                            "share_memory")
    if not os.access(KSM / "run", os.W_OK):
        return MemorySharingUnsupported("this process may not switch KSM on (/sys/kernel/mm/ksm/run is not "
                                        "writable)", fix="run agentenv as root, or create the sandbox without "
                                                         "share_memory")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0) < 0:
        return MemorySharingUnsupported(f"this kernel lacks PR_SET_MEMORY_MERGE ({os.strerror(ctypes.get_errno())})",
                                        fix="use kernel 6.4 or later, or create the sandbox without share_memory")
    if not Path("/proc/self/ksm_stat").is_file():
        return MemorySharingUnsupported("this kernel has no /proc/<pid>/ksm_stat, which tells whether a sandbox's "
                                        "memory became mergeable", fix="use kernel 6.7 or later, or create the "
                                                                       "sandbox without share_memory")
    return None


def require() -> None:
    """Raise MemorySharingUnsupported unless this host can merge a sandbox's pages (``unsupported``)."""
    if (why := unsupported()) is not None:
        raise why


def owner() -> str:
    """This process's owner of sharing sandboxes: its agentenv home (one server, one user's runs)."""
    return str(paths().home.resolve())


def decide(asked: bool | None, me: str, why_not: MemorySharingUnsupported | None, holder_now: str | None) -> bool:
    """Whether a new sandbox of owner ``me`` shares memory. ``asked``: False (never), True (must:
    MemorySharingUnsupported where it cannot) or None (where it can: the default of the envs). It cannot where the
    host cannot merge (``why_not``) or where another owner's sandboxes merge now (``holder_now``)."""
    if asked is False:
        return False
    if why_not is not None:
        if asked:
            raise why_not
        return False
    if holder_now is not None and holder_now != me:
        if asked:
            raise MemorySharingUnsupported(f"the sandboxes of another agentenv home ({holder_now}) share this host's "
                                           "memory now, and KSM would merge across both", fix="create the sandbox "
                                           "without share_memory, or once that home's sharing sandboxes are closed")
        return False
    return True


def choose(asked: bool | None) -> bool:
    """``share_memory`` of a sandbox this process creates now (``decide`` with this host's facts)."""
    if asked is False:
        return False
    why_not = unsupported()
    return decide(asked, owner(), why_not, None if why_not else holder())


def _ksm_stat(pid: int | str) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/ksm_stat").read_text()
    except OSError:  # gone, or a kernel before 6.7
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def merge_any(pid: int) -> bool:
    """True if process ``pid`` has every page of its own mergeable (PR_SET_MEMORY_MERGE), read from its
    ``/proc/<pid>/ksm_stat`` (kernel 6.7+)."""
    return _ksm_stat(pid).get("ksm_merge_any") == "yes"


def check_flag(sandbox_id: str, pid: int) -> None:
    """MemorySharingUnsupported unless the keeper ``pid`` of a sharing sandbox has its pages mergeable (an image's
    python3 without ctypes cannot set the flag): sharing is never promised and then silently missing. A create that
    asked for the default (None) starts again without sharing (``agentenv.sandbox.core``)."""
    if not merge_any(pid):
        raise MemorySharingUnsupported(f"the keeper of sandbox {sandbox_id} could not mark its memory mergeable "
                                       "(PR_SET_MEMORY_MERGE)", fix="use an image whose python3 has ctypes, or "
                                                                    "create the sandbox without share_memory")


def mergeable_bytes() -> int:
    """The memory of the host's processes that KSM may merge: the private writable memory (VmData) of those with
    the flag or a mapping madvise'd MADV_MERGEABLE (each counted whole, at least a page), bytes; 0 when none has
    any. VmData, not what is resident: a memory fork's children hold their parent's memory from their start, while
    a lazy restore brings its pages in over the next seconds, and ksmd should scan at the rate they will need."""
    total = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _ksm_stat(entry.name)
            if st.get("ksm_merge_any") == "yes" or st.get("ksm_mergeable") == "yes":
                total += max(_vm_data(entry.name), os.sysconf("SC_PAGE_SIZE"))
    return total


def _vm_data(pid: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def wanted() -> bool:
    """True if a process of the host has mergeable memory (the flag, or a mapping madvise'd MADV_MERGEABLE)."""
    return mergeable_bytes() > 0


def pages_for(mergeable: int) -> int:
    """ksmd's pages per wake for ``mergeable`` bytes: a full pass every SCAN_S seconds, MIN_PAGES..PAGES."""
    wakes = SCAN_S * 1000 / int(SLEEP_MS)
    return max(MIN_PAGES, min(int(PAGES), round(mergeable / os.sysconf("SC_PAGE_SIZE") / wakes)))


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The host-wide lock every process takes to switch KSM or change its owner."""
    STATE.parent.mkdir(parents=True, exist_ok=True)
    with open(STATE.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def sync() -> bool:
    """KSM on while a process of the host wants it (``wanted``), at the rate its mergeable memory calls for
    (``pages_for``; a host that ran KSM itself keeps its own), back to what was found once none does; called after
    a sharing sandbox starts, pauses or closes. True if it runs for sandboxes now."""
    with _locked():
        amount = mergeable_bytes()
        saved = STATE.with_suffix(".json")
        switch(amount > 0, saved)
        if amount and json.loads(saved.read_text()).get("run") != "1" and (KSM / "pages_to_scan").is_file():
            _write("pages_to_scan", str(pages_for(amount)))
        return amount > 0


def holder() -> str | None:
    """The owner whose sandboxes may merge on this host now: the last claim's, while a process of the host has
    mergeable memory, or while the claim is younger than CLAIM_HOLD_S and its process lives; None where the host's
    merging is free."""
    try:
        claimed = json.loads(STATE.with_suffix(".owner").read_text())
        who, at, pid, started = str(claimed["owner"]), float(claimed["at"]), int(claimed["pid"]), int(claimed["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return who if (time.time() - at < CLAIM_HOLD_S and _alive(pid, started)) or wanted() else None


def _alive(pid: int, started: int) -> bool:
    try:
        return proc_start_time(pid) == started
    except (ProcessLookupError, ValueError):
        return False


def claim() -> None:
    """Before a sharing sandbox of this process's owner starts (a create, restore or fork): the host's merging is
    this owner's from now (MemorySharingUnsupported while another owner's sandboxes merge, ``decide``)."""
    me = owner()
    with _locked():
        decide(True, me, None, holder())
        write_json(STATE.with_suffix(".owner"), {"owner": me, "at": time.time(), "pid": os.getpid(),
                                                  "start": proc_start_time(os.getpid())})


def merging_pages(pid: int) -> int:
    """Pages of process ``pid`` that KSM has merged now (0 for a gone process)."""
    try:
        return int(Path(f"/proc/{pid}/ksm_merging_pages").read_text())
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return 0


def ksmd_pid() -> int | None:
    """The pid of the ksmd kernel thread, or None."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if Path(entry.path, "comm").read_text().strip() == "ksmd":
                    return int(entry.name)
    return None


def ksmd_cpu_seconds(pid: int | None = None) -> float | None:
    """ksmd's CPU time (user + system) since boot, in seconds, from /proc/<pid>/stat; None where not found."""
    pid = pid or ksmd_pid()
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def stats() -> Stats:
    """KSM's counters now."""
    return Stats(run=_read("run") == "1", pages_shared=int(_read("pages_shared")),
                 pages_sharing=int(_read("pages_sharing")), full_scans=int(_read("full_scans")),
                 ksmd_cpu_s=ksmd_cpu_seconds())


def settings(names: list[str]) -> dict[str, str]:
    """KSM's settings ``names`` as they are now (a choice file's chosen value)."""
    out = {}
    for name in names:
        value = _read(name)
        if "[" in value:  # a choice file ("[none] scan-time"): the chosen one
            value = value[value.index("[") + 1:value.index("]")]
        out[name] = value
    return out


def switch(on: bool, saved: Path) -> None:
    """KSM on (throttled; the settings found are kept in ``saved``) or back to what was found (off: run=0
    on a host that had it off). Idempotent; the caller serialises calls (a lock shared by every process)."""
    if on:
        if saved.exists():
            return
        tuned = {k: v for k, v in TUNED.items() if (KSM / k).is_file()}  # no advisor before kernel 6.7
        found = settings(["run", *tuned])  # in the order they go back: the advisor's mode first
        write_json(saved, found)
        if found["run"] == "1":  # the host runs KSM itself: leave its settings alone
            return
        for name, value in tuned.items():
            _write(name, value)
        _write("run", "1")
        return
    if not saved.exists():
        return
    found = json.loads(saved.read_text())
    if found.get("run") != "1":
        _write("run", "0")  # 0, not 2: merged pages stay merged until their owners exit or write them
        for name, value in found.items():
            if name != "run":
                with contextlib.suppress(OSError):
                    _write(name, value)
    saved.unlink()
