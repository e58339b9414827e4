"""The web console's login and its cookie, without sandboxes: what the cookie is, what it opens and what it does not
(the browser tests in tests/integration/console drive the pages themselves)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from agentenv.server import console, console_auth, create_app

TOKEN = "console-test-token-" + "y" * 20


@pytest.fixture()
def client() -> Iterator[TestClient]:
    # no lifespan: these routes touch no sandbox, so no Docker is needed
    yield TestClient(create_app(TOKEN, e2b=False), base_url="http://127.0.0.1:8700", follow_redirects=False)


def logged_in(client: TestClient) -> str:
    r = client.post("/console/login", data={"token": TOKEN})
    assert r.status_code == 303 and r.headers["location"] == "/console/"
    return r.headers["set-cookie"]


def test_a_right_token_sets_a_session_cookie_that_is_not_the_token(client):
    header = logged_in(client)
    name, _, rest = header.partition("=")
    value = rest.split(";")[0]
    assert name == console_auth.COOKIE and len(value) >= 32 and TOKEN not in value
    flags = {f.strip().lower() for f in header.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/console"} <= flags
    assert client.get("/console/").status_code == 200


def test_wrong_or_missing_tokens_are_refused(client):
    for body in ({"token": TOKEN + "x"}, {"token": ""}, {}):
        r = client.post("/console/login", data=body)
        assert r.status_code == 401 and "set-cookie" not in r.headers
        assert '<p id="error">' in r.text
    assert client.get("/console/").headers["location"] == "/console/login"
    assert client.get("/console/api/state").status_code == 401
    assert client.get("/console/api/events").status_code == 401
    assert client.post("/console/api/sandboxes/sb-x/pause", headers={console.ACTION_HEADER: "1"}).status_code == 401


def test_the_cookie_opens_no_api_route(client):
    cookie = logged_in(client).split(";")[0]  # sent by hand: a browser would not send it outside /console at all
    for path in ("/v1/server", "/v1/sandboxes", "/v1/snapshots"):
        r = client.get(path, headers={"Cookie": cookie})
        assert r.status_code == 401 and r.json()["error"] == "Unauthorized"


def test_an_action_needs_the_console_header_and_its_origin(client):
    logged_in(client)
    path = "/console/api/sandboxes/sb-x/pause"
    assert client.post(path).status_code == 403
    assert client.post(path, headers={console.ACTION_HEADER: "1", "Origin": "http://evil.test"}).status_code == 403
    assert client.post("/console/api/sandboxes/sb-x/explode", headers={console.ACTION_HEADER: "1"}).status_code == 422
    assert client.post("/console/api/sandboxes/..%2Fetc/pause", headers={console.ACTION_HEADER: "1"}).status_code in (
        404, 422)


def test_logout_ends_the_session(client):
    logged_in(client)
    assert client.post("/console/logout").status_code == 303
    assert client.get("/console/api/state").status_code == 401


def test_static_serves_the_packaged_scripts_only(client):
    r = client.get("/console/static/console.js")
    assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    for name in ("login.html", "..%2F..%2Fconsole.py", "nope.js"):
        assert client.get(f"/console/static/{name}").status_code == 404
    assert client.get("/console/nope").status_code == 404
    assert "frame-ancestors 'none'" in client.get("/console/login").headers["content-security-policy"]


def test_the_sandbox_and_server_pages_and_their_reads_need_the_login(client):
    reads = ("/console/api/server", "/console/api/sandboxes/sb-x", "/console/api/sandboxes/sb-x/jobs/5/tail",
             "/console/api/sandboxes/sb-x/list?path=/", "/console/api/sandboxes/sb-x/file?path=/etc/hostname")
    for path in reads:
        r = client.get(path)
        assert r.status_code == 401 and r.json()["error"] == "Unauthorized", path
    for page in ("/console/server", "/console/sandbox/sb-x"):
        r = client.get(page)
        assert r.status_code == 303 and r.headers["location"] == "/console/login", page
    logged_in(client)
    for page in ("/console/server", "/console/sandbox/sb-x"):
        r = client.get(page)
        assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"], page
    assert client.get("/console/static/detail.js").status_code == 200
    assert client.get("/console/api/server").json() == {"history": []}  # nothing read yet: no page streamed
    assert client.get("/console/api/sandboxes/sb-x/list?path=a%00b").status_code == 422  # the API's path rules


def test_the_nav_links_what_other_packages_added_and_nothing_else():
    def runs(app):
        app.state.console_links = [("/console/runs", "Runs"), ("/console/x?a=<b>", "<i>")]

    plain = TestClient(create_app(TOKEN, e2b=False), base_url="http://127.0.0.1:8700", follow_redirects=False)
    added = TestClient(create_app(TOKEN, e2b=False, pages=[runs]), base_url="http://127.0.0.1:8700",
                       follow_redirects=False)
    for c in (plain, added):
        logged_in(c)
    for path in ("/console/", "/console/snapshots", "/console/server", "/console/sandbox/sb-x"):
        assert "/console/runs" not in plain.get(path).text
        text = added.get(path).text
        assert 'Server</a> <a href="/console/runs">Runs</a>' in text  # after the console's own
        assert "&lt;i&gt;" in text and "<i>" not in text  # labels and paths are escaped
