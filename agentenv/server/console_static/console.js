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

async function act(id, action) {
  if (action === "close" && !window.confirm("Close sandbox " + id + "? Its state is lost.")) return;
  say(action + " " + id + "…");
  const reply = await fetch("/console/api/sandboxes/" + encodeURIComponent(id) + "/" + action,
    { method: "POST", headers: { "X-Agentenv-Console": "1" }, credentials: "same-origin" });
  let body = null;
  try { body = await reply.json(); } catch (e) { body = null; }
  if (reply.status === 401) { window.location.assign("/console/login"); return; }
  if (!reply.ok) {
    say(action + " " + id + " failed: " + (body && body.message ? body.message : reply.status), true);
    return;
  }
  const made = Array.isArray(body) ? body.map((k) => k.id).join(", ") : (body && body.id) || id;
  say({ pause: "paused ", resume: "resumed ", fork: "forked into ", snapshot: "snapshot ", close: "closed " }[action]
      + made);
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
    el("td", {}, sb.image),
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

function node(kind, id, text, gone) {
  return el("span", { class: "node " + kind + (gone ? " gone" : "") },
    el("span", { class: "kind" }, gone ? "deleted " + kind : kind), el("code", {}, id), text ? " " + text : "");
}

// The tree: a snapshot's children are the snapshots whose parent it is and the sandboxes restored or forked from
// it; a snapshot with no parent hangs under the live sandbox it was taken from. A snapshot that sandboxes name but
// the store no longer has (a fork's own) is drawn as deleted.
function showTree(state) {
  const snaps = new Map(state.snapshots.map((s) => [s.id, s]));
  const boxes = new Map(state.sandboxes.map((s) => [s.id, s]));
  for (const sb of state.sandboxes) {
    if (sb.parent_snapshot && !snaps.has(sb.parent_snapshot)) {
      snaps.set(sb.parent_snapshot, { id: sb.parent_snapshot, parent_id: null, sandbox_id: null, gone: true });
    }
  }
  const kids = new Map();
  const roots = [];
  const hang = (parent, item) => {
    if (parent === null) { roots.push(item); return; }
    if (!kids.has(parent)) kids.set(parent, []);
    kids.get(parent).push(item);
  };
  for (const s of snaps.values()) {
    if (s.parent_id && snaps.has(s.parent_id)) hang("snap:" + s.parent_id, { kind: "snapshot", item: s });
    else if (s.sandbox_id && boxes.has(s.sandbox_id)) hang("sb:" + s.sandbox_id, { kind: "snapshot", item: s });
    else hang(null, { kind: "snapshot", item: s });
  }
  for (const sb of boxes.values()) {
    hang(sb.parent_snapshot ? "snap:" + sb.parent_snapshot : null, { kind: "sandbox", item: sb });
  }
  const seen = new Set();
  const draw = ({ kind, item }) => {
    const key = (kind === "sandbox" ? "sb:" : "snap:") + item.id;
    const text = kind === "sandbox" ? item.state
      : item.gone ? "" : (item.has_memory ? "memory + files, " : "files, ") + bytes(item.size_bytes)
        + (item.sandbox_id ? ", from " + item.sandbox_id : "");
    const li = el("li", { "data-kind": kind, "data-id": item.id }, node(kind, item.id, text, item.gone));
    if (!seen.has(key) && kids.has(key)) {
      seen.add(key);
      li.append(el("ul", {}, ...kids.get(key).map(draw)));
    }
    return li;
  };
  document.getElementById("tree").replaceChildren(...roots.map(draw));
  document.getElementById("empty").hidden = roots.length > 0;
}

// What each page does with a reading (detail.js adds the sandbox and server pages').
const SHOW = { sandboxes: showSandboxes, snapshots: showTree };

function listen() {
  const page = document.body.dataset.page;
  const table = document.getElementById("sandboxes");
  if (table) {  // one listener for the table's buttons: its rows are redrawn at every reading
    table.addEventListener("click", (e) => {
      const button = e.target.closest("button[data-action]");
      if (button) act(button.closest("tr").dataset.id, button.dataset.action);
    });
  }
  const show = SHOW[page];
  const live = document.getElementById("live");
  const source = new EventSource("/console/api/events");
  source.addEventListener("state", (e) => {
    show(JSON.parse(e.data));
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
