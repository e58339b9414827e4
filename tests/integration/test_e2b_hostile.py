"""The E2B surface of ``agentenv serve`` under attack: clients holding the wrong token (or none), malformed
headers and bodies, hostile code in the sandbox (floods, fork bombs, a full disk, a broken or stuck kernel) and
clients that misbehave (streams never read, calls that block). Each attack checks that it gets a clear error, that
every call ends ("did not hang" deadlines only) and that another sandbox stays served meanwhile."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import envd_token
from .server_fixtures import TOKEN, wait_for

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")
code_interpreter = pytest.importorskip("e2b_code_interpreter")

from e2b import CommandExitException, NotEnoughSpaceException, TimeoutException  # noqa: E402
from e2b_code_interpreter import Sandbox  # noqa: E402

ENVD, INTERPRETER = "49983", "49999"


def _made(e2b_url: str) -> Iterator[Sandbox]:
    sb = Sandbox.create(timeout=600)
    try:
        yield sb
    finally:
        Sandbox.kill(sb.sandbox_id)


@pytest.fixture(scope="module")
def victim(e2b_url: str) -> Iterator[Sandbox]:
    """Sandbox B: holds a secret, and is the one that must stay served while A is attacked."""
    for sb in _made(e2b_url):
        sb.files.write("/tmp/secret", "B-SECRET")
        yield sb


@pytest.fixture(scope="module")
def attacker(e2b_url: str) -> Iterator[Sandbox]:
    """Sandbox A for attacks that leave it usable."""
    yield from _made(e2b_url)


@pytest.fixture
def spent(e2b_url: str) -> Iterator[Sandbox]:
    """Sandbox A for attacks that may leave it broken: a fresh one, killed after."""
    yield from _made(e2b_url)


def headers(sb: Sandbox, port: str = ENVD, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": envd_token(sb) or "",
            "E2b-Sandbox-Port": port, **extra}


class Watch:
    """Reads a file of the victim every 0.1 s in a thread; every read must come back within ``limit`` seconds."""

    def __init__(self, victim: Sandbox, limit: float = 15.0) -> None:
        self.victim, self.limit = victim, limit
        self.reads, self.failures = 0, []  # type: ignore[var-annotated]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                assert self.victim.files.read("/tmp/secret", request_timeout=self.limit) == "B-SECRET"
                self.reads += 1
            except Exception as e:  # noqa: BLE001 - reported by check()
                self.failures.append(f"{type(e).__name__}: {e}")
            self.stop.wait(0.1)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(self.limit + 5)
        if exc[0] is None:
            assert not self.failures, f"the other sandbox was not served meanwhile: {self.failures[:3]}"
            assert self.reads > 0, "the other sandbox was never read meanwhile"


def in_time(fn: Callable[[], Any], limit: float, what: str) -> Any:
    """``fn()`` in a thread, which must end within ``limit`` seconds (a generous "did not hang")."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"{what} did not end within {limit} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def stream_threads() -> int:
    return sum(t.name == "agentenv-e2b-stream" for t in threading.enumerate())


def came_back(sandbox_id: str) -> bool:
    """Whether a closed sandbox's folder is there again (once, a runc call racing close() brought it back with
    only runc's log in it: ``Container.runc`` now logs outside the bundle)."""
    return (Path(os.environ["AGENTENV_HOME"]) / "sandboxes" / sandbox_id).exists()


# --- (1) clients with the wrong token, or odd headers -------------------------------------------------------


def test_a_token_for_sandbox_a_never_reaches_sandbox_b(e2b_url: str, attacker: Sandbox, victim: Sandbox) -> None:
    read = {"path": "/tmp/secret"}
    own = headers(attacker)
    r = httpx.get(f"{e2b_url}/files", params=read, headers={**own, "E2b-Sandbox-Id": victim.sandbox_id})
    assert r.status_code == 401 and "access token" in r.json()["message"]
    r = httpx.get(f"{e2b_url}/files", params=read, headers={"E2b-Sandbox-Id": victim.sandbox_id})
    assert r.status_code == 401
    # two sandbox ids: the token is checked against one, so the services must not read the other
    for order in ([victim.sandbox_id, attacker.sandbox_id], [attacker.sandbox_id, victim.sandbox_id]):
        r = httpx.get(f"{e2b_url}/files", params=read, headers=[
            ("E2b-Sandbox-Id", order[0]), ("E2b-Sandbox-Id", order[1]), ("X-Access-Token", own["X-Access-Token"])])
        assert r.status_code == 400 and "more than once" in r.json()["message"], r.text
        assert "B-SECRET" not in r.text
    r = httpx.post(f"{e2b_url}/filesystem.Filesystem/Stat", content=b'{"path": "/tmp/secret"}', headers=[
        ("E2b-Sandbox-Id", victim.sandbox_id), ("E2b-Sandbox-Id", attacker.sandbox_id),
        ("X-Access-Token", own["X-Access-Token"]), ("Content-Type", "application/json")])
    assert r.status_code == 400
    r = httpx.get(f"{e2b_url}/files", params=read, headers=[
        ("E2b-Sandbox-Id", attacker.sandbox_id), ("X-Access-Token", "wrong"), ("X-Access-Token", own["X-Access-Token"])])
    assert r.status_code == 400
    for sid in ("../x", "../" + victim.sandbox_id, victim.sandbox_id + "/..", ""):
        r = httpx.get(f"{e2b_url}/health", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": own["X-Access-Token"]})
        assert r.status_code == 401, (sid, r.text)
    # the control plane takes only the server's token
    for bad in ({}, {"X-API-KEY": own["X-Access-Token"]}, {"X-API-KEY": TOKEN + "x"}, {"Authorization": "Bearer"}):
        r = httpx.get(f"{e2b_url}/sandboxes/{victim.sandbox_id}", headers=bad)
        assert r.status_code == 401, (bad, r.text)
        r = httpx.delete(f"{e2b_url}/sandboxes/{victim.sandbox_id}", headers=bad)
        assert r.status_code == 401
    assert victim.files.read("/tmp/secret") == "B-SECRET"


def test_a_port_that_is_not_a_port_is_a_clear_error(e2b_url: str, attacker: Sandbox) -> None:
    for port in ("\u00b2", "9" * 5000, "abc", "-1", "0x49983", "1e5", ""):
        h = {**headers(attacker), "E2b-Sandbox-Port": port.encode("latin-1")}
        r = httpx.get(f"{e2b_url}/health", headers=h)  # type: ignore[arg-type]
        assert r.status_code == 502 and "not open" in r.json()["message"], (port[:10], r.status_code, r.text)
    assert httpx.get(f"{e2b_url}/health", headers=headers(attacker)).status_code == 204


def test_malformed_bodies_are_4xx_with_a_reason(e2b_url: str, attacker: Sandbox) -> None:
    rpc = {**headers(attacker), "Content-Type": "application/json"}
    for body in (b"{", b"[]", b'{"path": 5}', b'{"path": "/", "depth": "deep"}', b"\xff\xfe"):
        r = httpx.post(f"{e2b_url}/filesystem.Filesystem/ListDir", headers=rpc, content=body)
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (body, r.text)
    r = httpx.post(f"{e2b_url}/filesystem.Filesystem/Stat", headers={**rpc, "Content-Type": "application/proto"},
                   content=b"\xff" * 64)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    # a huge body: refused from its length, or once the limit is read
    r = httpx.post(f"{e2b_url}/filesystem.Filesystem/Stat", headers=rpc, content=b"x" * (33 << 20))
    assert r.status_code == 413
    r = httpx.post(f"{e2b_url}/filesystem.Filesystem/Stat", headers=rpc,
                   content=(b"x" * (1 << 20) for _ in range(40)))
    assert r.status_code in (413, 429) and r.json()["code"] in ("resource_exhausted", 413)
    # a streaming call's envelope that lies about its length, or carries a malformed message
    stream = {**headers(attacker), "Content-Type": "application/connect+json"}
    for body in (b"\x00\xff\xff\xff\xff{}", b"\x00\x00\x00\x00\x05{}", b"\x00\x00\x00\x00\x02[]", b"\x07"):
        r = httpx.post(f"{e2b_url}/process.Process/Start", headers=stream, content=body, timeout=30)
        assert r.status_code in (200, 400)
        assert b'"error"' in r.content or r.status_code == 400, (body, r.content[:200])
    # the interpreter's bodies
    run = headers(attacker, INTERPRETER)
    for body in ("[1]", '{"code": 1}', '{"code": "1", "env_vars": [1]}', '{"code": "1", "context_id": [1]}',
                 '{"code": "1", "context_id": 5}', '{"code": "1", "language": "r"}', "not json"):
        r = httpx.post(f"{e2b_url}/execute", headers=run, content=body)
        assert r.status_code == 400 and r.json()["message"], (body, r.status_code, r.text)
    for body in ("[1]", '{"cwd": 5}', '{"language": "r"}', "{"):
        r = httpx.post(f"{e2b_url}/contexts", headers=run, content=body)
        assert r.status_code == 400 and r.json()["message"], (body, r.status_code, r.text)
    assert attacker.run_code("6 * 7").text == "42"


def test_made_up_context_ids_leave_nothing_behind(e2b_url: str, attacker: Sandbox) -> None:
    from agentenv.server.e2b.interpreter import Interpreter

    run = headers(attacker, INTERPRETER)
    for _ in range(30):
        r = httpx.post(f"{e2b_url}/execute", headers=run, json={"code": "1", "context_id": uuid.uuid4().hex})
        assert r.status_code == 404 and "no context" in r.json()["message"]  # as E2B's server: before any stream
    gc.collect()
    kept = [len(o.locks) for o in gc.get_objects() if isinstance(o, Interpreter)]
    assert kept and max(kept) < 5, kept


def test_paused_and_deleted_sandboxes_answer_with_a_reason(e2b_url: str, spent: Sandbox) -> None:
    api = {"X-API-KEY": TOKEN}
    assert httpx.post(f"{e2b_url}/sandboxes/{spent.sandbox_id}/pause", headers=api, timeout=120).status_code == 204
    r = httpx.get(f"{e2b_url}/files", params={"path": "/etc/hostname"}, headers=headers(spent))
    assert r.status_code == 502 and "paused" in r.json()["message"]
    r = httpx.post(f"{e2b_url}/sandboxes/{spent.sandbox_id}/pause", headers=api, timeout=120)
    assert r.status_code == 409
    Sandbox.kill(spent.sandbox_id)
    r = httpx.get(f"{e2b_url}/files", params={"path": "/etc/hostname"}, headers=headers(spent))
    assert r.status_code == 502 and "not found" in r.json()["message"]
    r = httpx.post(f"{e2b_url}/sandboxes/{spent.sandbox_id}/connect", headers=api, json={"timeout": 10})
    assert r.status_code == 404


# --- (3) clients that misbehave -----------------------------------------------------------------------------


def test_calls_that_block_in_one_sandbox_take_no_threads_of_another(e2b_url: str, spent: Sandbox,
                                                                    victim: Sandbox) -> None:
    """Writes to a stdin nobody reads wait up to 30 s each in the agent: 48 of them at once held every thread of
    the server's shared pool, and every request of every other sandbox waited behind them."""
    job = spent.commands.run("sleep 600", background=True, stdin=True)
    errors: list[str] = []

    def write() -> None:
        try:
            spent.commands.send_stdin(job.pid, "x" * (1 << 20), request_timeout=200)
        except Exception as e:  # noqa: BLE001 - the writes fail once the sandbox is killed
            errors.append(type(e).__name__)

    writers = [threading.Thread(target=write, daemon=True) for _ in range(48)]
    for t in writers:
        t.start()
    time.sleep(2)
    with Watch(victim, limit=10):
        time.sleep(1)
        r = in_time(lambda: httpx.get(f"{e2b_url}/sandboxes", headers={"X-API-KEY": TOKEN}, timeout=10), 15,
                    "the control plane")
        assert r.status_code == 200
    # (closing with calls in flight once failed with EBADF: a refused KeeperProcess pin closed its pidfd twice)
    in_time(lambda: Sandbox.kill(spent.sandbox_id), 30, "killing the sandbox whose calls block")
    for t in writers:
        t.join(60)
    assert not any(t.is_alive() for t in writers), "a write to a killed sandbox never ended"
    assert len(errors) == len(writers)
    assert not came_back(spent.sandbox_id)


def test_closing_a_sandbox_with_calls_in_flight_leaves_nothing(e2b_url: str) -> None:
    leftovers = []
    for _ in range(6):  # a race: it shows in most rounds
        sb = Sandbox.create(timeout=600)
        job = sb.commands.run("sleep 600", background=True, stdin=True)
        writers = [threading.Thread(target=_write, args=(sb, job.pid), daemon=True) for _ in range(48)]
        for t in writers:
            t.start()
        time.sleep(1.5)
        Sandbox.kill(sb.sandbox_id)
        for t in writers:
            t.join(60)
        time.sleep(0.5)
        if came_back(sb.sandbox_id):
            leftovers.append(sb.sandbox_id)
            break
    assert not leftovers, f"closed sandboxes whose folder came back: {leftovers}"


def _write(sb: Sandbox, pid: int) -> None:
    with contextlib.suppress(Exception):  # the write fails once the sandbox is closed
        sb.commands.send_stdin(pid, "x" * (1 << 20), request_timeout=120)


def test_start_streams_never_read_and_dropped(e2b_url: str, spent: Sandbox, victim: Sandbox) -> None:
    before = stream_threads()
    handles = [spent.commands.run("yes | head -c 2000000", background=True) for _ in range(30)]
    with Watch(victim):
        assert in_time(lambda: spent.commands.run("echo ok", timeout=30).stdout, 45, "a command") == "ok\n"
    for h in handles:
        h.disconnect()
    # a raw client that leaves in the middle of an endless stream
    msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "yes"]}}).encode()
    envelope = b"\x00" + struct.pack(">I", len(msg)) + msg
    for _ in range(3):
        with httpx.Client(timeout=10) as c, c.stream("POST", f"{e2b_url}/process.Process/Start", content=envelope,
                                                      headers={**headers(spent), "Content-Type":
                                                               "application/connect+json"}) as r:
            assert r.status_code == 200
            next(r.iter_raw())
    wait_for(lambda: stream_threads() <= before, "the streams of clients that left end", limit=30)
    assert spent.commands.run("echo still", timeout=30).stdout == "still\n"


def test_listing_everything_and_watching_root(attacker: Sandbox, victim: Sandbox) -> None:
    with Watch(victim):
        try:
            found = in_time(lambda: attacker.files.list("/", depth=1000, request_timeout=60), 75, "list depth 1000")
            assert any(e.path == "/usr/bin" for e in found)
        except e2b.InvalidArgumentException as e:  # over the agent's entry limit: a clear error
            assert "entries" in str(e)
        handle = in_time(lambda: attacker.files.watch_dir("/", recursive=True,
                                                          request_timeout=60), 75, "watch / recursively")
        time.sleep(1)
        in_time(handle.stop, 10, "stopping the watch")


# --- (2) code inside the sandbox ----------------------------------------------------------------------------

KERNEL = "import gc, os\nk = [o for o in gc.get_objects() if type(o).__name__ == 'Kernel'][0]\n"


def test_garbage_on_the_kernels_channel(attacker: Sandbox, victim: Sandbox) -> None:
    """User code can find the kernel's private channel and write to it: lines that are not events, a line
    of 8 MiB with no end, forged events of other requests. The execution still ends; the next one works."""
    garbage = KERNEL + (
        "for i in range(2000): os.write(k.proto, b'{\"garbage\": [1, 2]}\\n\\xff\\xfe[[[[\\n{\"id\": \"x\"}\\n')\n"
        "os.write(k.proto, b'{\"id\": \"someone-else\", \"type\": \"end\"}\\n')\n"
        "os.write(k.proto, b'x' * (8 << 20))\n"
        "print('after')\n")
    with Watch(victim):
        done = in_time(lambda: attacker.run_code(garbage, timeout=60), 75, "an execution writing garbage")
        assert done.error is None, done.error  # the cell ran to its end (its last print is lost in the long line)
        assert in_time(lambda: attacker.run_code("6 * 7", timeout=30).text, 45, "the next execution") == "42"


def test_a_kernel_killed_or_replaced(attacker: Sandbox) -> None:
    died = attacker.run_code("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", timeout=30)
    assert died.error is not None and died.error.name == "KernelDied"
    assert attacker.run_code("1 + 1", timeout=30).text == "2"
    # the kernel's stdin closed by user code: it exits, and the next execution starts a new one
    ended = attacker.run_code(KERNEL + "os.close(k.inp)\nprint('closed')", timeout=30)
    assert ended.error is None or ended.error.name == "KernelDied", ended.error  # not the race of its end
    wait_for(lambda: attacker.run_code("2 + 2", timeout=30).text == "4", "a new kernel answers", limit=30)


def test_a_kernel_that_never_answers(attacker: Sandbox) -> None:
    stuck = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: time.sleep(0.1)"
    ctx = attacker.create_code_context()
    with pytest.raises(TimeoutException):
        in_time(lambda: attacker.run_code(stuck, context=ctx, timeout=2), 30, "an execution past its timeout")
    in_time(lambda: attacker.restart_code_context(ctx), 30, "restarting a stuck context")
    assert attacker.run_code("3 + 3", context=ctx, timeout=30).text == "6"
    attacker.remove_code_context(ctx)


def test_a_stdout_flood(attacker: Sandbox, victim: Sandbox) -> None:
    with Watch(victim):
        r = in_time(lambda: attacker.commands.run("head -c 150000000 /dev/zero | tr '\\0' a", timeout=90), 100,
                    "a command flooding stdout")
    assert 0 < len(r.stdout) <= 150_000_000 and set(r.stdout) == {"a"}
    assert attacker.commands.run("echo calm").stdout == "calm\n"


def test_a_fork_bomb_in_the_background(spent: Sandbox, victim: Sandbox) -> None:
    bomb = spent.commands.run("bash -c ':(){ :|:& };:'", background=True)
    time.sleep(3)
    with Watch(victim):
        # the sandbox may have no pid left for it: a clear error, in time
        with contextlib.suppress(CommandExitException, e2b.SandboxException, TimeoutException):
            in_time(lambda: spent.commands.run("echo ok", timeout=20), 40, "a command during the bomb")
        in_time(lambda: spent.commands.kill(bomb.pid), 40, "killing the bomb")
    assert victim.commands.run("echo fine", timeout=30).stdout == "fine\n"


def test_a_full_disk_then_a_write(spent: Sandbox, victim: Sandbox) -> None:
    with Watch(victim):
        in_time(lambda: spent.commands.run("for i in $(seq 1000); do fallocate -l 256M /tmp/fill$i || break; done; "
                                           "dd if=/dev/zero of=/tmp/fill bs=1M count=100000 2>/dev/null; true",
                                           timeout=120), 150, "filling the disk")
        with pytest.raises(NotEnoughSpaceException):
            spent.files.write("/tmp/more", "x" * (1 << 20))
    spent.commands.run("rm -f /tmp/fill*")
    assert spent.files.write("/tmp/more", "x" * 1024).path == "/tmp/more"


def test_unread_output_of_many_jobs_does_not_kill_the_agent(spent: Sandbox) -> None:
    """40 jobs write 1.2 GB nobody reads into a 1 GiB sandbox: the agent keeps a bounded share (agent.OUTPUT_BUDGET)
    and drops the rest, so the agent and the jobs live, and small commands still answer."""
    handles = [spent.commands.run("yes | head -c 30000000", background=True) for _ in range(40)]

    def settled() -> bool:  # every job ended, its output (what the budget kept) waiting for a reader
        try:
            return not spent.commands.list(request_timeout=30)
        except Exception:  # noqa: BLE001 - the agent is gone
            return True

    try:
        wait_for(settled, "the jobs end", limit=120)
        assert spent.commands.run("echo alive", timeout=30).stdout == "alive\n"
        first = handles[0].wait()  # exit 0: it ran to its end, not killed by the OOM killer
        assert first.exit_code == 0 and 0 < len(first.stdout) <= 30_000_000
    finally:
        for h in handles:
            h.disconnect()


def test_one_sandboxs_websockets_cannot_take_every_splice(e2b_url: str, monkeypatch: pytest.MonkeyPatch,
                                                          attacker: Sandbox, victim: Sandbox) -> None:
    """A sandbox whose port draws WebSockets (its public traffic, say) holds at most its share of the server's
    splices: past it, a 429 that says so; another sandbox's WebSocket still opens, and a closed one frees a place."""
    from agentenv.server.e2b import upgrade

    from .test_e2b_ports import WS_ECHO, _upgrade, routed, wait_listening

    monkeypatch.setattr(upgrade, "PER_SANDBOX", 2)
    for sb in (attacker, victim):
        sb.files.write("/tmp/ws.py", WS_ECHO)
        sb.commands.run("exec python3 /tmp/ws.py", background=True)
        wait_listening(sb, 8002)
    held = []
    try:
        for _ in range(2):
            s, head = _upgrade(e2b_url, routed(attacker, 8002))
            held.append(s)
            assert head.startswith(b"HTTP/1.1 101"), head
        s, head = _upgrade(e2b_url, routed(attacker, 8002))
        s.close()
        assert head.startswith(b"HTTP/1.1 429") and b"its share" in head, head
        s, head = _upgrade(e2b_url, routed(victim, 8002))
        s.close()
        assert head.startswith(b"HTTP/1.1 101"), head
        held.pop().close()

        def reopened() -> bool:  # the server sees the close when its splice ends: wait for that state
            s, head = _upgrade(e2b_url, routed(attacker, 8002))
            if head.startswith(b"HTTP/1.1 101"):
                held.append(s)
                return True
            s.close()
            return False

        wait_for(reopened, "a place freed by a closed WebSocket")
    finally:
        for s in held:
            s.close()
