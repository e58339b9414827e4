"""Failed authentication has a budget (issue 40, finding 11): without one a local user tries about 1,000 tokens a
second against the servers, which matters for tokens an operator chooses.

Every client of a server on loopback is 127.0.0.1, so the budget is kept per local user (the uid that owns the
client's socket), and per address for a peer on another host. A flood of wrong tokens spends its sender's budget
(its requests are then refused unchecked, the right token too, so it learns nothing more), never another user's:
the operator's real token keeps working all through it. The flood comes from a process of its own run as
``nobody``, against a real server on loopback (no Docker: no sandbox is made), on every check of the env server
(bearer token, console login, E2B API key, a sandbox's access token); the policy server's check is the same one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from agentenv.server import create_app, uvicorn_config
from agentenv.server.e2b.tokens import envd_token
from policy import authlimit
from policy.server import create_app as policy_app
from policy.tokenizer import load_tokenizer

TOKEN = "flood-test-token-" + "f" * 24
NOBODY = 65534
SANDBOX = "sb-flood"  # no such sandbox: a request for it that passes admission is answered 502 (not found running)

# run by `nobody` with the standard library alone: floods wrong tokens on every check until refused (prints
# "spent"), goes on flooding in a thread, sends the right tokens it then reads on stdin once (prints their
# statuses), and on "stop" prints how many wrong tries it sent and the statuses they got
FLOOD = r"""
import http.client, json, sys, threading
port = int(sys.argv[1])
def send(method, path, headers, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request(method, path, body=body, headers=headers)
        return c.getresponse().status
    finally:
        c.close()
def tries(token, envd):
    other = {"X-Forwarded-For": "198.51.100.%d" % (sent % 250)}  # claiming another client each time changes nothing
    return [("GET", "/v1/server", {"Authorization": "Bearer " + token, **other}, None),
            ("GET", "/v2/sandboxes", {"X-API-KEY": token, **other}, None),
            ("POST", "/console/login", {"Content-Type": "application/x-www-form-urlencoded", **other}, "token=" + token),
            ("GET", "/health", {"E2b-Sandbox-Id": "SANDBOX", "X-Access-Token": envd, **other}, None)]
seen, sent = set(), 0
def flood():
    global sent
    while not stop.is_set():
        for t in tries("wrong-%d" % sent, "0" * 64):
            seen.add(send(*t))
            sent += 1
stop = threading.Event()
for _ in range(500):
    for t in tries("wrong", "0" * 64):
        seen.add(send(*t))
        sent += 1
    if 429 in seen:
        break
print("spent" if 429 in seen else "never refused: %s" % sorted(seen), flush=True)
thread = threading.Thread(target=flood)
thread.start()
right = json.loads(sys.stdin.readline())
print(json.dumps([send(*t) for t in tries(right["token"], right["envd"])]), flush=True)
sys.stdin.readline()
stop.set()
thread.join()
print(json.dumps({"sent": sent, "seen": sorted(seen)}), flush=True)
""".replace("SANDBOX", SANDBOX)


def frozen(app: Any) -> Any:
    """``app`` with its failure budget's clock stopped, so that no budget refills while the test looks."""
    app.state.auth_failures.clock = lambda: 0.0
    return app


@pytest.fixture()
def served(tmp_path, monkeypatch) -> Iterator[str]:
    """The env server (E2B's API too) on a free loopback port, in a thread, without its lifespan (no Docker)."""
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    config = uvicorn_config(frozen(create_app(TOKEN, e2b=True)), port=0, log_level="warning")
    config.lifespan = "off"
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server did not start"
            threading.Event().wait(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def right_tries(url: str) -> list[int]:
    """The right credentials on each check, from this process (another user than the flood's)."""
    with httpx.Client(base_url=url, timeout=60, follow_redirects=False) as c:
        return [c.get("/v1/server", headers={"Authorization": f"Bearer {TOKEN}"}).status_code,
                c.get("/v2/sandboxes", headers={"X-API-KEY": TOKEN}).status_code,
                c.post("/console/login", data={"token": TOKEN}).status_code,
                c.get("/health", headers={"E2b-Sandbox-Id": SANDBOX,
                                          "X-Access-Token": envd_token(TOKEN, SANDBOX)}).status_code]


@pytest.mark.skipif(os.geteuid() != 0, reason="the flood runs as another user (nobody): the tests run as root")
def test_a_flood_of_wrong_tokens_spends_its_senders_budget_and_never_the_real_tokens(served: str) -> None:
    port = served.rsplit(":", 1)[1]
    flood = subprocess.Popen([sys.executable, "-I", "-S", "-c", FLOOD, port], user=NOBODY, group=NOBODY, cwd="/",
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None and flood.stdin is not None
        assert flood.stdout.readline().strip() == "spent"
        for _ in range(5):  # while the flood goes on: every check still opens to the right credentials
            assert right_tries(served) == [200, 200, 303, 502]
        flood.stdin.write(json.dumps({"token": TOKEN, "envd": envd_token(TOKEN, SANDBOX)}) + "\n")
        flood.stdin.flush()
        assert json.loads(flood.stdout.readline()) == [429, 429, 429, 429]  # refused unchecked: it learns nothing
        flood.stdin.write("stop\n")
        flood.stdin.flush()
        summary = json.loads(flood.stdout.readline())
        assert summary["sent"] > 0 and set(summary["seen"]) == {401, 429}
        assert right_tries(served) == [200, 200, 303, 502]
    finally:
        flood.kill()
        flood.wait()


def test_the_policy_servers_check_has_the_same_budget() -> None:
    engine = SimpleNamespace(tokenizer=load_tokenizer(), max_context=256, weight_version=0, metrics=dict)
    c = TestClient(frozen(policy_app(engine, TOKEN)))  # type: ignore[arg-type]
    statuses = [c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code
                for _ in range(authlimit.BURST + 2)]
    assert statuses == [401] * authlimit.BURST + [429, 429]
    refused = c.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})  # the same peer: refused unchecked
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1


def test_a_budget_is_its_peers_alone_and_refills_at_its_rate() -> None:
    now = [0.0]
    limit = authlimit.AuthFailures(rate=0.5, burst=3, peer=lambda client, server: ("address", client[0] if client else ""))
    limit.clock = lambda: now[0]
    a, b, server = ("a", 1), ("b", 1), ("s", 1)
    assert limit.judge(a, server, True, lambda: True)  # a right credential is never counted
    assert [limit.judge(a, server, True, lambda: False) for _ in range(3)] == [False] * 3
    with pytest.raises(authlimit.Spent) as e:
        limit.judge(a, server, True, lambda: pytest.fail("a spent budget's credential is never checked"))
    assert e.value.retry_after == 2.0 and e.value.seconds == 2
    assert limit.judge(b, server, True, lambda: True) and not limit.judge(b, server, True, lambda: False)
    assert not limit.judge(a, server, False, lambda: False)  # no credential sent: nothing to refuse nor count
    now[0] = 2.0  # one wrong try more every 1/rate seconds
    assert not limit.judge(a, server, True, lambda: False)
    with pytest.raises(authlimit.Spent):
        limit.judge(a, server, True, lambda: True)
    now[0] = 100.0  # refilled up to its burst, never past it
    assert [limit.judge(a, server, True, lambda: False) for _ in range(3)] == [False] * 3
    with pytest.raises(authlimit.Spent):
        limit.judge(a, server, True, lambda: True)


@pytest.mark.skipif(os.geteuid() != 0, reason="connects as another user (nobody): the tests run as root")
def test_a_peer_on_this_host_is_the_user_owning_its_socket_and_one_elsewhere_its_address() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = listener.getsockname()
        code = (f"import socket, sys; s = socket.create_connection(('127.0.0.1', {server[1]})); "
                "print(s.getsockname()[1], flush=True); sys.stdin.readline()")
        child = subprocess.Popen([sys.executable, "-I", "-S", "-c", code], user=NOBODY, group=NOBODY, cwd="/",
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            port = int(child.stdout.readline())
            theirs, _ = listener.accept()
            with theirs, socket.create_connection(server) as mine:
                ours, _ = listener.accept()
                with ours:
                    assert authlimit.peer_of(("127.0.0.1", port), server) == ("uid", NOBODY)
                    assert authlimit.peer_of(mine.getsockname(), server) == ("uid", os.getuid())
        finally:
            child.kill()
            child.wait()
    assert authlimit.peer_of(("192.0.2.7", 40000), server) == ("address", "192.0.2.7")  # no such socket here
    assert authlimit.peer_of(("testclient", 50000), ("testserver", 80)) == ("address", "testclient")
    assert authlimit.peer_of(None, None) == ("address", "")
