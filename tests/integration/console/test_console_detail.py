"""The console's sandbox page (processes, jobs, a job's tail, the file browser with the API's path rules, hostile
file names) and server page (its charts), in the real browser against a real server and real sandboxes (the
fixtures of ``test_console``). Screenshots to docs/console/ with AGENTENV_SCREENSHOTS=1."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import StaleElementReferenceException

from agentenv.api import JobEnd, JobOutput

from ..server_fixtures import TOKEN, wait_for
from .test_console import AUTH, By, attribute, browser, click, client, log_in, present, shot, text, url

pytestmark = pytest.mark.integration
__all__ = ["browser", "client", "url"]  # the module's fixtures, shared
HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def sb(client: Any) -> Iterator[Any]:
    s = client.Sandbox.create(memory="256m", labels={"suite": "console-detail"}, ttl=None)  # the module's: closed at its teardown, no deadline
    yield s
    s.close()


def points(browser: Any, css: str) -> int:
    """How many points the polyline ``css`` finds has (0 if none, or if a reading redrew it as it was read)."""
    try:
        found = browser.find_elements(By.CSS_SELECTOR, css)
        return len((found[0].get_attribute("points") or "").split()) if found else 0
    except StaleElementReferenceException:
        return 0


def refused(browser: Any, path: str) -> bool:
    """The file browser says ``path`` is refused: a 403 with the API's PermissionError."""
    error = browser.find_element(By.ID, "files-error")
    return bool(error.is_displayed() and error.get_attribute("data-status") == "403" and path in error.text
                and "PermissionError" in error.text)


def open_page(browser: Any, url: str, sb: Any) -> None:
    """Log in and follow the sandbox's link in the sandboxes table to its page."""
    log_in(browser, url, TOKEN)
    link = f'tr[data-id="{sb.id}"] td.id a'
    wait_for(lambda: present(browser, link), "the sandbox's link in the table")
    click(browser, link)
    wait_for(lambda: browser.current_url == f"{url}/console/sandbox/{sb.id}", "the sandbox's page")
    wait_for(lambda: attribute(browser, "body", "data-state") == "running",
             "the page saying the sandbox runs")


def test_a_jobs_output_shows_in_its_tail_and_stays_for_its_owner(browser, url, sb):
    proc = sb.spawn("sleep 600")
    job = sb.start("echo tail-marker-1; echo oops >&2")
    open_page(browser, url, sb)
    wait_for(lambda: present(browser, f'#processes tr[data-pid="{proc.pid}"]'), "the spawned process listed")
    assert "sleep 600" in text(browser, f'#processes tr[data-pid="{proc.pid}"]')
    wait_for(lambda: "0" in text(browser, f'#jobs tr[data-pid="{job.pid}"] td:nth-child(4)'), "the job's end")
    click(browser, f'button[data-tail="{job.pid}"]')
    wait_for(lambda: "tail-marker-1" in text(browser, "#tail span[data-stream=stdout]")
             and "oops" in text(browser, "#tail span[data-stream=stderr]"), "the job's output in the tail")
    assert "16.0 KiB" in text(browser, "#tail-title") and text(browser, "#tail-cap") == "16.0 KiB"  # the cap, said
    assert text(browser, "#list-cap") == "500" and text(browser, "#file-cap") == "256.0 KiB"
    # the page only looked: the owner still reads all of it, and the job's end
    got = list(sb.output(job.pid))
    assert b"".join(o.data for o in got if isinstance(o, JobOutput) and o.stream == "stdout") == b"tail-marker-1\n"
    assert isinstance(got[-1], JobEnd) and got[-1].exit_code == 0
    wait_for(lambda: not present(browser, f'#jobs tr[data-pid="{job.pid}"]'), "the delivered job leaving the list")
    # the page's buttons: pause (no processes to list then), resume (the spawned process is back)
    state = f"{url}/v1/sandboxes/{sb.id}"
    click(browser, '#actions button[data-action="pause"]')
    wait_for(lambda: httpx.get(state, headers=AUTH).json()["state"] == "paused", "the API saying paused", limit=60)
    wait_for(lambda: attribute(browser, "body", "data-state") == "paused"
             and not present(browser, "#processes tbody tr"), "the page saying paused, with no processes")
    click(browser, '#actions button[data-action="resume"]')
    wait_for(lambda: httpx.get(state, headers=AUTH).json()["state"] == "running", "the API saying running", limit=60)
    wait_for(lambda: present(browser, f'#processes tr[data-pid="{proc.pid}"]'), "the process listed again")


def browse(browser: Any, path: str) -> None:
    box = browser.find_element(By.ID, "path")
    box.clear()
    box.send_keys(path)
    browser.find_element(By.ID, "go").click()


def test_the_file_browser_shows_files_with_the_apis_rules(browser, url, sb):
    made = sb.exec(f"mkdir -p /tmp/br/sub && printf 'hello from exec\\n' > /tmp/br/notes.txt && touch '/tmp/br/{HOSTILE}'")
    assert made.ok, made.stderr
    job = sb.start("for i in 1 2 3; do echo step $i; done; sleep 600")
    open_page(browser, url, sb)
    browse(browser, "/tmp/br")
    names = "#files td.name a"
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, names)) == 3, "the folder's three entries")
    shown = [a.text for a in browser.find_elements(By.CSS_SELECTOR, names)]
    assert shown == ["sub/", HOSTILE, "notes.txt"]  # folders first; the hostile name as text
    assert not present(browser, "#files img")  # never markup
    click(browser, '#files a[data-path="/tmp/br/notes.txt"]')
    wait_for(lambda: text(browser, "#file") == "hello from exec", "the file's content")
    # the console's reads need its login, as its pages do
    assert httpx.get(f"{url}/console/api/sandboxes/{sb.id}/list", params={"path": "/tmp/br"}).status_code == 401
    # the agent's own folders: refused on the page as by the API (403)
    for own in ("/.agentenv", "/dev/agentenv"):
        assert httpx.get(f"{url}/v1/sandboxes/{sb.id}/list", params={"path": own}, headers=AUTH).status_code == 403
        browse(browser, own)
        wait_for(lambda own=own: refused(browser, own), f"the page refusing {own}")
        assert not present(browser, "#files tbody tr")
    browse(browser, "/tmp/br")
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, names)) == 3, "the folder again")
    click(browser, f'button[data-tail="{job.pid}"]')
    wait_for(lambda: "step 3" in text(browser, "#tail"), "the running job's tail")
    browser.set_window_size(1400, 1500)  # the whole page in its screenshot
    try:
        browser.execute_script("window.scrollTo(0, 0)")
        shot(browser, "sandbox")
    finally:
        browser.set_window_size(1400, 900)
    sb.signal(job.pid, 9)


def test_the_server_page_draws_its_charts(browser, url, client):
    assert httpx.get(f"{url}/console/api/server").status_code == 401  # the console's login, as every page
    log_in(browser, url, TOKEN)
    browser.get(f"{url}/console/server")
    s = client.Sandbox.create(memory="256m")
    snap = s.snapshot()
    try:
        store = 'figure[data-metric="store"]'
        wait_for(lambda: f"in {len(client.Snapshot.list())} snapshot" in text(browser, store + " .value")
                 and not text(browser, store + " .value").startswith("0 B"), "the store's size with the snapshot")
        for metric in ("admission", "warm", "store", "sandboxes", "memory"):
            line = f'figure[data-metric="{metric}"] svg polyline.s0'
            wait_for(lambda line=line: points(browser, line) >= 3, f"the {metric} chart's line over readings")
        assert "of 8" in text(browser, 'figure[data-metric="sandboxes"] .value')  # the server's max_sandboxes
        assert "off" in text(browser, 'figure[data-metric="warm"] .value')  # no warm pool on this server
        # the charts share the page's width, with round y ticks from 0 (bytes where they count bytes)
        width = browser.execute_script("return document.getElementById('charts').getBoundingClientRect().width")
        for svg in browser.find_elements(By.CSS_SELECTOR, "figure.chart svg"):
            assert float(svg.get_attribute("width")) > 0.4 * width
        ys = [float(t.get_attribute("data-value"))
              for t in browser.find_elements(By.CSS_SELECTOR, 'figure[data-metric="sandboxes"] text.tick.y')]
        assert len(ys) >= 3 and ys[0] == 0 and ys[-1] >= 8, ys  # up to the limit, 8 sandboxes
        store_ticks = [t.text for t in browser.find_elements(By.CSS_SELECTOR, store + " text.tick.y")]
        assert store_ticks[0] == "0 B" and store_ticks[-1].endswith("B"), store_ticks
        shot(browser, "server")
    finally:
        s.close()
        snap.delete()


def test_the_files_list_at_once_and_the_tail_follows_the_newest_line(browser, url, sb):
    job = sb.start("seq 1 3000; sleep 600")
    open_page(browser, url, sb)
    # the root is listed as the page opens, before anyone presses "open"
    wait_for(lambda: present(browser, '#files a[data-path="/tmp"]'), "the root's entries without asking")
    click(browser, f'button[data-tail="{job.pid}"]')
    wait_for(lambda: "3000" in text(browser, "#tail"), "the job's last line")

    def at_bottom() -> bool:
        return bool(browser.execute_script("const p = document.getElementById('tail');"
                                           "return p.scrollHeight > p.clientHeight"
                                           " && p.scrollTop + p.clientHeight >= p.scrollHeight - 4"))

    wait_for(at_bottom, "the tail scrolled to its newest line")
    sb.signal(job.pid, 9)
