"""The sandbox behaviour suite, run twice: against the local API and against a real server on loopback.

``api`` is either the ``agentenv`` module itself or a client from ``agentenv.connect``: both have
``.Sandbox`` and ``.Snapshot`` with the same methods, return types and exceptions.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import agentenv
from agentenv.api import FileInfo, JobEnd, JobInfo, JobOutput
from agentenv.errors import ImageNotFound, SandboxStateError, SnapshotNotFound

from .server_fixtures import TOKEN, threaded_server
from .test_jobs import COUNT, counted, drain, read_until
from .test_snapshots import ask, start_counter

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server_url():
    with threaded_server() as url:
        yield url


@pytest.fixture(params=["local", "remote"])
def api(request):
    if request.param == "local":
        yield agentenv
        return
    client = agentenv.connect(request.getfixturevalue("server_url"), TOKEN)
    yield client
    client.close()


@pytest.fixture
def sb(api):
    with api.Sandbox.create(memory="512m", labels={"suite": "contract"}) as s:
        yield s


def test_exec_code_output_cwd_env(sb):
    r = sb.exec("echo out; echo err >&2; pwd; exit 3")
    assert isinstance(r, agentenv.ExecResult)
    assert (r.exit_code, r.stdout, r.stderr, r.ok, r.timed_out) == (3, "out\n/testbed\n", "err\n", False, False)
    assert sb.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sb.exec("echo $FOO", env={"FOO": "bar"}).stdout == "bar\n"
    t = sb.exec("sleep 30", timeout=0.5)
    assert t.timed_out and not t.ok
    with pytest.raises(ValueError):
        sb.exec("true", timeout=-1)


def test_exec_streams_output(sb):
    seen: list[tuple[str, bytes]] = []
    r = sb.exec("for i in 1 2 3; do echo $i; sleep 0.2; done; echo e >&2", on_output=lambda s, d: seen.append((s, d)))
    assert r.stdout == "1\n2\n3\n" and r.stderr == "e\n"
    out = [d for s, d in seen if s == "stdout"]
    assert len(out) >= 2 and all(isinstance(d, bytes) for d in out)
    assert b"".join(out) == b"1\n2\n3\n"


def test_files_binary_relative_and_missing(sb):
    data = os.urandom(1 << 20)
    sb.write_file("/testbed/blob.bin", data, mode=0o600)
    assert sb.read_file("/testbed/blob.bin") == data
    assert sb.exec("stat -c %a /testbed/blob.bin").stdout.strip() == "600"
    sb.write_file("rel/dir/a.txt", "relative")
    assert sb.read_file("/testbed/rel/dir/a.txt") == b"relative"
    with pytest.raises(FileNotFoundError):
        sb.read_file("/nope/missing")
    with pytest.raises(ValueError):
        sb.read_file("")


def test_spawn_wait_output_kill(sb):
    p = sb.spawn("for i in 1 2; do echo line$i; done; exit 7")
    assert isinstance(p, agentenv.Process)
    assert p.wait(timeout=10) == 7
    assert p.output() == "line1\nline2\n"
    q = sb.spawn("sleep 100")
    assert q.exit_code is None
    q.kill()
    assert q.wait(timeout=10) == 128 + 9
    assert {x.pid for x in sb.processes()} >= {p.pid, q.pid}


def test_jobs_output_stdin_and_signals(sb):
    pid = sb.start("echo hi; echo err >&2; sleep 0.3; echo later", tag="bg", env={"X": "1"}).pid
    cat = sb.start("cat", stdin=True)
    assert isinstance(cat, JobInfo) and cat.stdin and cat.exit_code is None
    listed = {j.pid: j for j in sb.jobs()}
    assert all(isinstance(j, JobInfo) for j in listed.values())
    assert listed[pid].tag == "bg" and listed[pid].env == {"X": "1"} and listed[cat.pid].stdin
    time.sleep(0.6)  # ended meanwhile: its output waited in the sandbox
    out, err, end = drain(sb, pid)
    assert (out, err, end.exit_code, end.timed_out) == (b"hi\nlater\n", b"err\n", 0, False)
    with pytest.raises(ProcessLookupError):  # its end was read: the job is gone
        next(sb.output(pid))
    sb.send_input(cat.pid, b"ping\n")
    got, pos = read_until(sb, cat.pid, (0, 0), 5)
    assert got == b"ping\n" and pos == (5, 0)
    sb.close_input(cat.pid)
    sb.close_input(cat.pid)  # idempotent
    with pytest.raises(BrokenPipeError):
        sb.send_input(cat.pid, b"too late\n")
    assert drain(sb, cat.pid, pos)[2].exit_code == 0
    slow = sb.start("echo now; sleep 300").pid
    read_until(sb, slow, (0, 0), 4)
    now = list(sb.output(slow, follow=False))  # what is there now, and no end: it still runs
    assert all(isinstance(i, JobOutput | None) for i in now)
    assert b"".join(i.data for i in now if i is not None) == b"now\n"
    with pytest.raises(BrokenPipeError):  # started without stdin
        sb.send_input(slow, b"x")
    sb.signal(slow, signal.SIGKILL)
    assert drain(sb, slow)[2].exit_code == 128 + signal.SIGKILL
    assert sb.jobs() == []
    with pytest.raises(ProcessLookupError):
        sb.signal(pid, signal.SIGTERM)
    with pytest.raises(ProcessLookupError):
        sb.send_input(pid, b"x")
    end = drain(sb, sb.start("sleep 30", timeout=0.5).pid)[2]
    assert isinstance(end, JobEnd) and end.timed_out and end.exit_code == 137
    with pytest.raises(ValueError):
        sb.start("true", timeout=-1)


def test_a_terminal_job_types_answers_and_resizes(sb):
    """``start_terminal`` (what ``agentenv shell`` stands on): one stream, "pty", a controlling terminal whose size
    ``resize`` sets; resizing a job without a terminal is refused alike on both sides."""
    term = sb.start_terminal("sh", (24, 80), env={"PS1": "$ "})
    sb.send_input(term.pid, b"stty size; tty\n")
    output, items = sb.output(term.pid), []
    while b"/dev/pts/" not in b"".join(i.data for i in items if isinstance(i, JobOutput)):
        items.append(next(output))
    sb.resize(term.pid, (30, 100))   # once the first answer came: sh waits for the next line
    sb.send_input(term.pid, b"stty size; exit 4\n")
    items += list(output)
    text = b"".join(i.data for i in items if isinstance(i, JobOutput))
    assert {i.stream for i in items if isinstance(i, JobOutput)} == {"pty"}
    assert b"24 80" in text and b"30 100" in text and b"/dev/pts/" in text
    assert isinstance(items[-1], JobEnd) and items[-1].exit_code == 4
    plain = sb.start("sleep 30").pid
    with pytest.raises(ValueError):
        sb.resize(plain, (30, 100))
    sb.signal(plain, signal.SIGKILL)


def test_a_jobs_tail_leaves_its_output_for_output(sb):
    job = sb.start("printf 'abcdef'; exec 1>&-; sleep 600")
    deadline = time.monotonic() + 30
    while sb.tail(job.pid, 3) != [JobOutput("stdout", b"def", 3)]:  # wait on state: the bytes in the agent
        assert time.monotonic() < deadline, "the job's output never showed in its tail"
        time.sleep(0.05)
    got = [o for o in sb.output(job.pid, follow=False) if isinstance(o, JobOutput)]
    assert b"".join(o.data for o in got) == b"abcdef"  # the tail took nothing
    with pytest.raises(ValueError):
        sb.tail(job.pid, 0)
    sb.signal(job.pid, signal.SIGKILL)


def test_job_output_is_read_later_from_offsets_across_pause_resume(api):
    """A reader stops, the sandbox is paused and resumed, a new reader goes on from the offsets reached."""
    with api.Sandbox.create(memory="512m") as s:
        counter = s.start(COUNT).pid
        first, pos = read_until(s, counter, (0, 0), 20)
        s.discard(counter, pos)  # read: never needed again
        s.pause()
        with pytest.raises(SandboxStateError):
            s.start("true")
        s.resume()
        assert [j.pid for j in s.jobs()] == [counter]
        more, pos = read_until(api.Sandbox.get(s.id), counter, pos, 40)  # another handle, as another client
        values = counted(first + more)
        assert values == list(range(1, len(values) + 1))  # no gap, no repeat
        s.signal(counter, signal.SIGTERM)
        assert drain(s, counter, pos)[2].exit_code == 128 + signal.SIGTERM


def test_file_system_calls(sb):
    workdir = sb.exec("pwd").stdout.strip()
    assert sb.make_dir("made/deep") is True and sb.make_dir("made/deep") is False
    sb.write_file("made/deep/f.txt", "hello", mode=0o600)
    sb.exec("ln -s deep made/link && chown 65534:65534 made/deep/f.txt")
    info = sb.stat("made/deep/f.txt")
    assert isinstance(info, FileInfo)
    assert (info.path, info.name, info.type, info.size, info.mode, info.permissions, info.owner) == (
        f"{workdir}/made/deep/f.txt", "f.txt", "file", 5, 0o600, "-rw-------", "nobody")
    assert sb.stat("/").owner == "root"
    assert (sb.stat("made/link").type, sb.stat("made/link").symlink_target) == ("dir", "deep")
    listed = sb.list_dir("made", depth=2)
    assert all(isinstance(e, FileInfo) for e in listed)
    assert [e.path[len(workdir) + 1:] for e in listed] == ["made/deep", "made/deep/f.txt", "made/link"]
    assert [e.name for e in sb.list_dir(f"{workdir}/made")] == ["deep", "link"]
    assert [e.name for e in sb.list_dir("made", depth=10**6)] == ["deep", "f.txt", "link"]  # as deep as they go
    moved = sb.move("made/deep/f.txt", "/dev/shm/moved.txt")  # onto another file system
    assert moved.path == "/dev/shm/moved.txt" and sb.read_file("/dev/shm/moved.txt") == b"hello"
    with pytest.raises(FileNotFoundError):
        sb.stat("made/deep/f.txt")
    sb.remove("made")
    for call, exc in [(lambda: sb.stat("made"), FileNotFoundError), (lambda: sb.remove("made"), FileNotFoundError),
                      (lambda: sb.move("made", "x"), FileNotFoundError),
                      (lambda: sb.make_dir("/dev/shm/moved.txt"), FileExistsError),
                      (lambda: sb.list_dir("/dev/shm/moved.txt"), NotADirectoryError),
                      (lambda: sb.remove("/dev/agentenv"), PermissionError), (lambda: sb.remove("/dev"), PermissionError),
                      (lambda: sb.make_dir("/.agentenv/x"), PermissionError),
                      (lambda: sb.move("/dev", "/elsewhere"), PermissionError),
                      (lambda: sb.stat(""), ValueError), (lambda: sb.list_dir("/", depth=0), ValueError),
                      (lambda: sb.stat("/" + "a" * 300), OSError), (lambda: sb.move("/tmp", "/tmp/in"), OSError)]:
        with pytest.raises(exc):
            call()
    assert sb.exec("true").ok  # the agent's socket is still there


def test_properties_list_get_and_close(api):
    s = api.Sandbox.create(memory="256m", cpus=0.5, labels={"who": "contract"}, ttl=3600)
    assert s.state == "running" and s.image == "agentenv/base" and s.labels == {"who": "contract"}
    assert s.limits == agentenv.sandbox.core.Limits(cpus=0.5, memory=256 << 20, pids=512, disk=10 << 30)
    assert s.expires_at is not None and s.expires_at > s.created_at
    before = s.expires_at
    s.set_ttl(7200)
    assert api.Sandbox.get(s.id).expires_at > before
    assert s.id in [x.id for x in api.Sandbox.list()]
    assert api.Sandbox.get(s.id).exec("echo hi").stdout == "hi\n"
    s.close()
    s.close()  # idempotent
    assert s.state == "closed"
    with pytest.raises(SandboxStateError):
        s.exec("true")
    assert s.id not in [x.id for x in api.Sandbox.list()]


def test_bad_input_is_typed(api):
    with pytest.raises(ImageNotFound):
        api.Sandbox.create("no/such-image:latest")
    with pytest.raises(ValueError):
        api.Sandbox.create(memory="lots")
    with pytest.raises(ValueError):
        api.Sandbox.create(cpus=-1)
    with pytest.raises(LookupError):
        api.Sandbox.get("sb-doesnotexist")
    with pytest.raises(SnapshotNotFound):
        api.Snapshot.get("snap-doesnotexist")


def test_snapshot_restore_and_delete(api, sb):
    sb.write_file("/testbed/keep.txt", "before")
    snap = sb.snapshot(memory=False, labels={"k": "v"})
    assert isinstance(snap, agentenv.SnapshotInfo) and not snap.has_memory and snap.size_bytes > 0
    assert snap.labels["k"] == "v" and snap.sandbox_id == sb.id
    sb.write_file("/testbed/keep.txt", "after")
    try:
        assert snap.id in [s.id for s in api.Snapshot.list()]
        assert api.Snapshot.get(snap.id).id == snap.id
        with api.Sandbox.restore(snap) as r:
            assert r.read_file("/testbed/keep.txt") == b"before"
        with api.Sandbox.restore(snap.id, labels={"from": "id"}) as r:
            assert r.labels == {"from": "id"}
    finally:
        snap.delete()
    assert snap.id not in [s.id for s in api.Snapshot.list()]
    with pytest.raises(SnapshotNotFound):
        snap.delete()


def test_memory_state_forks_then_diverges(api):
    with api.Sandbox.create() as src:
        start_counter(src)
        assert ask(src, 2) == 3
        kids = src.fork(2)
        try:
            assert len({k.id for k in kids} | {src.id}) == 3
            assert [ask(k) for k in kids] == [4, 4]
            assert ask(kids[0], 3) == 7
            assert ask(src) == 4
            with pytest.raises(ValueError):
                src.fork(10_000)
        finally:
            for k in kids:
                k.close()


def test_pause_resume(api):
    with api.Sandbox.create() as s:
        start_counter(s)
        snap = s.pause()
        assert isinstance(snap, agentenv.SnapshotInfo) and snap.has_memory
        assert s.state == "paused"
        with pytest.raises(SandboxStateError):
            s.exec("true")
        s.resume()
        assert s.state == "running"
        assert ask(s) == 2
        with pytest.raises(SandboxStateError):
            s.resume()


def test_gymnasium_envs_run_unchanged_on_either_api(api):
    """The Gymnasium views take ``api=``: the same episode runs on this host or through a server."""
    from gymnasium.utils.env_checker import check_env

    from envs import ShellEnv, ToolEnv

    env = ShellEnv(max_steps=3, api=None if api is agentenv else api)
    try:
        check_env(env, skip_render_check=True)
        env.reset()
        obs, *_ , info = env.step("echo $((6 * 7))")
        assert obs == "42\n" and info["exit_code"] == 0
    finally:
        env.close()
    with ToolEnv(timeout=5.0, api=api) as tool_env:
        tool_env.reset(options={"task": "py-006"})
        obs, *_ = tool_env.step({"name": "python", "arguments": {"code": "print(''.join(sorted('reinforcement')))"}})
        assert tool_env.step({"name": "answer", "arguments": {"answer": obs.strip()}})[1] == 1.0
    assert [s for s in api.Sandbox.list() if s.labels.get("suite") != "contract"] == []
