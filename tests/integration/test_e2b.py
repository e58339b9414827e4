"""The official E2B SDKs (``e2b``, ``e2b-code-interpreter`` from PyPI), unchanged, against a real ``agentenv serve``
on loopback: pointed at it by E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY, as a user would."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")
code_interpreter = pytest.importorskip("e2b_code_interpreter")

from e2b import AsyncSandbox, CommandExitException, FileType, NotFoundException, Sandbox, TimeoutException  # noqa: E402
from e2b.exceptions import AuthenticationException, FileNotFoundException  # noqa: E402
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType  # noqa: E402

from .server_fixtures import wait_for  # noqa: E402


def test_commands_in_the_foreground(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("echo out; echo err >&2; echo $FOO", envs={"FOO": "bar"})
    assert (r.stdout, r.stderr, r.exit_code) == ("out\nbar\n", "err\n", 0)
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo partial; exit 3")
    assert e.value.exit_code == 3 and e.value.stdout == "partial\n"
    seen: list[str] = []
    sandbox.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n"


def test_background_commands_list_kill_stdin_and_reconnect(sandbox: Sandbox) -> None:
    sleeper = sandbox.commands.run("sleep 60", background=True)
    listed = {p.pid: p for p in sandbox.commands.list()}
    assert sleeper.pid in listed and "sleep 60" in " ".join([listed[sleeper.pid].cmd, *listed[sleeper.pid].args])
    assert sandbox.commands.kill(sleeper.pid) is True
    wait_for(lambda: sleeper.pid not in {p.pid for p in sandbox.commands.list()}, "the killed command leaves the list")
    assert sandbox.commands.kill(sleeper.pid) is False  # gone: not found

    cat = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(cat.pid, "hello\n")
    cat.send_stdin(b"bytes too\n")
    cat.close_stdin()
    assert cat.wait().stdout == "hello\nbytes too\n"

    counter = sandbox.commands.run("for i in 1 2 3 4 5; do echo $i; sleep 0.2; done", background=True)
    counter.disconnect()  # the command goes on without a reader; its output waits in the sandbox
    again = sandbox.commands.connect(counter.pid)
    assert again.wait().stdout == "1\n2\n3\n4\n5\n"


def test_a_command_past_its_timeout_is_killed(sandbox: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sandbox.commands.run("echo started > /tmp/t; sleep 60", timeout=1.5)
    wait_for(lambda: not any("sleep 60" in " ".join(p.args) for p in sandbox.commands.list()),
             "the timed-out command is gone")
    assert sandbox.commands.run("pgrep -x sleep || echo none").stdout == "none\n"
    assert sandbox.files.read("/tmp/t") == "started\n"


def test_files(sandbox: Sandbox) -> None:
    info = sandbox.files.write("/tmp/d/hello.txt", "hi there")
    assert info.path == "/tmp/d/hello.txt"
    assert sandbox.files.read("/tmp/d/hello.txt") == "hi there"
    blob = bytes(range(256)) * 1000
    sandbox.files.write("/tmp/d/blob.bin", blob)
    assert bytes(sandbox.files.read("/tmp/d/blob.bin", format="bytes")) == blob
    sandbox.files.write_files([{"path": "/tmp/d/a", "data": "A"}, {"path": "/tmp/d/b", "data": b"B"}])
    assert sandbox.files.read("/tmp/d/a") + sandbox.files.read("/tmp/d/b") == "AB"
    names = {e.name: e for e in sandbox.files.list("/tmp/d")}
    assert set(names) == {"hello.txt", "blob.bin", "a", "b"} and names["blob.bin"].size == len(blob)
    assert names["a"].type == FileType.FILE
    assert sandbox.files.exists("/tmp/d/a") and not sandbox.files.exists("/tmp/d/nope")
    assert sandbox.files.make_dir("/tmp/d/sub/deeper") is True
    assert sandbox.files.make_dir("/tmp/d/sub/deeper") is False
    assert sandbox.files.get_info("/tmp/d/sub").type == FileType.DIR
    moved = sandbox.files.rename("/tmp/d/a", "/tmp/d/sub/a2")
    assert moved.path == "/tmp/d/sub/a2" and not sandbox.files.exists("/tmp/d/a")
    deep = {e.path for e in sandbox.files.list("/tmp/d", depth=3)}
    assert {"/tmp/d/sub/a2", "/tmp/d/sub/deeper"} <= deep
    sandbox.files.remove("/tmp/d/sub")
    assert not sandbox.files.exists("/tmp/d/sub/a2")
    with pytest.raises(FileNotFoundException):
        sandbox.files.read("/tmp/d/missing.txt")
    with pytest.raises(NotFoundException):
        sandbox.files.get_info("/tmp/d/missing.txt")


def test_watch_dir(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("/tmp/w")
    sandbox.files.write("/tmp/w/old", "x")
    handle = sandbox.files.watch_dir("/tmp/w")
    sandbox.files.write("/tmp/w/new.txt", "data")
    sandbox.files.remove("/tmp/w/old")
    events = {(e.name, e.type) for e in handle.get_new_events()}
    assert ("new.txt", FilesystemEventType.CREATE) in events and ("old", FilesystemEventType.REMOVE) in events
    assert handle.get_new_events() == []  # each event once
    handle.stop()


def test_pause_then_connect_resumes_a_running_background_command(sandbox: Sandbox) -> None:
    ticker = sandbox.commands.run("i=0; while true; do i=$((i+1)); echo $i > /tmp/n; sleep 0.05; done",
                                  background=True)
    sandbox.files.write("/tmp/kept", "state")
    assert sandbox.pause() is True
    assert Sandbox.get_info(sandbox.sandbox_id).state.value == "paused"
    assert sandbox.pause() is False  # already paused
    again = Sandbox.connect(sandbox.sandbox_id)
    assert ticker.pid in {p.pid for p in again.commands.list()}
    first = int(again.files.read("/tmp/n"))
    wait_for(lambda: int(again.files.read("/tmp/n")) > first, "the ticker goes on counting after the resume")
    assert again.files.read("/tmp/kept") == "state"


def test_timeout_list_info_and_kill(e2b_url: str) -> None:
    sb = Sandbox.create(metadata={"suite": "e2b-list"})
    try:
        before = Sandbox.get_info(sb.sandbox_id).end_at
        sb.set_timeout(3600)
        assert Sandbox.get_info(sb.sandbox_id).end_at > before
        listed = Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "e2b-list"})).next_items()
        assert [s.sandbox_id for s in listed] == [sb.sandbox_id] and listed[0].metadata == {"suite": "e2b-list"}
        assert sb.is_running()
    finally:
        assert sb.kill() is True
    assert Sandbox.kill(sb.sandbox_id) is False
    with pytest.raises(e2b.SandboxException):
        Sandbox.connect(sb.sandbox_id)


def test_fork_and_snapshot_through_the_sdk(sandbox: Sandbox) -> None:
    sandbox.files.write("/tmp/who", "parent")
    kids = sandbox.fork(count=2)
    try:
        assert len(kids) == 2 and len({k.sandbox_id for k in kids} | {sandbox.sandbox_id}) == 3
        for i, kid in enumerate(kids):
            assert kid.files.read("/tmp/who") == "parent"
            kid.files.write("/tmp/who", f"child {i}")
        assert [k.files.read("/tmp/who") for k in kids] == ["child 0", "child 1"]
        assert sandbox.files.read("/tmp/who") == "parent"
    finally:
        for kid in kids:
            kid.kill()
    snap = sandbox.create_snapshot()
    sandbox.files.write("/tmp/who", "after the snapshot")
    restored = Sandbox.create(template=snap.snapshot_id)
    try:
        assert restored.files.read("/tmp/who") == "parent"
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    finally:
        restored.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True


def test_the_code_interpreter_keeps_state_across_pause_and_fork(e2b_url: str) -> None:
    ci = code_interpreter.Sandbox.create()
    kids: list[code_interpreter.Sandbox] = []
    try:
        assert ci.run_code("x = 41\nprint('set')").logs.stdout == ["set\n"]
        assert ci.run_code("x + 1").text == "42"
        err = ci.run_code("1 / 0").error
        assert err is not None and err.name == "ZeroDivisionError"
        ci.pause()
        ci = code_interpreter.Sandbox.connect(ci.sandbox_id)
        assert ci.run_code("x").text == "41"
        kids = ci.fork(count=2)
        for i, kid in enumerate(kids):
            assert kid.run_code("x").text == "41"  # the variable set before the fork is in every child
            kid.run_code(f"x = {i}")
        assert [k.run_code("x").text for k in kids] == ["0", "1"] and ci.run_code("x").text == "41"
        with pytest.raises(TimeoutException):  # the client gives up; the server interrupts the kernel
            early = ci.run_code("import time\nfor i in range(300):\n    time.sleep(0.1)", timeout=1.5)
            pytest.fail(f"a 30 s execution ended before its 1.5 s timeout: {early!r}")  # what ended it, if it does
        after = ci.run_code("x * 2")  # the interrupted execution's leftovers are not this one's
        assert after.text == "82" and after.error is None
        streamed: list[str] = []
        ci.run_code("print('a'); print('b')", on_stdout=lambda m: streamed.append(m.line))
        assert "".join(streamed) == "a\nb\n"
        ctx = ci.create_code_context()
        assert ci.run_code("'x' in globals()", context=ctx).text == "False"
        assert ctx.id in [c.id for c in ci.list_code_contexts()]
        ci.remove_code_context(ctx)
    finally:
        for kid in kids:
            kid.kill()
        ci.kill()


def test_wrong_credentials_are_refused(e2b_url: str, sandbox: Sandbox) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-the-token")
    r = httpx.get(f"{e2b_url}/health", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": "forged"})
    assert r.status_code == 401
    other = httpx.get(f"{e2b_url}/health", headers={"E2b-Sandbox-Id": "sb-000000000000", "X-Access-Token": "x"})
    assert other.status_code == 401  # a token is for one sandbox only


def test_the_async_sdk(e2b_url: str) -> None:
    async def flow() -> None:
        sb = await AsyncSandbox.create()
        try:
            r = await sb.commands.run("echo async")
            assert r.stdout == "async\n"
            await sb.files.write("/tmp/a.txt", "A")
            assert await sb.files.read("/tmp/a.txt") == "A"
            seen: list[object] = []
            watch = await sb.files.watch_dir("/tmp", on_event=seen.append)
            await sb.files.write("/tmp/watched.txt", "w")
            deadline = time.monotonic() + 20
            while not any(getattr(e, "name", "") == "watched.txt" for e in seen) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await watch.stop()
            assert any(getattr(e, "name", "") == "watched.txt" for e in seen)
            kids = await sb.fork(count=2)
            for kid in kids:
                assert await kid.files.read("/tmp/a.txt") == "A"
                await kid.kill()
            await sb.pause()
            sb = await AsyncSandbox.connect(sb.sandbox_id)
            assert (await sb.commands.run("cat /tmp/a.txt")).stdout == "A"
        finally:
            await sb.kill()
        ci = await code_interpreter.AsyncSandbox.create()
        try:
            await ci.run_code("y = 'kept'")
            assert (await ci.run_code("y")).text == "kept"  # a str result without quotes, as E2B gives it
        finally:
            await ci.kill()

    asyncio.run(flow())


def test_the_async_sdk_commands_files_and_interpreter_fork(e2b_url: str) -> None:
    async def flow() -> None:
        sb = await AsyncSandbox.create()
        try:
            with pytest.raises(CommandExitException):
                await sb.commands.run("exit 4")
            sleeper = await sb.commands.run("sleep 60", background=True)
            assert sleeper.pid in {p.pid for p in await sb.commands.list()}
            assert await sb.commands.kill(sleeper.pid) is True
            cat = await sb.commands.run("cat", background=True, stdin=True)
            await sb.commands.send_stdin(cat.pid, "piped\n")
            await sb.commands.close_stdin(cat.pid)
            assert (await cat.wait()).stdout == "piped\n"
            with pytest.raises(TimeoutException):
                await sb.commands.run("sleep 60", timeout=1.5)
            assert await sb.files.make_dir("/tmp/x") is True
            await sb.files.write("/tmp/x/f", b"bytes")
            assert [e.name for e in await sb.files.list("/tmp/x")] == ["f"]
            await sb.files.rename("/tmp/x/f", "/tmp/x/g")
            assert await sb.files.exists("/tmp/x/g") and not await sb.files.exists("/tmp/x/f")
            await sb.files.remove("/tmp/x")
            with pytest.raises(FileNotFoundException):
                await sb.files.read("/tmp/x/g")
        finally:
            await sb.kill()
        ci = await code_interpreter.AsyncSandbox.create()
        kids: list[code_interpreter.AsyncSandbox] = []
        try:
            await ci.run_code("n = 7")
            kids = await ci.fork(count=2)
            await kids[0].run_code("n += 1")
            assert [(await k.run_code("n")).text for k in kids] == ["8", "7"]
            assert (await ci.run_code("n")).text == "7"
        finally:
            for kid in kids:
                await kid.kill()
            await ci.kill()

    asyncio.run(flow())
