"""The sandbox behaviour suite, run twice: against the local API and against a real server on loopback.

``api`` is either the ``agentenv`` module itself or a client from ``agentenv.connect``: both have
``.Sandbox`` and ``.Snapshot`` with the same methods, return types and exceptions.
"""

from __future__ import annotations

import os

import pytest

import agentenv
from agentenv.errors import ImageNotFound, SandboxStateError, SnapshotNotFound

from .server_fixtures import TOKEN, threaded_server
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


def test_properties_list_get_and_close(api):
    s = api.Sandbox.create(memory="256m", cpus=0.5, labels={"who": "contract"}, ttl=3600)
    assert s.state == "running" and s.image == "agentenv/base" and s.labels == {"who": "contract"}
    assert s.limits == agentenv.sandbox.Limits(cpus=0.5, memory=256 << 20, pids=512, disk=10 << 30)
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
