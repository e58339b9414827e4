"""The console's fork tree in the real browser against a real server and real sandboxes (the fixtures of
``test_console``): three generations nested under one another, folded and unfolded, each node a link, and a
snapshot restored and deleted from the page, each after a confirmation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentenv.errors import SandboxNotFound, SnapshotNotFound

from ..server_fixtures import TOKEN, wait_for
from .test_console import AUTH, attribute, browser, click, client, log_in, present, text, url

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


def test_a_snapshot_is_restored_and_deleted_after_asking(browser, url, client, family):
    s2 = family["snap2"]
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
    finally:
        client.Sandbox.get(new).close()
    click(browser, '#snap-actions button[data-action="delete"]')
    browser.switch_to.alert.dismiss()
    assert httpx.get(f"{url}/v1/snapshots/{s2.id}", headers=AUTH).status_code == 200
    click(browser, '#snap-actions button[data-action="delete"]')
    browser.switch_to.alert.accept()
    wait_for(lambda: httpx.get(f"{url}/v1/snapshots/{s2.id}", headers=AUTH).status_code == 404, "the snapshot deleted")
    # the grandchild still names it: drawn as deleted, and the panel says so
    wait_for(lambda: attribute(browser, "#snapshot", "data-state") == "deleted"
             and present(browser, f'{sel("snapshot", s2.id)} > .node.gone'), "the snapshot shown as deleted")
