"""The web console in a real browser (headless Chromium through Debian's chromedriver) against a real server and
real sandboxes: its login, the live sandboxes table, the fork tree, an action, and what its cookie does not open.
Each page's screenshot goes to docs/console/ with AGENTENV_SCREENSHOTS=1."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import agentenv
from agentenv.errors import SandboxNotFound

from ..server_fixtures import TOKEN, threaded_server, wait_for

pytestmark = pytest.mark.integration
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
DOCS_SHOTS = Path(__file__).resolve().parents[3] / "docs" / "console"
# the docs' screenshots are retaken with AGENTENV_SCREENSHOTS=1; otherwise they go to a scratch folder (a test run
# leaves the checkout as it was)
SHOTS = DOCS_SHOTS if os.environ.get("AGENTENV_SCREENSHOTS") == "1" else \
    Path(tempfile.gettempdir()) / "agentenv-console-shots"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)) and not os.environ.get("CI"):
    pytest.skip("the console's browser tests need chromium and chromium-driver (apt-get install chromium "
                "chromium-driver, as scripts/bootstrap.sh does); in CI they always run", allow_module_level=True)

from selenium import webdriver  # noqa: E402 - only once the browser is known to be there
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service as DriverService  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with threaded_server(max_sandboxes=8) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[Any]:
    c = agentenv.connect(url, TOKEN)
    yield c
    c.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    """One headless Chromium for the module, on Debian's chromedriver (Selenium Manager never runs)."""
    profile = tempfile.mkdtemp(prefix="agentenv-console-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,900", f"--user-data-dir={profile}", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=DriverService(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def log_in(browser: webdriver.Chrome, url: str, token: str) -> None:
    browser.delete_all_cookies()
    browser.get(f"{url}/console/")
    assert browser.current_url == f"{url}/console/login", "the console let a visitor in without logging in"
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.ID, "submit").click()
    if token == TOKEN:  # the console's page once the login's reply came (else a next get() would cut it short)
        wait_for(lambda: browser.current_url == f"{url}/console/", "the console after logging in")


def present(browser: webdriver.Chrome, css: str) -> bool:
    return bool(browser.find_elements(By.CSS_SELECTOR, css))


def attribute(browser: webdriver.Chrome, css: str, name: str) -> str | None:
    """An attribute of what ``css`` finds (None if nothing, or if the page was replaced or redrew it meanwhile)."""
    try:
        found = browser.find_elements(By.CSS_SELECTOR, css)
        return found[0].get_attribute(name) if found else None
    except StaleElementReferenceException:
        return None


def displayed(browser: webdriver.Chrome, css: str) -> bool:
    """Whether what ``css`` finds is shown (False while a navigation replaces the page under the lookup)."""
    try:
        found = browser.find_elements(By.CSS_SELECTOR, css)
        return bool(found) and found[0].is_displayed()
    except StaleElementReferenceException:
        return False


def text(browser: webdriver.Chrome, css: str) -> str:
    """The text of what ``css`` finds ("" if nothing, or if a reading redrew it as it was read)."""
    try:
        found = browser.find_elements(By.CSS_SELECTOR, css)
        return found[0].text if found else ""
    except StaleElementReferenceException:
        return ""


def shot(browser: webdriver.Chrome, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(SHOTS / f"{name}.png"))


def test_login_refused_without_and_with_a_wrong_token(browser, url):
    r = httpx.get(f"{url}/console/api/state")
    assert r.status_code == 401 and r.json()["error"] == "Unauthorized"
    r = httpx.get(f"{url}/console/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/login"
    assert httpx.post(f"{url}/console/login", data={"token": ""}).status_code == 401
    log_in(browser, url, TOKEN + "-wrong")
    wait_for(lambda: displayed(browser, "#error"), "the login page saying the token is wrong")
    shot(browser, "login")
    assert browser.get_cookies() == []
    browser.get(f"{url}/console/")
    assert browser.current_url == f"{url}/console/login"


def test_the_cookie_opens_the_console_only(browser, url):
    log_in(browser, url, TOKEN)
    (cookie,) = browser.get_cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert TOKEN not in cookie["value"]
    jar = {cookie["name"]: cookie["value"]}
    assert httpx.get(f"{url}/console/api/state", cookies=jar).status_code == 200
    assert httpx.get(f"{url}/v1/sandboxes", cookies=jar).status_code == 401  # never the API
    # an action needs the console's header, and a cross-site Origin is refused even with it
    r = httpx.post(f"{url}/console/api/sandboxes/sb-none/pause", cookies=jar)
    assert r.status_code == 403
    r = httpx.post(f"{url}/console/api/sandboxes/sb-none/pause", cookies=jar,
                   headers={"X-Agentenv-Console": "1", "Origin": "http://evil.test"})
    assert r.status_code == 403
    r = httpx.post(f"{url}/console/api/sandboxes/sb-none/pause", cookies=jar, headers={"X-Agentenv-Console": "1"})
    assert r.status_code == 404 and r.json()["error"] == "SandboxNotFound"  # the API's own check and error


def test_a_sandbox_appears_and_disappears_live(browser, url, client):
    log_in(browser, url, TOKEN)
    wait_for(lambda: attribute(browser, "#live", "data-state") == "live", "the event stream")
    sb = client.Sandbox.create(memory="256m", labels={"team": "<b>rl</b>"})
    row = f'tr[data-id="{sb.id}"]'
    try:
        wait_for(lambda: present(browser, row + '[data-state="running"]'), "the new sandbox's row")
        wait_for(lambda: "MiB" in text(browser, row + " td.mem") and "%" in text(browser, row + " td.cpu"),
                 "its CPU and memory")
        wait_for(lambda: text(browser, row + " td.labels") == "team=<b>rl</b>", "its labels, as text")
        assert not present(browser, row + " td.labels b")  # never as markup
        shot(browser, "sandboxes")
    finally:
        sb.close()
    wait_for(lambda: not present(browser, row), "the closed sandbox's row going away")


def click(browser: webdriver.Chrome, css: str) -> None:
    """Click what ``css`` finds, again if the row was redrawn between finding and clicking it."""
    def once() -> bool:
        try:
            browser.find_element(By.CSS_SELECTOR, css).click()
            return True
        except StaleElementReferenceException:
            return False
    wait_for(once, f"a click on {css}")


def test_pause_and_close_from_the_page(browser, url, client):
    log_in(browser, url, TOKEN)
    sb = client.Sandbox.create(memory="256m")
    row = f'tr[data-id="{sb.id}"]'
    try:
        wait_for(lambda: present(browser, row + '[data-state="running"] button[data-action="pause"]'), "its row")
        click(browser, row + ' button[data-action="pause"]')
        wait_for(lambda: httpx.get(f"{url}/v1/sandboxes/{sb.id}", headers=AUTH).json()["state"] == "paused",
                 "the API saying the sandbox is paused", limit=60)
        wait_for(lambda: present(browser, row + '[data-state="paused"]'), "the row saying paused")
        assert "paused" in browser.find_element(By.ID, "status").text
        click(browser, row + ' button[data-action="close"]')
        browser.switch_to.alert.dismiss()  # close asks first: saying no keeps it
        assert httpx.get(f"{url}/v1/sandboxes/{sb.id}", headers=AUTH).json()["state"] == "paused"
        click(browser, row + ' button[data-action="close"]')
        browser.switch_to.alert.accept()
        wait_for(lambda: httpx.get(f"{url}/v1/sandboxes/{sb.id}", headers=AUTH).status_code == 404,
                 "the API saying the sandbox is gone")
        wait_for(lambda: not present(browser, row), "its row going away")
    finally:
        with contextlib.suppress(SandboxNotFound):
            sb.close()


def test_a_fork_shows_as_two_children_of_one_snapshot(browser, url, client):
    log_in(browser, url, TOKEN)
    browser.get(f"{url}/console/snapshots")
    parent = client.Sandbox.create(memory="256m")
    kids = []
    try:
        snap = parent.snapshot()
        kids = [client.Sandbox.restore(snap.id) for _ in range(2)]  # a fork group: two children of one snapshot
        node = f'li[data-kind="snapshot"][data-id="{snap.id}"]'
        wait_for(lambda: all(present(browser, f'{node} > ul > li[data-kind="sandbox"][data-id="{k.id}"]')
                             for k in kids), "both children under their snapshot")
        # the snapshot hangs under the sandbox it was taken from
        assert present(browser, f'li[data-kind="sandbox"][data-id="{parent.id}"] > ul > {node}')
        forked = parent.fork(2)  # a memory fork: its own snapshot is deleted once the children run
        kids += forked
        jar = {c["name"]: c["value"] for c in browser.get_cookies()}
        rows: dict[str, Any] = {}

        def listed() -> bool:  # the console's readings are shared: wait for one taken after the fork
            rows.update({r["id"]: r for r in httpx.get(f"{url}/console/api/state", cookies=jar).json()["sandboxes"]})
            return all(k.id in rows for k in forked)

        wait_for(listed, "the fork's children in the console's reading")
        (fork_snap,) = {rows[k.id]["parent_snapshot"] for k in forked}
        assert fork_snap is not None
        group = f'li[data-kind="snapshot"][data-id="{fork_snap}"]'
        wait_for(lambda: all(present(browser, f'{group} > ul > li[data-id="{k.id}"]') for k in forked),
                 "the fork's two children under the fork's snapshot")
        shot(browser, "snapshots")
    finally:
        for k in kids:
            k.close()
        parent.close()
        if "snap" in locals():
            snap.delete()


@contextlib.contextmanager
def page_elsewhere(html: str) -> Iterator[str]:
    """``html`` served on another port of 127.0.0.1: to the browser the console's own site, another origin."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_on_another_port_cannot_log_the_console_out(browser, url):
    """Every port of 127.0.0.1 is one site, so Chromium sends the SameSite=Strict cookie with a form that a page on
    another port posts to the console: the console must refuse it by its origin, and its own button must still work."""
    log_in(browser, url, TOKEN)
    attack = (f'<form id="f" method="post" action="{url}/console/logout"></form>'
              '<script>document.getElementById("f").submit()</script>')
    with page_elsewhere(attack) as elsewhere:
        browser.get(elsewhere)
        wait_for(lambda: browser.current_url.startswith(f"{url}/console/"), "the attacking form's post")
    assert browser.current_url == f"{url}/console/logout" and "Forbidden" in browser.page_source
    browser.get(f"{url}/console/")
    assert browser.current_url == f"{url}/console/", "a page on another port logged the console out"
    click(browser, "#logout")  # the console's own form: the same origin
    wait_for(lambda: browser.current_url == f"{url}/console/login", "the login page after logging out")
    browser.get(f"{url}/console/")
    assert browser.current_url == f"{url}/console/login" and browser.get_cookies() == []
