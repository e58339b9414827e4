"""A sandbox's life as E2B's SDK (2.63) sees it, against a real ``agentenv serve``: what a command stream ends
with when its sandbox is killed under it, the network options that govern its ports (``allowPublicTraffic``,
``maskRequestHost``), what wakes a paused sandbox (``autoResume``) and a pause that keeps the files only."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import AsyncSandbox, Sandbox  # noqa: E402
from e2b.exceptions import SandboxNotRunningException  # noqa: E402

from .conftest import envd_token  # noqa: E402
from .server_fixtures import e2b_domain_server, wait_for  # noqa: E402
from .test_e2b_ports import DOMAIN, routed, wait_listening  # noqa: E402

HEADERS_SERVER = r"""
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        out = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8003), H).serve_forever()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with e2b_domain_server(tmp_path_factory.mktemp("life"), DOMAIN) as url:
        yield url


def _serving(**create: object) -> Iterator[Sandbox]:
    """A sandbox made with ``create``'s options, answering GET on port 8003 with the headers it got (lowercased)."""
    sb = Sandbox.create(timeout=300, **create)  # type: ignore[arg-type]
    try:
        sb.files.write("/tmp/headers.py", HEADERS_SERVER)
        sb.commands.run("exec python3 /tmp/headers.py", background=True)
        wait_listening(sb, 8003)
        yield sb
    finally:
        Sandbox.kill(sb.sandbox_id)


@pytest.fixture
def public(server: str) -> Iterator[Sandbox]:
    yield from _serving(network={"allow_public_traffic": True})


@pytest.fixture
def masked(server: str) -> Iterator[Sandbox]:
    yield from _serving(network={"mask_request_host": "custom-host.example.com:${PORT}"})


def test_a_command_whose_sandbox_is_killed_ends_saying_so(server: str) -> None:
    """The stream breaks as the agent dies, before the kill is through; the SDK then asks /health, which must
    say the sandbox is gone (runc's word, not the record's), so the error names the kill."""
    async def flow() -> None:
        sb = await AsyncSandbox.create()
        try:
            cmd = await sb.commands.run("sleep 60", background=True)
            assert await sb.is_running()  # /health: 204 while its processes run
            await sb.kill()
            with pytest.raises(SandboxNotRunningException, match="killed or reached its end of life"):
                await cmd.wait()
            assert not await sb.is_running()
        finally:
            await AsyncSandbox.kill(sb.sandbox_id)

    asyncio.run(flow())


def test_a_public_sandboxs_ports_need_no_token_and_its_forks_stay_public(server: str, public: Sandbox) -> None:
    untokened = {"E2b-Sandbox-Id": public.sandbox_id, "E2b-Sandbox-Port": "8003"}
    assert httpx.get(f"{server}/", headers=untokened).status_code == 200
    assert httpx.get(f"{server}/", headers={"Host": public.get_host(8003)}).status_code == 200
    r = httpx.get(f"{server}/health", headers={"E2b-Sandbox-Id": public.sandbox_id})
    assert r.status_code == 401  # envd's port is the sandbox's insides: its token is still required
    info = public.get_info()
    assert info.network is not None and info.network.get("allow_public_traffic") is True
    kid = public.fork()
    kid = kid[0] if isinstance(kid, list) else kid
    try:
        r = httpx.get(f"{server}/", headers={"E2b-Sandbox-Id": kid.sandbox_id, "E2b-Sandbox-Port": "8003"}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        Sandbox.kill(kid.sandbox_id)


def test_a_private_sandboxs_ports_still_need_the_token(server: str, masked: Sandbox) -> None:
    r = httpx.get(f"{server}/", headers={"E2b-Sandbox-Id": masked.sandbox_id, "E2b-Sandbox-Port": "8003"})
    assert r.status_code == 403


def test_a_host_mask_is_the_host_the_listener_sees(server: str, masked: Sandbox) -> None:
    r = httpx.get(f"{server}/", headers=routed(masked, 8003))
    assert r.status_code == 200 and r.json()["host"] == "custom-host.example.com:8003"
    r = httpx.get(f"{server}/", headers={"Host": masked.get_host(8003),
                                         "e2b-traffic-access-token": str(masked.traffic_access_token)})
    assert r.status_code == 200 and r.json()["host"] == "custom-host.example.com:8003"
    info = masked.get_info()
    assert info.network is not None and info.network.get("mask_request_host") == "custom-host.example.com:${PORT}"
    assert masked.get_host(8003) == f"8003-{masked.sandbox_id}.{DOMAIN}"


def test_a_paused_auto_resume_sandbox_wakes_once_for_concurrent_requests(server: str) -> None:
    """Its port's requests, all at once, find it paused: one resume, every request answered, the timeout its
    first one again but five minutes at least (E2B's)."""
    sb = Sandbox.create(timeout=30, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert sb.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        sb.files.write("/tmp/headers.py", HEADERS_SERVER)
        sb.commands.run("exec python3 /tmp/headers.py", background=True)
        wait_listening(sb, 8003)
        sb.pause()
        assert sb.get_info().state.value == "paused"

        async def hit() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as c:
                rs = await asyncio.gather(*(c.get(f"{server}/", headers=routed(sb, 8003)) for _ in range(6)))
            return [r.status_code for r in rs]

        assert asyncio.run(hit()) == [200] * 6
        info = sb.get_info()
        assert info.state.value == "running"
        assert (info.end_at - info.started_at).total_seconds() > 200  # not the 30 s it was made with
        assert sb.is_running() and sb.commands.run("echo awake").stdout == "awake\n"
        sb.pause()  # envd's own requests wake it too
        assert sb.commands.run("cat /tmp/headers.py").exit_code == 0
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_a_paused_sandbox_without_auto_resume_stays_paused(server: str) -> None:
    sb = Sandbox.create(timeout=60, lifecycle={"on_timeout": "pause"})
    try:
        sb.pause()
        r = httpx.get(f"{server}/health", headers={"E2b-Sandbox-Id": sb.sandbox_id,
                                                   "X-Access-Token": str(envd_token(sb))})
        assert r.status_code == 502 and "paused" in r.json()["message"]
        assert sb.get_info().state.value == "paused"
    finally:
        Sandbox.kill(sb.sandbox_id)


def _gone(sb: Sandbox) -> bool:
    """True when no ``sleep`` runs in the sandbox (the one the test started is gone)."""
    return sb.commands.run("pgrep -x sleep >/dev/null && echo running || echo gone").stdout.strip() == "gone"


def test_a_files_only_pause_boots_afresh_from_the_disk_and_never_wakes_on_traffic(server: str) -> None:
    sb = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sb.files.write("/home/user/marker.txt", "persisted")
        sb.commands.run("sleep 600", background=True)
        wait_for(lambda: not _gone(sb), "the background sleep running")  # started is not yet exec'd as sleep
        assert sb.pause(keep_memory=False)
        assert not sb.is_running()  # auto_resume: yet a files-only pause waits for connect, as in E2B
        assert sb.get_info().state.value == "paused"
        again = Sandbox.connect(sb.sandbox_id)
        assert again.files.read("/home/user/marker.txt") == "persisted"
        assert _gone(again) and again.commands.run("echo fresh").stdout == "fresh\n"
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_a_timeout_pauses_files_only_when_asked_and_reboot_drops_a_memory_pause(server: str) -> None:
    timed = Sandbox.create(timeout=2, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    full = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause"})
    try:
        for sb in (timed, full):
            sb.files.write("/tmp/marker.txt", "kept")
            sb.commands.run("sleep 600", background=True)
        wait_for(lambda: timed.get_info().state.value == "paused", "the timeout pauses it (the reaper looks often)")
        back = Sandbox.connect(timed.sandbox_id)
        assert back.files.read("/tmp/marker.txt") == "kept" and _gone(back)
        wait_for(lambda: not _gone(full), "the background sleep running")  # so that its going away means something
        full.pause()
        rebooted = Sandbox.connect(full.sandbox_id, on_resume="reboot")  # memory false: boot from the files
        assert rebooted.files.read("/tmp/marker.txt") == "kept" and _gone(rebooted)
    finally:
        Sandbox.kill(timed.sandbox_id)
        Sandbox.kill(full.sandbox_id)
