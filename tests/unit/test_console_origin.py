"""Cross-site requests against the web console and the API docs page (issue 40, finding 10), without sandboxes.

To a browser every port of 127.0.0.1 is one *site*: a page served on another port (``agentenv view`` on 8701, a
sandbox's port, any local web app) is same-site, so the console's SameSite=Strict cookie rides along on its
requests. Only the full origin (scheme, host and port) tells the console's own page from such a page, so every
request that changes state (login, logout, the sandbox actions) must come from that origin, whichever way the
browser says where it came from (``Origin``, ``Sec-Fetch-Site``, ``Referer``). The docs page must not run a
script from elsewhere on the console's origin (Swagger UI from a CDN, which could read the console's state)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from agentenv.server import console, create_app
from policy.server import create_app as policy_app
from policy.tokenizer import load_tokenizer

TOKEN = "origin-test-token-" + "w" * 20
OWN = "http://127.0.0.1:8700"
OTHER = "http://127.0.0.1:8701"  # another port of the same host: the same site, another origin
# how a browser says a request came from another origin, one way at a time (no Origin at all in the last three)
CROSS = ({"Origin": OTHER}, {"Origin": "https://127.0.0.1:8700"}, {"Origin": "http://localhost:8700"},
         {"Origin": "null"}, {"Referer": OTHER + "/console/runs"}, {"Sec-Fetch-Site": "same-site"},
         {"Sec-Fetch-Site": "cross-site"})


@pytest.fixture()
def client(tmp_path, monkeypatch) -> Iterator[TestClient]:
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    yield TestClient(create_app(TOKEN, e2b=True), base_url=OWN, follow_redirects=False)  # no lifespan: no Docker


def log_in(client: TestClient) -> None:
    client.cookies.clear()
    assert client.post("/console/login", data={"token": TOKEN}).status_code == 303


def logged_in(client: TestClient) -> bool:
    return client.get("/console/").status_code == 200  # the page itself (a redirect to the login page when not)


def test_a_cross_site_logout_leaves_the_session_open(client: TestClient) -> None:
    log_in(client)
    for headers in CROSS:
        r = client.post("/console/logout", headers=headers)
        assert r.status_code == 403, (headers, r.status_code)
        assert logged_in(client), headers


def test_a_cross_site_login_sets_no_cookie(client: TestClient) -> None:
    for headers in CROSS:
        client.cookies.clear()
        r = client.post("/console/login", data={"token": TOKEN}, headers=headers)
        assert r.status_code == 403 and "set-cookie" not in r.headers, headers
        assert not logged_in(client)


def test_a_cross_site_action_is_refused_before_it_reaches_the_sandbox(client: TestClient) -> None:
    log_in(client)
    for headers in CROSS:
        r = client.post("/console/api/sandboxes/sb-x/close", headers={console.ACTION_HEADER: "1", **headers})
        assert r.status_code == 403 and r.json()["error"] == "Forbidden", (headers, r.text)


def policy_client() -> TestClient:
    engine = SimpleNamespace(tokenizer=load_tokenizer(), max_context=256, weight_version=0, metrics=dict)
    return TestClient(policy_app(engine, TOKEN))  # type: ignore[arg-type]


def test_no_docs_page_runs_a_script_from_elsewhere_and_the_spec_is_still_served(client: TestClient) -> None:
    for c in (client, policy_client()):
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            r = c.get(path)
            assert r.status_code == 404 and "<script" not in r.text, (path, r.text[:200])
        spec = c.get("/openapi.json")
        assert spec.status_code == 200 and spec.json()["paths"]


def test_the_consoles_own_page_still_logs_in_acts_and_logs_out(client: TestClient) -> None:
    """What the console's own page sends (its origin, or Origin null beside Sec-Fetch-Site same-origin under its
    no-referrer policy), and what a client that is no browser sends (nothing of the kind), are its own."""
    own = ({"Origin": OWN}, {"Origin": "null", "Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "same-origin"},
           {"Origin": "http://127.0.0.1", "Host": "127.0.0.1:80"}, {})
    for headers in own:
        client.cookies.clear()
        assert client.post("/console/login", data={"token": TOKEN}, headers=headers).status_code == 303, headers
        r = client.post("/console/api/sandboxes/sb-x/close", headers={console.ACTION_HEADER: "1", **headers})
        assert r.status_code == 404 and r.json()["error"] == "SandboxNotFound", headers  # past the check: the API's
        assert client.post("/console/logout", headers=headers).status_code == 303
        assert not logged_in(client)
