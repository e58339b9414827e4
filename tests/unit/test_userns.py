"""The uid ranges of fork families (agentenv.host.userns): leases by hard link, no infrastructure needed."""

from __future__ import annotations

import pytest

from agentenv.errors import SandboxError
from agentenv.host import userns


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    for d in ("sandboxes", "snapshots"):
        (h / d).mkdir(parents=True)
    monkeypatch.setenv("AGENTENV_HOME", str(h))
    monkeypatch.setattr(userns, "_passable", lambda home: None)  # pytest's tmp folders are 0700
    return h


def _holder(home, name):
    d = home / "sandboxes" / name
    d.mkdir()
    return d


def test_allocation_never_hands_out_a_held_range(home, monkeypatch):
    """Two holders in a row get different ranges; a range comes back once its holders are gone."""
    monkeypatch.setattr(userns.random, "randrange", lambda n: 7)
    a, b = _holder(home, "a"), _holder(home, "b")
    first, second = userns.allocate(a), userns.allocate(b)
    assert (first, second) == (userns.base_of(7), userns.base_of(8))
    snap = _holder(home, "snap")
    userns.hold(first, snap)  # a snapshot of a's family holds it too
    (a / userns.LEASE).unlink()
    assert userns.allocate(_holder(home, "c")) == userns.base_of(9)
    (snap / userns.LEASE).unlink()
    assert userns.allocate(_holder(home, "d")) == first


def test_ranges_are_disjoint_unprivileged_and_below_the_invalid_uid():
    assert userns.base_of(0) == userns.FIRST > 65535
    last = userns.base_of(userns.COUNT - 1) + userns.SIZE - 1
    assert last < (1 << 32) - 1
    assert userns.index_of(userns.base_of(123)) == 123
    for bad in (0, userns.FIRST + 1, userns.base_of(userns.COUNT)):
        with pytest.raises(SandboxError):
            userns.index_of(bad)
    assert userns.mapping(userns.FIRST) == [{"containerID": 0, "hostID": userns.FIRST, "size": userns.SIZE}]


def test_a_home_others_cannot_pass_through_is_opened_or_refused(tmp_path, monkeypatch):
    """The sandbox's root must reach its gate: the layout lets others pass the home's folders (never list them),
    and a closed parent is a clear error."""
    closed = tmp_path / "closed"
    home = closed / "home"
    (home / "sandboxes").mkdir(parents=True)
    home.chmod(0o700)
    closed.chmod(0o755)
    tmp_path.chmod(0o755)
    monkeypatch.setenv("AGENTENV_HOME", str(home))
    userns._passable.cache_clear()
    try:
        userns.allocate(_holder(home, "a"))  # tmp_path's own parents may be closed: only those above are checked
    except SandboxError as e:
        assert e.fix is not None and "chmod o+x" in e.fix
    for d in (home, home / "sandboxes", home / "snapshots"):
        assert d.stat().st_mode & 0o777 == 0o711
    closed.chmod(0o700)
    userns._passable.cache_clear()
    with pytest.raises(SandboxError, match="does not let other users through"):
        userns.allocate(_holder(home, "b"))


def _allocate_many(home_dir: str, tag: str, n: int, out) -> None:
    """In a child process: ``n`` holders allocated one after another, their indexes sent back."""
    import os

    os.environ["AGENTENV_HOME"] = home_dir
    userns._passable = lambda home: None  # pytest's tmp folders are 0700
    userns.random.randrange = lambda n: 0  # every process starts at the same lease: the worst case for the lock
    got = []
    for i in range(n):
        d = os.path.join(home_dir, "sandboxes", f"{tag}-{i}")
        os.mkdir(d)
        got.append(userns.index_of(userns.allocate(userns.Path(d))))
    out.put((tag, got))


def test_processes_allocating_at_once_never_share_a_range(home):
    """Four processes taking ranges at once past the low ones (each lease looked at unlocked first, then taken
    under its flock): every range handed out is handed out once, and each holder holds what it was given."""
    import multiprocessing

    n = userns.LOW // 2 + 40  # together they fill the low ranges and go past them
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allocate_many, args=(str(home), f"p{k}", n, out)) for k in range(4)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    every = [i for g in got.values() for i in g]
    assert len(every) == 4 * n and len(set(every)) == len(every)
    assert set(range(userns.LOW)) <= set(every)  # the low ones first, and all of them before any past LOW
    assert max(every) == 4 * n - 1
    for tag, g in got.items():
        for i, index in enumerate(g):
            assert (home / "sandboxes" / f"{tag}-{i}" / userns.LEASE).samefile(home / "uids" / str(index))
