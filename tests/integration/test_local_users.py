"""Local users of the host against what agentenv keeps on disk (issue 40, findings 3 and 4).

Attacker model B: a user of the host without the server's token, here ``nobody`` (a real separate uid, its groups
cleared), who knows the home's layout and a sandbox's id. Every kind of file agentenv keeps under its home is
tried: a sandbox's record (an env secret given at create), its files through the host path of its root and of its
layer on the volume, the volume's image, a snapshot's record, CRIU's images and log, its files, runc's record of a
restored sandbox, and the server's token file. Then the setuid bridge: a setuid file a sandbox's root leaves in its
own root, run from the host's path, must give no host user the sandbox's uids.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import agentenv
from agentenv.config import paths
from agentenv.snapshot.store import Snapshot

pytestmark = pytest.mark.integration

SECRET = "issue40-env-secret-7f3a"
OPEN, PRIV = "open to all in the sandbox", "for the sandbox root alone"
SETUP = (f"mkdir -p /srv && printf %s '{OPEN}' >/srv/open.txt && chmod 644 /srv/open.txt"
         f" && printf %s '{PRIV}' >/srv/priv.txt && chmod 600 /srv/priv.txt"
         " && cp /bin/cat /tmp/suidcat && chmod 4755 /tmp/suidcat")


@dataclass
class Family:
    sb: agentenv.Sandbox  # made from the image, its env holding SECRET
    snap: Snapshot  # a memory snapshot of it
    kid: agentenv.Sandbox  # restored from the snapshot (runc's record of it is agentenv's writing)


@pytest.fixture(scope="module")
def family() -> Iterator[Family]:
    sb = agentenv.Sandbox.create(env={"AE_SECRET": SECRET}, ttl=None)  # the module's: closed at its teardown, no deadline
    try:
        r = sb.exec(SETUP)
        assert r.exit_code == 0, r.stderr
        snap = sb.snapshot(memory=True)
        try:
            kid = agentenv.Sandbox.restore(snap, ttl=None)
            try:
                yield Family(sb, snap, kid)
            finally:
                kid.close()
        finally:
            snap.delete()
    finally:
        sb.close()


def as_nobody(cmd: list[str], group: str | int = "nogroup") -> subprocess.CompletedProcess[str]:
    """``cmd`` as the host's ``nobody``, in ``group`` alone (exit status 126 where it cannot reach the program)."""
    try:
        return subprocess.run(cmd, user="nobody", group=group, extra_groups=[], capture_output=True, text=True,
                              errors="replace", timeout=30, check=False)
    except PermissionError as e:
        return subprocess.CompletedProcess(cmd, 126, "", str(e))


def read_as_nobody(path: Path) -> subprocess.CompletedProcess[str]:
    return as_nobody(["head", "-c", "64", str(path)])


def _record(f: Family) -> Path:
    return f.sb.lifecycle.container.bundle / "sandbox.json"


def _meta(f: Family) -> Path:
    return f.snap.path / "meta.json"


def _runc_record(f: Family) -> Path:
    return f.snap.criu_dir / "runc-state.json"


def _restored_runc_record(f: Family) -> Path:
    return paths().runc_root / f.kid.lifecycle.container.cid / "state.json"


SECRET_FILES: dict[str, Callable[[Family], Path]] = {
    "the sandbox's record": _record,
    "the snapshot's record": _meta,
}
FILES: dict[str, Callable[[Family], Path]] = {
    **SECRET_FILES,
    "runc's record kept with CRIU's images": _runc_record,
    "runc's record of a restored sandbox": _restored_runc_record,
    "a file through the sandbox's root": lambda f: f.sb.lifecycle.container.rootfs / "srv" / "open.txt",
    "a file through the sandbox's layer on the volume": lambda f: f.sb.lifecycle.container.upper / "srv" / "open.txt",
    "the volume's image": lambda f: paths().volume_image,
    "a snapshot's memory image": lambda f: next(f.snap.criu_dir.glob("pages-*.img")),
    "a snapshot's file on the volume": lambda f: f.snap.fs_dir / "srv" / "open.txt",
    "a restored sandbox's file through its root": lambda f: f.kid.lifecycle.container.rootfs / "srv" / "open.txt",
}
# refused already before issue 40: CRIU writes its logs 0600, and the token file is made 0600
HELD = {
    "CRIU's dump log": lambda f: f.snap.criu_dir / "dump.log",
    "CRIU's restore log": lambda f: f.kid.lifecycle.container.bundle / "criu-restore" / "restore.log",
}


@pytest.mark.parametrize("kind", list(SECRET_FILES))
def test_the_files_named_hold_the_secret(family: Family, kind: str) -> None:
    """What the attack below is after: each of these holds the env secret given at create (read as root)."""
    assert SECRET in SECRET_FILES[kind](family).read_text()


@pytest.mark.parametrize("kind", list(FILES))
def test_nobody_reads_nothing_agentenv_keeps(family: Family, kind: str) -> None:
    path = FILES[kind](family)
    assert path.exists(), path  # as root: the path is right
    r = read_as_nobody(path)
    assert r.returncode != 0 and r.stdout == "", f"nobody read {kind} ({path}): {r.stdout[:64]!r}"


@pytest.mark.parametrize("kind", list(HELD))
def test_nobody_reads_no_log(family: Family, kind: str) -> None:
    path = HELD[kind](family)
    assert path.exists(), path
    r = read_as_nobody(path)
    assert r.returncode != 0 and r.stdout == "", f"nobody read {kind} ({path})"


def test_nobody_reads_the_token_file_the_server_makes() -> None:
    from agentenv.server.app import load_token

    folder = Path(tempfile.mkdtemp(dir="/var/tmp"))  # pytest's own tmp folders are closed to others already
    try:
        folder.chmod(0o755)  # a folder anyone may read: the file's own mode must keep them out
        token = load_token(folder / "env.token")
        r = read_as_nobody(folder / "env.token")
        assert r.returncode != 0 and token not in r.stdout
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("folder", ["sandboxes", "snapshots", "volume", "runc"])
def test_nobody_lists_no_folder_of_the_home(family: Family, folder: str) -> None:
    r = as_nobody(["ls", str(paths().home / folder)])
    assert r.returncode != 0 and r.stdout == "", r.stdout


# --- the setuid bridge --------------------------------------------------------------------------------------------

def _bridge(root: Path, group: str | int = "nogroup") -> subprocess.CompletedProcess[str]:
    """Run the sandbox's setuid copy of cat (its root's: the range's base uid on the host) from the host's path
    ``root``, on the sandbox's 0600 file."""
    return as_nobody([str(root / "tmp" / "suidcat"), str(root / "srv" / "priv.txt")], group)


@pytest.mark.parametrize("where", ["root", "layer"])
def test_a_setuid_file_left_in_a_sandbox_gives_nobody_nothing(family: Family, where: str) -> None:
    """The file is setuid and its owner's (the sandbox's root, the range's base uid, as the sandbox sees it); as
    nobody, its host path is not even reachable, and the 0600 file stays unread."""
    st = os.stat(family.sb.lifecycle.container.upper / "tmp" / "suidcat")
    assert st.st_mode & 0o4000 and st.st_uid == family.sb.container_spec().uids
    root = family.sb.lifecycle.container.rootfs if where == "root" else family.sb.lifecycle.container.upper
    r = _bridge(root)
    assert PRIV not in r.stdout and r.returncode != 0
    r = as_nobody(["test", "-e", str(root / "tmp" / "suidcat")])
    assert r.returncode != 0, "nobody reaches the sandbox's files by their host path"


def test_setuid_files_do_nothing_on_the_host_even_for_a_user_who_passes(family: Family) -> None:
    """A host user in the range's group passes the folders that keep everyone else out; the setuid bit still gives
    it nothing there (nosuid): the 0600 file is refused to it."""
    uids = family.sb.container_spec().uids
    assert uids is not None
    r = _bridge(family.sb.lifecycle.container.rootfs, group=uids)
    assert PRIV not in r.stdout and "Permission denied" in r.stderr, (r.stdout, r.stderr)


@pytest.mark.parametrize("where", ["the sandbox's root", "a restored sandbox's root", "the volume"])
def test_sandbox_filesystems_are_mounted_nosuid_nodev(family: Family, where: str) -> None:
    mount = {"the sandbox's root": family.sb.lifecycle.container.rootfs, "a restored sandbox's root": family.kid.lifecycle.container.rootfs,
             "the volume": paths().volume}[where]
    flags = os.statvfs(mount).f_flag
    assert flags & os.ST_NOSUID and flags & os.ST_NODEV, f"{mount} is mounted without nosuid,nodev ({flags:#x})"


def test_a_sandbox_cannot_make_a_device_node(family: Family) -> None:
    """Why nodev is defence in depth: a sandbox's root has no CAP_MKNOD over the host (a user namespace), so it
    makes no device node itself; one could come only from an image's layer or an imported snapshot."""
    r = family.sb.exec("mknod /tmp/null c 1 3")
    assert r.exit_code != 0 and "Operation not permitted" in r.stderr
    assert not (family.sb.lifecycle.container.upper / "tmp" / "null").exists()


# --- the whole home, and a home an older agentenv made ------------------------------------------------------------

PASSABLE = ("sandboxes", "snapshots", "agents")  # 0711: every entry of the first two is a gate; agents/ holds the agent


def open_to_others(home: Path) -> list[str]:
    """What under ``home`` another host user reaches by its modes alone: a file it may read, a folder it may pass
    (and each of the home's folders it may pass is walked on)."""
    found = []

    def walk(folder: Path) -> None:
        for entry in os.scandir(folder):
            st = entry.stat(follow_symlinks=False)
            name = os.path.relpath(entry.path, home)
            if entry.is_dir(follow_symlinks=False):
                if st.st_mode & 0o001:
                    found.append(name + "/")
                    walk(Path(entry.path))
            elif st.st_mode & 0o004:
                found.append(name)

    if home.stat().st_mode & 0o001:
        walk(home)
    return found


def test_nothing_under_the_home_is_open_to_other_users(family: Family) -> None:
    """Whatever this session has made so far (a sandbox, a snapshot, a restore, and every other test's in a
    whole run): another user passes the three folders that lead to gates, reads the agent's file, and nothing else."""
    for sb in (family.sb, family.kid):  # the gates: root's, the family's range's group
        st = sb.lifecycle.container.bundle.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, family.sb.container_spec().uids, 0o710)
    assert [e for e in open_to_others(paths().home) if not _passable(e)] == []


def _passable(entry: str) -> bool:
    return entry.rstrip("/") in PASSABLE or entry.startswith("agents/agent-")


def _age(home: Path, sb: agentenv.Sandbox, snap: Snapshot) -> None:
    """Give ``home`` the modes the code before issue 40 left on a home it made (read from one): folders 0755 and
    root's, records 0644, the volume's image 0644."""
    for d in (home / "sandboxes", home / "snapshots", home / "runc", home / "tmp", home / "volume",
              sb.lifecycle.container.bundle, snap.path):
        os.chown(d, 0, 0)
        d.chmod(0o755)
    for f in (sb.lifecycle.container.bundle / "sandbox.json", snap.path / "meta.json", snap.criu_dir / "runc-state.json",
              home / "volume.img"):
        f.chmod(0o644)


def test_a_home_an_older_agentenv_made_is_closed_on_first_use_and_its_sandboxes_go_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A home of its own (no volume: a plain image file stands for one), aged to the old modes with a sandbox
    running and a memory snapshot in it. The first process to use it closes it; the sandbox runs on, its snapshot
    restores (CRIU reads its images through the gate), and nobody reads either's record or files."""
    import sys

    from .conftest import cleanup, leaked

    home = Path(tempfile.mkdtemp(prefix="agentenv-old-", dir="/var/tmp"))
    monkeypatch.setenv("AGENTENV_HOME", str(home))
    monkeypatch.setenv("AGENTENV_VOLUME", "off")
    try:
        (home / "volume.img").write_bytes(b"\0" * 4096)
        with agentenv.Sandbox.create(env={"AE_SECRET": SECRET}, disk=None) as sb:
            assert sb.exec("printf open >/srv/open.txt").exit_code == 0
            snap = sb.snapshot(memory=True)
            try:
                _age(home, sb, snap)
                assert read_as_nobody(sb.lifecycle.container.bundle / "sandbox.json").returncode == 0  # open, as it was
                first = subprocess.run([sys.executable, "-c", "import agentenv; agentenv.Sandbox.list()"],
                                       capture_output=True, text=True, timeout=120, check=False)
                assert first.returncode == 0, first.stderr
                assert [e for e in open_to_others(home) if not _passable(e)] == []
                for path in (sb.lifecycle.container.bundle / "sandbox.json", snap.path / "meta.json",
                             sb.lifecycle.container.rootfs / "srv" / "open.txt", home / "volume.img"):
                    r = read_as_nobody(path)
                    assert r.returncode != 0 and r.stdout == "", path
                assert sb.exec("cat /srv/open.txt").stdout == "open"
                with agentenv.Sandbox.restore(snap) as kid:
                    assert kid.exec("cat /srv/open.txt; echo $AE_SECRET").stdout == f"open{SECRET}\n"
            finally:
                snap.delete()
        assert not leaked(home)
    finally:
        cleanup(home)
