"""The E2B surface attacked by whoever holds less than the whole: a signed file URL and nothing else (the
signature fixes the path, the operation and the account), no credential at all (a paused autoResume sandbox stays
paused), the sandbox's own user (a symlink planted where a root upload would write), one sandbox's client
against another sandbox (shared watcher bounds), and the holder of a sandbox's traffic token alone (what anyone given
one of its web ports holds: never envd's commands and files, nor the interpreter's code)."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from .conftest import envd_token
from .server_fixtures import e2b_domain_server
from .test_e2b_life import HEADERS_SERVER
from .test_e2b_ports import wait_listening

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import Sandbox  # noqa: E402

DOMAIN = "signed.test"

ROOT_BASIC = "Basic cm9vdDo="  # base64("root:"): envd's way of naming the account of a call


@pytest.fixture(scope="module")
def e2b_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The module's server routes ``get_host`` names too (conftest's ``sandbox`` is made on it)."""
    with e2b_domain_server(tmp_path_factory.mktemp("signed"), DOMAIN) as url:
        yield url


def _raw(url: str, request: bytes) -> bytes:
    """The first bytes the server answers a request sent as written (a WebSocket upgrade: not httpx's to send)."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname or "", where.port or 80), timeout=60) as s:
        s.sendall(request)
        return s.recv(65536)


def test_no_request_without_a_credential_wakes_a_paused_auto_resume_sandbox(e2b_url: str) -> None:
    """Auto-resume comes after admission: a request with no token, a wrong one or a bogus signature is refused
    (on every route: headers, get_host's Host, WebSocket, signed /files) and the sandbox stays paused."""
    sb = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sb.pause()
        sid, host = sb.sandbox_id, f"8003-{sb.sandbox_id}.{DOMAIN}"
        assert httpx.get(f"{e2b_url}/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8003"}).status_code == 403
        assert httpx.get(f"{e2b_url}/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8003",
                                                 "e2b-traffic-access-token": "wrong"}).status_code == 403
        assert httpx.get(f"{e2b_url}/health", headers={"E2b-Sandbox-Id": sid}).status_code == 401
        assert httpx.get(f"{e2b_url}/", headers={"Host": host}).status_code == 403
        bogus = {"path": "/etc/hostname", "signature": "v1_" + "A" * 43}
        assert httpx.get(f"{e2b_url}/files", params=bogus).status_code == 401
        assert httpx.get(f"{e2b_url}/files", params=bogus, headers={"E2b-Sandbox-Id": sid}).status_code == 401
        upgrade = (f"GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
        assert _raw(e2b_url, upgrade).startswith(b"HTTP/1.1 403")
        assert Sandbox.get_info(sid).state.value == "paused"
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_a_url_signed_for_the_default_user_cannot_be_turned_into_roots(sandbox: Sandbox) -> None:
    sandbox.commands.run("echo -n topsecret > /root/secret.txt && chmod 600 /root/secret.txt", user="root")
    url = sandbox.download_url("/root/secret.txt")  # signed for the default account ("user" here): not readable
    assert httpx.get(url).status_code != 200
    forged = httpx.get(url, headers={"Authorization": ROOT_BASIC})
    assert forged.status_code == 401, forged.text
    assert "topsecret" not in forged.text
    up = sandbox.upload_url("/root/planted.txt")
    forged_up = httpx.post(up, files={"file": ("planted.txt", b"x")}, headers={"Authorization": ROOT_BASIC})
    assert forged_up.status_code == 401, forged_up.text
    assert not sandbox.files.exists("/root/planted.txt", user="root")


def test_a_write_url_signed_for_one_path_writes_that_path_alone(sandbox: Sandbox) -> None:
    url = sandbox.upload_url("/home/user/up.txt", "user")
    two = httpx.post(url, files=[("file", ("up.txt", b"one")), ("file", ("/home/user/other.txt", b"two"))])
    assert two.status_code == 400, two.text  # the second file's name is not the path signed
    assert not sandbox.files.exists("/home/user/other.txt")
    renamed = httpx.post(url, files={"file": ("/home/user/elsewhere.txt", b"three")})
    assert renamed.status_code == 200, renamed.text  # one file: the signed path names it, as envd
    assert sandbox.files.read("/home/user/up.txt") == "three"
    assert not sandbox.files.exists("/home/user/elsewhere.txt")


def test_a_public_ports_own_files_path_with_a_signature_query_is_its_listeners(e2b_url: str) -> None:
    """``/files?signature=`` is envd's signed URL only on envd's port: on another port of a sandbox made with
    ``allowPublicTraffic`` it is the listener's, reached with no token like any other path of that port."""
    sb = Sandbox.create(timeout=120, network={"allow_public_traffic": True})
    try:
        sb.files.write("/tmp/headers.py", HEADERS_SERVER)
        sb.commands.run("exec python3 /tmp/headers.py", background=True)
        wait_listening(sb, 8003)
        r = httpx.get(f"{e2b_url}/files", params={"path": "x", "signature": "v1_app"},
                      headers={"Host": f"8003-{sb.sandbox_id}.{DOMAIN}"})
        assert r.status_code == 200, r.text
        assert r.json()["host"] == f"8003-{sb.sandbox_id}.{DOMAIN}"
        for port, path in (("49983", "/health"), ("49999", "/contexts"), ("049983", "/health")):
            closed = httpx.get(f"{e2b_url}{path}", headers={"Host": f"{port}-{sb.sandbox_id}.{DOMAIN}"})
            assert closed.status_code in (401, 502), (port, closed.text)  # envd and the interpreter keep the token
            assert "not open" in closed.text if closed.status_code == 502 else "token" in closed.text
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_a_symlink_planted_at_an_uploads_temporary_name_does_not_redirect_roots_write(sandbox: Sandbox) -> None:
    """An upload goes to a temporary file beside its path, then is renamed: the sandbox's user, who can write
    that folder, plants a symlink where the temporary file would be, aimed at a root-only place. The write as
    root must not follow it (no file made there, nor chmodded), and the path ends up the regular file sent."""
    sandbox.commands.run("ln -s /etc/planted-by-user /home/user/t.txt.agentenv-tmp")
    sandbox.files.write("/home/user/t.txt", "from the harness", user="root")
    assert not sandbox.files.exists("/etc/planted-by-user", user="root")
    assert sandbox.commands.run("stat -c %F /home/user/t.txt").stdout.strip() == "regular file"
    assert sandbox.files.read("/home/user/t.txt") == "from the harness"


def test_one_sandboxs_watchers_cannot_push_out_another_sandboxs(sandbox: Sandbox) -> None:
    """Watchers are kept per server, the oldest dropped past a bound: a client of sandbox A creating watchers
    without end must be refused once A holds its share, and B's watcher must go on answering."""
    theirs = sandbox.files.watch_dir("/tmp")
    other = Sandbox.create(timeout=300)
    try:
        other.files.make_dir("/tmp/w")
        refused = None
        for _ in range(1100):  # past the server's whole bound (1024)
            try:
                other.files.watch_dir("/tmp/w")
            except e2b.SandboxException as e:
                refused = e
                break
        sandbox.files.write("/tmp/after.txt", "x")
        assert any(e.name == "after.txt" for e in theirs.get_new_events())
        assert refused is not None and "watchers" in str(refused)
    finally:
        Sandbox.kill(other.sandbox_id)


def test_the_traffic_token_opens_neither_envds_commands_and_files_nor_the_interpreters_code(
        e2b_url: str, sandbox: Sandbox) -> None:
    """Whoever is given one web port of a sandbox (``allowPublicTraffic`` off, plus its ``trafficAccessToken``) must
    not run commands in it, read or write its files, or run code through its interpreter: the token is refused on
    each of those routes, under either header it could be sent in, and is not envd's token either."""
    traffic = str(sandbox.traffic_access_token)
    sandbox.files.write("/tmp/secret.txt", "traffic-must-not-read-this")
    msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "touch /tmp/ran-by-traffic"]}}).encode()
    for header in ("X-Access-Token", "e2b-traffic-access-token"):
        given = {"E2b-Sandbox-Id": sandbox.sandbox_id, header: traffic}
        read = httpx.get(f"{e2b_url}/files", params={"path": "/tmp/secret.txt"}, headers=given)
        assert read.status_code == 401 and "traffic-must-not-read-this" not in read.text, (header, read.text)
        listed = httpx.post(f"{e2b_url}/filesystem.Filesystem/ListDir", json={"path": "/tmp"}, headers=given)
        assert listed.status_code == 401 and "secret.txt" not in listed.text, (header, listed.text)
        wrote = httpx.post(f"{e2b_url}/files", params={"path": "/tmp/planted.txt"}, headers=given,
                           files={"file": ("planted.txt", b"planted")})
        assert wrote.status_code == 401, (header, wrote.text)
        ran = httpx.post(f"{e2b_url}/process.Process/Start", content=b"\x00" + struct.pack(">I", len(msg)) + msg,
                         headers={**given, "Content-Type": "application/connect+json"}, timeout=30)
        assert ran.status_code == 401, (header, ran.text)
        code = httpx.post(f"{e2b_url}/execute", json={"code": "open('/tmp/ran-by-interpreter', 'w').close()"},
                          headers={**given, "E2b-Sandbox-Port": "49999"}, timeout=60)
        assert code.status_code == 401, (header, code.text)
    left = sandbox.commands.run("ls /tmp", user="root").stdout.split()
    assert not {"planted.txt", "ran-by-traffic", "ran-by-interpreter"} & set(left), left
    assert traffic != envd_token(sandbox)  # neither token is the other
    contexts = httpx.get(f"{e2b_url}/contexts", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port":
                                                         "49999", "e2b-traffic-access-token": traffic})
    assert contexts.status_code == 200, contexts.text  # what the SDK sends it to: the interpreter's contexts
