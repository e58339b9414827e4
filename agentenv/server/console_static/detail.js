// The console's sandbox page (processes, jobs, a job's tail, a read-only file browser, the action buttons) and
// server page (SVG charts of the server's figures, with axis.js's ticks). Uses console.js's el, bytes, age, say,
// act and lineage, and its event stream: every reading redraws. Everything a sandbox made (names, output,
// commands) is set as text only.
"use strict";

async function getJSON(url) {
  const reply = await fetch(url, { credentials: "same-origin" });
  if (reply.status === 401) { window.location.assign("/console/login"); throw new Error("logged out"); }
  let body = null;
  try { body = await reply.json(); } catch (e) { body = null; }
  return { ok: reply.ok, status: reply.status, body };
}

function failure(r) {
  return r.status + " " + (r.body && r.body.error ? r.body.error + ": " + r.body.message : "no answer");
}

// --- the sandbox page ---------------------------------------------------------------------------------------

const SANDBOX = decodeURIComponent(window.location.pathname.split("/").pop());
const api = "/console/api/sandboxes/" + encodeURIComponent(SANDBOX);
let tailPid = null;  // the job whose tail is shown
let busy = false;  // a refresh in flight: a reading meanwhile is skipped
let listed = false;  // the file browser has listed its folder (once the sandbox runs)

// what the sandbox came from (the sandbox it is a fork of, the snapshot it was restored or forked from) and what
// came of it (console.js's lineage of the reading), as links; its labels
function showLineage(state, sb) {
  const { kids, snaps, boxes } = lineage(state);
  const link = (kind, id) => el("a", { href: kind === "sandbox" ? sandboxHref(id) : snapshotHref(id),
    "data-kind": kind, "data-id": id }, id);
  const snapshot = (s) => s.gone ? ["snapshot " + s.id + " (deleted)"] : ["snapshot ", link("snapshot", s.id)];
  const parent = sb.parent_snapshot ? snaps.get(sb.parent_snapshot) : null;
  let from;
  if (sb.forked_from) {  // a fork: of which sandbox, and through which snapshot of it (none for a files-only fork)
    const of = boxes.get(sb.forked_from);
    from = ["forked from sandbox ", ...(of ? [link("sandbox", of.id)] : [sb.forked_from + " (closed)"])];
    if (parent && (!of || of.parent_snapshot !== parent.id)) from.push(", through ", ...snapshot(parent));
  } else {
    from = !parent ? ["an image"] : [...snapshot(parent),
      ...(!parent.gone && parent.sandbox_id ? [" of sandbox ", link("sandbox", parent.sandbox_id)] : [])];
  }
  document.getElementById("from").replaceChildren(...from);
  const children = [];
  for (const kid of kids.get("sb:" + sb.id) || []) {
    if (kid.kind === "sandbox") {  // a fork straight from its files
      children.push(el("li", {}, "fork ", link("sandbox", kid.item.id)));
      continue;
    }
    const made = (kids.get(kid.key) || []).filter((k) => k.kind === "sandbox");
    children.push(el("li", {}, ...snapshot(kid.item), ...(made.length ? [" → "] : []),
      ...made.flatMap((k, i) => [i ? ", " : "", link("sandbox", k.item.id)])));
  }
  document.getElementById("children").replaceChildren(...children);
  document.getElementById("no-children").hidden = children.length > 0;
  const labels = Object.entries(sb.labels || {});
  document.getElementById("labels").replaceChildren(
    ...labels.map(([k, v]) => el("span", { class: "label" }, k + "=" + v)), labels.length ? "" : "none");
}

function rows(tbody, items, row) {
  document.querySelector(tbody).replaceChildren(...items.map(row));
}

async function refreshSandbox() {
  if (busy) return;
  busy = true;
  try {
    const r = await getJSON(api);
    if (!r.ok) { say(failure(r), true); return; }
    const d = r.body;
    document.getElementById("tail-cap").textContent = bytes(d.caps.tail_bytes);  // the server's caps, said
    document.getElementById("list-cap").textContent = d.caps.max_entries;
    document.getElementById("file-cap").textContent = bytes(d.caps.max_file);
    rows("#processes tbody", d.processes, (p) => el("tr", { "data-pid": p.pid },
      el("td", {}, p.pid), el("td", {}, p.command), el("td", {}, p.exit_code === null ? "running" : p.exit_code),
      el("td", { class: "id" }, p.log)));
    rows("#jobs tbody", d.jobs, (j) => el("tr", { "data-pid": j.pid },
      el("td", {}, j.pid), el("td", {}, j.command), el("td", {}, j.tag === null ? "" : j.tag),
      el("td", {}, j.exit_code === null ? "running" : j.exit_code),
      el("td", {}, el("button", { type: "button", "data-tail": j.pid }, "tail"))));
    if (tailPid !== null) await refreshTail();
  } finally {
    busy = false;
  }
}

async function refreshTail() {
  const r = await getJSON(api + "/jobs/" + tailPid + "/tail");
  const pre = document.getElementById("tail");
  const title = document.getElementById("tail-title");
  title.hidden = pre.hidden = false;
  if (!r.ok) { title.textContent = "job " + tailPid + ": " + failure(r); pre.replaceChildren(); return; }
  title.textContent = "job " + tailPid + ": the last " + bytes(r.body.tail_bytes) + " of each stream";
  const following = pre.dataset.pid !== String(tailPid) || pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  pre.dataset.pid = String(tailPid);
  pre.replaceChildren(...r.body.output.map((o) => el("span", { class: o.stream, "data-stream": o.stream }, o.text)));
  if (following) pre.scrollTop = pre.scrollHeight;  // the newest line in sight, unless the reader scrolled up
}

function showSandbox(state) {
  const sb = state.sandboxes.find((s) => s.id === SANDBOX);
  const badge = document.getElementById("state");
  const actions = document.getElementById("actions");
  if (!sb) {
    badge.textContent = "gone";
    badge.className = "state lost";
    document.body.dataset.state = "gone";
    actions.replaceChildren();
    return;
  }
  badge.textContent = sb.state;
  badge.className = "state " + sb.state;
  document.body.dataset.state = sb.state;
  const limits = sb.limits || {};
  document.getElementById("summary").textContent = imageOf(sb) + ", " + age(state.now - sb.created_at) + " old, "
    + "memory " + bytes(sb.mem_used) + " / " + bytes(limits.memory) + ", disk " + bytes(sb.disk_used);
  showLineage(state, sb);
  const wanted = (BUTTONS[sb.state] || ["close"]).join(" ");
  if (actions.dataset.buttons !== wanted) {
    actions.dataset.buttons = wanted;
    actions.replaceChildren(...wanted.split(" ").map((a) => el("button", { type: "button", "data-action": a }, a)));
  }
  if (sb.state === "running") {
    refreshSandbox();
    if (!listed) { listed = true; browse(document.getElementById("path").value); }  // the files at once
    return;
  }
  // paused (or lost): no processes to ask; what the last reading listed is no longer so
  rows("#processes tbody", [], () => null);
  rows("#jobs tbody", [], () => null);
  document.getElementById("tail").hidden = document.getElementById("tail-title").hidden = true;
  tailPid = null;
}

// the file browser: a folder listed, a file's text shown
async function browse(path) {
  const error = document.getElementById("files-error");
  document.getElementById("path").value = path;
  const r = await getJSON(api + "/list?path=" + encodeURIComponent(path));
  error.hidden = r.ok;
  if (!r.ok) {
    error.textContent = path + ": " + failure(r);
    error.dataset.status = r.status;
    document.querySelector("#files tbody").replaceChildren();
    document.getElementById("files-note").textContent = "";
    return;
  }
  const d = r.body;
  const base = d.path.endsWith("/") ? d.path : d.path + "/";
  rows("#files tbody", d.entries, (f) => el("tr", { "data-type": f.type },
    el("td", { class: "name" }, el("a", { href: "#", "data-path": base + f.name, "data-type": f.type },
      f.name + (f.type === "dir" ? "/" : ""))),
    el("td", {}, f.symlink_target === null || f.symlink_target === undefined ? f.type : "link → " + f.symlink_target),
    el("td", {}, bytes(f.size)), el("td", { class: "id" }, f.permissions), el("td", {}, f.owner + ":" + f.group),
    el("td", {}, new Date(f.modified * 1000).toISOString().replace("T", " ").slice(0, 19))));
  document.getElementById("files-note").textContent = d.total > d.entries.length
    ? "showing the first " + d.entries.length + " of " + d.total + " entries" : d.total + " entries";
}

async function openFile(path) {
  const r = await getJSON(api + "/file?path=" + encodeURIComponent(path));
  const title = document.getElementById("file-title");
  const pre = document.getElementById("file");
  title.hidden = pre.hidden = false;
  if (!r.ok) { title.textContent = path + ": " + failure(r); pre.textContent = ""; return; }
  const f = r.body;
  title.textContent = f.path + " (" + bytes(f.size) + ")" + (f.text === null
    ? ": over " + bytes(f.max_file) + ", not shown (download it with the API)"
    : f.truncated ? ": its first " + bytes(f.max_file) : "");
  pre.textContent = f.text === null ? "" : f.text;
}

function parentOf(path) {
  const trimmed = path.replace(/\/+$/, "");
  return trimmed.lastIndexOf("/") > 0 ? trimmed.slice(0, trimmed.lastIndexOf("/")) : "/";
}

function startSandboxPage() {
  document.getElementById("sbid").textContent = SANDBOX;
  document.getElementById("actions").addEventListener("click", (e) => {
    const button = e.target.closest("button[data-action]");
    if (button) act(SANDBOX, button.dataset.action);
  });
  document.getElementById("jobs").addEventListener("click", (e) => {
    const button = e.target.closest("button[data-tail]");
    if (button) { tailPid = Number(button.dataset.tail); refreshTail(); }
  });
  document.getElementById("browse").addEventListener("submit", (e) => {
    e.preventDefault();
    browse(document.getElementById("path").value);
  });
  document.getElementById("up").addEventListener("click", () => browse(parentOf(document.getElementById("path").value)));
  document.getElementById("files").addEventListener("click", (e) => {
    const link = e.target.closest("a[data-path]");
    if (!link) return;
    e.preventDefault();
    if (link.dataset.type === "dir") browse(link.dataset.path); else openFile(link.dataset.path);
  });
}

// --- the server page --------------------------------------------------------------------------------------

const HISTORY = 300;
let figures = [];  // the server's readings, oldest first

// each chart: its series (one value per reading), a dashed limit line where there is one, and the text shown
const CHARTS = {
  admission: { series: [(f) => f.admission.starting, (f) => f.admission.waiting], limit: (f) => f.admission.limit,
    text: (f) => f.admission.starting + " starting (of " + f.admission.limit + " at once), "
      + f.admission.waiting + " waiting" },
  warm: { series: [(f) => f.warm.ready], limit: (f) => f.warm.size,
    text: (f) => f.warm.size ? f.warm.ready + " of " + f.warm.size + " ready" : "off (agentenv serve --warm-pool N)" },
  store: { series: [(f) => f.store.bytes], limit: null,
    text: (f) => bytes(f.store.bytes) + " in " + f.store.snapshots + (f.store.snapshots === 1 ? " snapshot" : " snapshots") },
  sandboxes: { series: [(f) => f.capacity.live_sandboxes], limit: (f) => f.capacity.max_sandboxes,
    text: (f) => f.capacity.live_sandboxes + " of " + f.capacity.max_sandboxes },
  memory: { series: [(f) => f.capacity.memory_used], limit: (f) => f.capacity.max_memory,
    text: (f) => bytes(f.capacity.memory_used) + " of " + bytes(f.capacity.max_memory) },
};

const SVG = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// what a chart's y ticks say: bytes for the store and memory, counts otherwise
const IN_BYTES = new Set(["store", "memory"]);

// the charts span the readings kept (up to five minutes), newest on the right, each as wide as its figure (the
// page's grid shares the width out); y ticks at round values from 0, x ticks in seconds before the newest reading;
// the dashed line is the limit
function drawCharts() {
  if (!figures.length) return;
  const last = figures[figures.length - 1];
  const ago = figures.map((f) => f.now - last.now);
  for (const [name, chart] of Object.entries(CHARTS)) {
    const figure = document.querySelector('figure[data-metric="' + name + '"]');
    const box = figure.querySelector("svg");
    const W = Math.max(240, Math.floor(figure.clientWidth - 20)), H = 120, L = 64, R = 10, T = 8, B = 20;
    const series = chart.series.map((get) => figures.map(get));
    const limits = chart.limit ? figures.map(chart.limit) : [];
    const top = Math.max(1, ...series.flat(), ...limits);
    const unit = IN_BYTES.has(name) ? 1024 ** Math.max(0, Math.floor(Math.log(top) / Math.log(1024))) : 1;
    const t = ticks(0, top / unit, 4, !IN_BYTES.has(name));  // bytes: round numbers of KiB, MiB, GiB
    const yt = { lo: t.lo * unit, hi: t.hi * unit, step: t.step * unit, values: t.values.map((v) => v * unit) };
    const xt = ticks(Math.min(-60, ago[0]), 0, Math.max(2, Math.floor((W - L - R) / 90)), true);
    const X = (x) => L + (x - xt.lo) / (xt.hi - xt.lo) * (W - L - R);
    const Y = (y) => T + (1 - (y - yt.lo) / (yt.hi - yt.lo)) * (H - T - B);
    const parts = [];
    for (const v of yt.values) {
      parts.push(svgEl("line", { x1: L, y1: Y(v), x2: W - R, y2: Y(v), class: "grid" }),
        svgEl("text", { x: L - 4, y: Y(v) + 3, class: "tick y", "text-anchor": "end", "data-value": v },
          IN_BYTES.has(name) ? bytes(v) : tickText(v, yt.step)));
    }
    for (const v of xt.values) {
      parts.push(svgEl("text", { x: X(v), y: H - 6, class: "tick x", "text-anchor": "middle" }, v ? v + " s" : "now"));
    }
    parts.push(svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
      svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
    const line = (values, cls) => svgEl("polyline", { class: cls,
      points: values.map((v, i) => X(ago[i]).toFixed(1) + "," + Y(v).toFixed(1)).join(" ") });
    parts.push(...series.map((values, i) => line(values, "s" + i)));
    if (chart.limit) parts.push(line(limits, "limit"));
    box.setAttribute("viewBox", "0 0 " + W + " " + H);
    box.setAttribute("width", W);
    box.setAttribute("height", H);
    box.replaceChildren(...parts);
    figure.querySelector(".value").textContent = chart.text(last);
    figure.dataset.readings = figures.length;
  }
}

function showServer(state) {
  if (!state.server) return;
  figures.push(state.server);
  figures = figures.slice(-HISTORY);
  drawCharts();
}

async function startServerPage() {
  const r = await getJSON("/console/api/server");
  if (r.ok) {
    const newest = figures.length ? figures[0].now : Infinity;  // readings the stream brought meanwhile stay
    figures = r.body.history.filter((f) => f.now < newest).concat(figures).slice(-HISTORY);
    drawCharts();
  }
}

SHOW.sandbox = showSandbox;
SHOW.server = showServer;
document.addEventListener("DOMContentLoaded", () => {
  if (document.body.dataset.page === "sandbox") startSandboxPage();
  if (document.body.dataset.page === "server") startServerPage();
});
