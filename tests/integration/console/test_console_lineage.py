"""The console's lineage in the real browser against a real server and real sandboxes (the fixtures of
``test_console``): the fork tree's three generations nested under one another, folded and unfolded, each node a
link; forks of forks nested under the sandbox each was forked from; a snapshot restored and deleted from the page,
each after a confirmation; a sandbox page's lineage (the sandbox it is a fork of among it) and labels; an E2B sandbox
shown by its template."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentenv.errors import SandboxNotFound, SnapshotNotFound

from ..server_fixtures import TOKEN, wait_for
from .test_console import (
    AUTH,
    By,
    attribute,
    browser,
    click,
    client,
    displayed,
    log_in,
    present,
    shot,
    text,
    url,
)

pytestmark = pytest.mark.integration
__all__ = ["browser", "client", "url"]  # the module's fixtures, shared


def sel(kind: str, item_id: str) -> str:
    return f'li[data-kind="{kind}"][data-id="{item_id}"]'


@pytest.fixture(scope="module")
def family(client: Any) -> Iterator[dict[str, Any]]:
    """A sandbox, a snapshot of it, a sandbox restored from that, its own snapshot, and one restored from that."""
    made: dict[str, Any] = {}
    try:
        made["parent"] = client.Sandbox.create(memory="256m", labels={"gen": "0"})
        made["snap"] = made["parent"].snapshot()
        made["child"] = client.Sandbox.restore(made["snap"].id, labels={"gen": "1"})
        made["snap2"] = made["child"].snapshot()
        made["grandchild"] = client.Sandbox.restore(made["snap2"].id, labels={"gen": "2"})
        yield made
    finally:
        for name in ("grandchild", "child", "parent"):
            if name in made:
                with contextlib.suppress(SandboxNotFound):
                    made[name].close()
        for name in ("snap2", "snap"):
            if name in made:
                with contextlib.suppress(SnapshotNotFound):
                    made[name].delete()


def test_generations_nest_fold_and_link(browser, url, family):
    p, s, k, s2, g = (family[n] for n in ("parent", "snap", "child", "snap2", "grandchild"))
    log_in(browser, url, TOKEN)
    browser.get(f"{url}/console/snapshots")
    chain = " > ul > ".join([sel("sandbox", p.id), sel("snapshot", s.id), sel("sandbox", k.id),
                             sel("snapshot", s2.id), sel("sandbox", g.id)])
    wait_for(lambda: present(browser, chain), "each generation nested under its parent, the grandchild's snapshot "
             "under the sandbox it was taken from")
    assert "E2B" not in text(browser, sel("sandbox", p.id))
    # folding a snapshot hides what is under it
    click(browser, f'{sel("snapshot", s.id)} > button.toggle')
    wait_for(lambda: attribute(browser, sel("snapshot", s.id), "data-open") == "false"
             and not present(browser, sel("sandbox", k.id)), "the snapshot folded")
    assert "(1 below)" in text(browser, sel("snapshot", s.id))
    click(browser, f'{sel("snapshot", s.id)} > button.toggle')
    wait_for(lambda: present(browser, chain), "unfolded again")
    # a sandbox's id opens its page
    click(browser, f'{sel("sandbox", k.id)} > .node a')
    wait_for(lambda: browser.current_url == f"{url}/console/sandbox/{k.id}", "the child's page")


def test_forks_of_forks_nest_under_the_sandbox_each_was_forked_from(browser, url, client, family):
    """A fork's children hang under the sandbox they were forked from (through the fork's own snapshot, deleted once
    they run), grandchildren under them; before ``forked_from`` the fork's snapshot was a root of its own."""
    kids: list[Any] = []
    p = client.Sandbox.create(memory="256m", labels={"fork": "0"})
    try:
        kids += p.fork(1)  # processes too: through a snapshot of p
        k = kids[0]
        kids += k.fork(1, memory=False)  # files only: a clone of k's layer where the volume can, else a snapshot
        g = kids[1]
        body = httpx.get(f"{url}/v1/sandboxes/{g.id}", headers=AUTH).json()
        assert (k.forked_from, g.forked_from, body["forked_from"]) == (p.id, k.id, k.id)
        assert p.forked_from is None and family["child"].info().forked_from is None  # created; restored
        log_in(browser, url, TOKEN)
        browser.get(f"{url}/console/snapshots")

        def via(kid: Any, parent: Any) -> str:  # through the fork's snapshot, or none where no snapshot came between
            return f"{sel('snapshot', kid.parent_snapshot)} > ul > " if kid.parent_snapshot != parent.parent_snapshot else ""

        chain = (f"{sel('sandbox', p.id)} > ul > {via(k, p)}{sel('sandbox', k.id)} > ul > {via(g, k)}"
                 f"{sel('sandbox', g.id)}")
        wait_for(lambda: present(browser, chain), "the grandchild under the child under the sandbox they came of")
        browser.get(f"{url}/console/sandbox/{g.id}")
        link = f'#from a[data-kind="sandbox"][data-id="{k.id}"]'
        wait_for(lambda: present(browser, link) and text(browser, "#from").startswith(f"forked from sandbox {k.id}"),
                 "the grandchild's page linking the sandbox it was forked from")
        click(browser, link)
        wait_for(lambda: browser.current_url == f"{url}/console/sandbox/{k.id}", "the child's page")
        wait_for(lambda: present(browser, f'#from a[data-kind="sandbox"][data-id="{p.id}"]')
                 and present(browser, f'#children a[data-kind="sandbox"][data-id="{g.id}"]'),
                 "the child's page: forked from the parent, its own fork below")
    finally:
        for sb in [*reversed(kids), p]:
            with contextlib.suppress(SandboxNotFound):
                sb.close()


def test_a_snapshot_is_restored_and_deleted_after_asking(browser, url, client, family):
    s2 = family["grandchild"].snapshot()  # its own: the family stays whole for the other tests
    try:
        restore_and_delete(browser, url, client, family, s2)
    finally:
        with contextlib.suppress(SnapshotNotFound):
            s2.delete()


def restore_and_delete(browser: Any, url: str, client: Any, family: dict[str, Any], s2: Any) -> None:
    log_in(browser, url, TOKEN)
    browser.get(f"{url}/console/snapshots")
    link = f'{sel("snapshot", s2.id)} > .node a'
    wait_for(lambda: present(browser, link), "the snapshot's node")
    click(browser, link)
    wait_for(lambda: text(browser, "#snap-id") == s2.id and "files only" in text(browser, "#snap-facts"),
             "the snapshot shown with its buttons")

    def restored() -> list[str]:  # the sandboxes on the server besides the family's
        ours = {family[n].id for n in ("parent", "child", "grandchild")}
        return [b["id"] for b in httpx.get(f"{url}/v1/sandboxes", headers=AUTH).json() if b["id"] not in ours]

    click(browser, '#snap-actions button[data-action="restore"]')
    browser.switch_to.alert.dismiss()  # asked first: no is no
    assert restored() == []
    click(browser, '#snap-actions button[data-action="restore"]')
    browser.switch_to.alert.accept()
    wait_for(lambda: len(restored()) == 1, "a sandbox restored from the snapshot", limit=60)
    (new,) = restored()
    try:
        wait_for(lambda: present(browser, f'{sel("snapshot", s2.id)} > ul > {sel("sandbox", new)}'),
                 "the restored sandbox under its snapshot")
        assert new in text(browser, "#status")
        shot(browser, "snapshots-tree")
    finally:
        client.Sandbox.get(new).close()
    click(browser, '#snap-actions button[data-action="delete"]')
    browser.switch_to.alert.dismiss()
    assert httpx.get(f"{url}/v1/snapshots/{s2.id}", headers=AUTH).status_code == 200
    click(browser, '#snap-actions button[data-action="delete"]')
    browser.switch_to.alert.accept()
    wait_for(lambda: httpx.get(f"{url}/v1/snapshots/{s2.id}", headers=AUTH).status_code == 404, "the snapshot deleted")
    wait_for(lambda: attribute(browser, "#snapshot", "data-state") == "deleted"
             and not present(browser, sel("snapshot", s2.id)), "the snapshot gone from the tree, the panel saying so")


def test_a_sandbox_page_shows_its_lineage_and_labels(browser, url, family):
    p, s, k, s2, g = (family[n] for n in ("parent", "snap", "child", "snap2", "grandchild"))
    log_in(browser, url, TOKEN)
    browser.get(f"{url}/console/sandbox/{k.id}")
    wait_for(lambda: present(browser, f'#from a[data-kind="snapshot"][data-id="{s.id}"]')
             and present(browser, f'#from a[data-kind="sandbox"][data-id="{p.id}"]'), "where it came from")
    wait_for(lambda: present(browser, f'#children a[data-id="{s2.id}"]')
             and present(browser, f'#children a[data-kind="sandbox"][data-id="{g.id}"]'), "what came of it")
    assert text(browser, "#labels") == "gen=1"
    click(browser, f'#children a[data-id="{g.id}"]')
    wait_for(lambda: browser.current_url == f"{url}/console/sandbox/{g.id}", "the grandchild's page")
    wait_for(lambda: present(browser, f'#from a[data-id="{s2.id}"]') and text(browser, "#no-children") == "none",
             "the grandchild's lineage")


def test_an_e2b_sandbox_shows_its_template_not_its_image(browser, url, client):
    sb = client.Sandbox.create(memory="256m", labels={"e2b.template": "code-interpreter-v1"})
    try:
        log_in(browser, url, TOKEN)
        row = f'tr[data-id="{sb.id}"]'
        wait_for(lambda: "E2B template code-interpreter-v1" in text(browser, row), "the template in its row")
        assert sb.info().image not in text(browser, f"{row} td:nth-child(3)")
        browser.get(f"{url}/console/sandbox/{sb.id}")
        wait_for(lambda: text(browser, "#summary").startswith("E2B template code-interpreter-v1"), "its page")
    finally:
        sb.close()


def test_every_page_has_the_same_top_bar(browser, url, family):
    log_in(browser, url, TOKEN)
    bars = {}
    for path, here in (("/console/", "Sandboxes"), ("/console/snapshots", "Snapshots"), ("/console/server", "Server"),
                       (f"/console/sandbox/{family['child'].id}", "Sandboxes")):
        browser.get(url + path)
        wait_for(lambda: attribute(browser, "#live", "data-state") == "live", f"{path} live")
        assert [a.text for a in browser.find_elements(By.CSS_SELECTOR, "nav > a.here")] == [here], path
        assert displayed(browser, "#live") and displayed(browser, "#logout"), path
        bars[path] = browser.execute_script("const n = document.querySelector('nav').cloneNode(true);"
                                            "n.querySelectorAll('.here').forEach(a => a.removeAttribute('class'));"
                                            "return n.innerHTML")
    assert len(set(bars.values())) == 1, bars
