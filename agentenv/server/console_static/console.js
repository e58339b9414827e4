// The agentenv console's pages: one event stream (/console/api/events) feeds the sandboxes table or the snapshot
// tree. Everything a sandbox or a client named (labels, images) is set as text, never as HTML.
"use strict";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function age(seconds) {
  seconds = Math.max(0, Math.floor(seconds));
  if (seconds < 60) return seconds + " s";
  if (seconds < 3600) return Math.floor(seconds / 60) + " min";
  if (seconds < 86400) return Math.floor(seconds / 3600) + " h " + Math.floor(seconds % 3600 / 60) + " min";
  return Math.floor(seconds / 86400) + " d";
}

function say(text, isError) {
  const status = document.getElementById("status");
  if (!status) return;
  status.textContent = text;
  status.className = isError ? "error" : "";
}

// what each action says once done, and the question it asks first (the ones that lose or make something)
const DONE = { pause: "paused ", resume: "resumed ", fork: "forked into ", snapshot: "snapshot ", close: "closed ",
  restore: "restored into ", delete: "deleted " };
const ASK = {
  close: (id) => "Close sandbox " + id + "? Its state is lost.",
  restore: (id) => "Restore snapshot " + id + " into a new sandbox?",
  delete: (id) => "Delete snapshot " + id + "? Nothing can be restored from it afterwards.",
};

// an action on a sandbox (what = "sandboxes") or a snapshot ("snapshots"), through the console's action route
async function act(id, action, what) {
  if (ASK[action] && !window.confirm(ASK[action](id))) return;
  say(action + " " + id + "…");
  const reply = await fetch("/console/api/" + (what || "sandboxes") + "/" + encodeURIComponent(id) + "/" + action,
    { method: "POST", headers: { "X-Agentenv-Console": "1" }, credentials: "same-origin" });
  let body = null;
  try { body = await reply.json(); } catch (e) { body = null; }
  if (reply.status === 401) { window.location.assign("/console/login"); return; }
  if (!reply.ok) {
    say(action + " " + id + " failed: " + (body && body.message ? body.message : reply.status), true);
    return;
  }
  const made = Array.isArray(body) ? body.map((k) => k.id).join(", ") : (body && body.id) || id;
  say(DONE[action] + made);
}

const BUTTONS = {
  running: ["pause", "fork", "snapshot", "close"],
  paused: ["resume", "fork", "close"],
};

function sandboxRow(sb, now) {
  const labels = el("td", { class: "labels" });
  for (const [k, v] of Object.entries(sb.labels || {})) labels.append(el("span", { class: "label" }, k + "=" + v));
  const actions = el("td", { class: "actions" });
  for (const action of BUTTONS[sb.state] || ["close"]) {
    actions.append(el("button", { type: "button", "data-action": action }, action));
  }
  const limits = sb.limits || {};
  const cpu = sb.cpu_pct === null ? "–" : sb.cpu_pct + " %";
  return el("tr", { "data-id": sb.id, "data-state": sb.state },
    el("td", { class: "id" }, el("a", { href: "/console/sandbox/" + encodeURIComponent(sb.id) }, sb.id)),
    el("td", {}, el("span", { class: "state " + sb.state }, sb.state)),
    el("td", {}, imageOf(sb)),
    el("td", {}, age(now - sb.created_at)),
    el("td", { class: "cpu" }, cpu + " of " + limits.cpus),
    el("td", { class: "mem" }, bytes(sb.mem_used) + " / " + bytes(limits.memory)),
    el("td", { class: "disk" }, bytes(sb.disk_used) + " / " + (limits.disk ? bytes(limits.disk) : "no limit")),
    labels, actions);
}

function showSandboxes(state) {
  const body = document.querySelector("#sandboxes tbody");
  body.replaceChildren(...state.sandboxes.map((sb) => sandboxRow(sb, state.now)));
  document.getElementById("count").textContent = "(" + state.sandboxes.length + ")";
  document.getElementById("empty").hidden = state.sandboxes.length > 0;
}

// an E2B sandbox's image is the template it was made from (its alias), not the image the template was built as
function imageOf(sb) {
  const template = (sb.labels || {})["e2b.template"];
  return template === undefined ? sb.image : "E2B template " + template;
}

function sandboxHref(id) { return "/console/sandbox/" + encodeURIComponent(id); }
function snapshotHref(id) { return "/console/snapshots#" + encodeURIComponent(id); }

function node(kind, item, text) {
  const id = el("code", {}, item.id);
  return el("span", { class: "node " + kind + (item.gone ? " gone" : "") },
    el("span", { class: "kind" }, item.gone ? "deleted " + kind : kind),
    item.gone ? id : el("a", { href: kind === "sandbox" ? sandboxHref(item.id) : snapshotHref(item.id) }, id),
    text ? " " + text : "");
}

// The lineage of a reading: every snapshot (those sandboxes name but the store no longer has, a fork's own, drawn
// as deleted) and sandbox, with the key ("sb:ID" or "snap:ID") of what it hangs under (null: a root). A snapshot
// hangs under the live sandbox it was taken from, else under its parent snapshot; a sandbox under the snapshot it
// was restored or forked from, or, for a fork whose files came straight from its live parent (no snapshot of the
// parent between them), under that parent. So a sandbox's snapshots and forks, and what was restored or forked
// from them, nest under it, generation after generation.
function lineage(state) {
  const snaps = new Map(state.snapshots.map((s) => [s.id, s]));
  const boxes = new Map(state.sandboxes.map((s) => [s.id, s]));
  for (const sb of state.sandboxes) {
    if (sb.parent_snapshot && !snaps.has(sb.parent_snapshot)) {
      // a deleted snapshot a fork came through was taken of the fork's parent, unless the parent names it too
      const parent = sb.forked_from ? boxes.get(sb.forked_from) : undefined;
      const taken = parent && parent.parent_snapshot !== sb.parent_snapshot ? parent.id : null;
      snaps.set(sb.parent_snapshot, { id: sb.parent_snapshot, parent_id: null, sandbox_id: taken, gone: true });
    }
  }
  const items = [];
  for (const s of snaps.values()) {
    const up = s.sandbox_id && boxes.has(s.sandbox_id) ? "sb:" + s.sandbox_id
      : s.parent_id && snaps.has(s.parent_id) ? "snap:" + s.parent_id : null;
    items.push({ kind: "snapshot", key: "snap:" + s.id, item: s, up });
  }
  for (const sb of boxes.values()) {
    const via = sb.parent_snapshot ? snaps.get(sb.parent_snapshot) : undefined;
    const direct = boxes.has(sb.forked_from) && !(via && via.sandbox_id === sb.forked_from);
    const up = direct ? "sb:" + sb.forked_from : sb.parent_snapshot ? "snap:" + sb.parent_snapshot : null;
    items.push({ kind: "sandbox", key: "sb:" + sb.id, item: sb, up });
  }
  const kids = new Map();
  for (const it of items) {
    if (it.up === null) continue;
    if (!kids.has(it.up)) kids.set(it.up, []);
    kids.get(it.up).push(it);
  }
  return { items, kids, snaps, boxes };
}

const folded = new Set();  // the keys of the nodes folded on the snapshots page (kept across readings)

function showTree(state) {
  const { items, kids, snaps } = lineage(state);
  const drawn = new Set();
  const draw = (it) => {
    drawn.add(it.key);
    const { kind, item } = it;
    const text = kind === "sandbox" ? item.state + ", " + imageOf(item)
      : item.gone ? "" : (item.has_memory ? "memory + files, " : "files, ") + bytes(item.size_bytes);
    const below = (kids.get(it.key) || []).filter((k) => !drawn.has(k.key));
    const li = el("li", { "data-kind": kind, "data-id": item.id });
    if (below.length) {
      const open = !folded.has(it.key);
      li.dataset.open = String(open);
      li.append(el("button", { type: "button", class: "toggle", "data-toggle": it.key, "aria-expanded": String(open),
        title: open ? "fold" : "unfold" }, open ? "▾" : "▸"));
      li.append(node(kind, item, text));
      if (open) li.append(el("ul", {}, ...below.map(draw)));
      else li.append(el("span", { class: "folded" }, " (" + below.length + " below)"));
    } else {
      li.append(node(kind, item, text));
    }
    return li;
  };
  document.getElementById("tree").replaceChildren(...items.filter((it) => it.up === null).map(draw));
  document.getElementById("empty").hidden = items.length > 0;
  showSnapshot(snaps);
}

// the snapshot a link in the tree picked (the address's #ID): what it is, and its restore and delete buttons
function showSnapshot(snaps) {
  const panel = document.getElementById("snapshot");
  const id = decodeURIComponent(window.location.hash.slice(1));
  panel.hidden = !id;
  if (!id) return;
  const s = snaps.get(id);
  document.getElementById("snap-id").textContent = id;
  const buttons = document.getElementById("snap-actions");
  buttons.hidden = !s || s.gone;
  panel.dataset.state = !s || s.gone ? "deleted" : "kept";
  if (!s || s.gone) {
    document.getElementById("snap-facts").textContent = "deleted: no longer in the store";
    return;
  }
  const labels = Object.entries(s.labels || {}).map(([k, v]) => k + "=" + v).join(", ");
  document.getElementById("snap-facts").textContent = (s.has_memory ? "memory + files" : "files only") + ", "
    + bytes(s.size_bytes) + ", taken " + new Date(s.created_at * 1000).toISOString().replace("T", " ").slice(0, 19)
    + (s.sandbox_id ? " from sandbox " + s.sandbox_id : "") + (s.parent_id ? ", after snapshot " + s.parent_id : "")
    + (labels ? "; labels " + labels : "");
}

// What each page does with a reading (detail.js adds the sandbox and server pages').
const SHOW = { sandboxes: showSandboxes, snapshots: showTree };

function listen() {
  const page = document.body.dataset.page;
  const show = SHOW[page];
  let last = null;  // the latest reading, redrawn when a node is folded or picked
  const table = document.getElementById("sandboxes");
  if (table) {  // one listener for the table's buttons: its rows are redrawn at every reading
    table.addEventListener("click", (e) => {
      const button = e.target.closest("button[data-action]");
      if (button) act(button.closest("tr").dataset.id, button.dataset.action);
    });
  }
  const tree = document.getElementById("tree");
  if (tree) {  // the same for the tree's fold buttons, and the picked snapshot's buttons
    tree.addEventListener("click", (e) => {
      const button = e.target.closest("button[data-toggle]");
      if (!button) return;
      const key = button.dataset.toggle;
      if (!folded.delete(key)) folded.add(key);
      if (last) show(last);
    });
    document.getElementById("snap-actions").addEventListener("click", (e) => {
      const button = e.target.closest("button[data-action]");
      if (button) act(document.getElementById("snap-id").textContent, button.dataset.action, "snapshots");
    });
    window.addEventListener("hashchange", () => { if (last) show(last); });
  }
  const live = document.getElementById("live");
  live.hidden = false;
  const source = new EventSource("/console/api/events");
  source.addEventListener("state", (e) => {
    last = JSON.parse(e.data);
    show(last);
    live.dataset.state = "live";
    live.textContent = "live";
  });
  source.addEventListener("error", async () => {
    live.dataset.state = "lost";
    live.textContent = "reconnecting";
    const probe = await fetch("/console/api/state", { credentials: "same-origin" }).catch(() => null);
    if (probe && probe.status === 401) { source.close(); window.location.assign("/console/login"); }
  });
}

document.addEventListener("DOMContentLoaded", listen);
