// The trajectory viewer's pages (trainer/viewer_web.py serves them, /console/api/runs/... feeds them; the charts'
// ticks are the console's axis.js). Everything
// a run holds (the agent's text, tool output, task ids) is hostile: it is only ever set as text, never as HTML.
"use strict";

const API = "/console/api/runs";
const SVG = "http://www.w3.org/2000/svg";

function make(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function say(text, isError) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = isError ? "error" : "";
}

function num(v, digits) {
  if (v === null || v === undefined) return "–";
  return Number.isInteger(v) ? String(v) : Number(v).toFixed(digits === undefined ? 3 : digits);
}

function when(ts) {
  return ts ? new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19) : "–";
}

// the path's parts after /console/runs/: [run, "episodes", id] ...
function parts() {
  return window.location.pathname.split("/").slice(3).filter((p) => p).map(decodeURIComponent);
}

function runUrl(run, ...rest) {
  return "/console/runs/" + [run, ...rest].map(encodeURIComponent).join("/");
}

async function get(url) {
  const reply = await fetch(url, { credentials: "same-origin" });
  let body = null;
  try { body = await reply.json(); } catch (e) { body = null; }
  if (reply.status === 401) { window.location.assign("/console/login"); throw new Error("not logged in"); }
  if (!reply.ok) throw new Error(body && body.message ? body.message + (body.fix ? " (" + body.fix + ")" : "")
    : "HTTP " + reply.status);
  return body;
}

function runLinks(run) {
  const links = document.getElementById("run-links");
  links.replaceChildren(make("span", { class: "sep" }, "›"), make("a", { href: runUrl(run) }, run), " ",
    make("a", { href: runUrl(run, "metrics") }, "metrics"), " ", make("a", { href: runUrl(run, "searches") },
      "searches"));
}

// --- runs -------------------------------------------------------------------------------------------------------

async function showRuns() {
  const data = await get(API);
  const body = document.querySelector("#runs tbody");
  body.replaceChildren(...data.runs.map((r) => make("tr", { "data-run": r.name },
    make("td", {}, make("a", { href: runUrl(r.name) }, r.name)), make("td", {}, r.kind),
    make("td", {}, r.episodes), make("td", {}, r.groups), make("td", {}, num(r.reward_mean)),
    make("td", {}, when(r.started_at)),
    make("td", {}, r.metrics ? make("a", { href: runUrl(r.name, "metrics") }, "metrics") : "", " ",
      r.searches ? make("a", { href: runUrl(r.name, "searches") }, r.searches + " searches") : ""))));
  document.getElementById("empty").hidden = data.runs.length > 0;
}

// --- a run's episodes -------------------------------------------------------------------------------------------

function fillChoices(form, choices) {
  for (const [name, values] of Object.entries(choices)) {
    const select = form.elements[name];
    if (!select || select.options.length > 1) continue;
    for (const v of values) select.append(make("option", { value: String(v) }, String(v)));
  }
}

function episodeRow(run, r) {
  return make("tr", { "data-episode": r.episode_id, "data-reward": String(r.reward) },
    make("td", { class: "id" }, make("a", { href: runUrl(run, "episodes", r.episode_id) }, r.episode_id)),
    make("td", {}, r.task_id),
    make("td", { class: "id" }, r.group_id ? make("a", { href: runUrl(run, "groups", r.group_id) }, r.group_id
      + " #" + r.group_index) : "–"),
    make("td", {}, num(r.reward)), make("td", {}, r.finish_reason), make("td", {}, r.weight_versions.join(", ")),
    make("td", {}, r.turns), make("td", {}, r.tokens + " (" + r.generated + ")"),
    make("td", {}, r.tool_calls + " (" + r.malformed_calls + ")"),
    make("td", {}, r.tampering ? make("span", { class: "flag" }, "tampering") : "no"), make("td", {}, r.phase || "–"));
}

// ``unknown``: the address's parameters that are no filter of the form, sent as they are on the first load, so
// that the viewer refuses them with its message (a filter it does not know is never ignored)
async function showEpisodes(offset, unknown) {
  const [run] = parts();
  runLinks(run);
  document.getElementById("title").textContent = run;
  const form = document.getElementById("filters");
  const query = new URLSearchParams();
  for (const [k, v] of new FormData(form)) if (v !== "") query.set(k, v);
  for (const [k, v] of unknown || []) query.append(k, v);
  window.history.replaceState(null, "", window.location.pathname + (query.size ? "?" + query : ""));
  if (offset) query.set("offset", offset);
  say("loading…");
  const data = await get(API + "/" + encodeURIComponent(run) + "/episodes?" + query);
  fillChoices(form, data.choices);
  document.querySelector("#episodes tbody").replaceChildren(...data.rows.map((r) => episodeRow(run, r)));
  document.getElementById("count").textContent = "(" + data.total + " of " + data.run.episodes + ")";
  const next = data.offset + data.rows.length;
  document.getElementById("more").hidden = next >= data.total;
  document.getElementById("next").onclick = () => showEpisodes(next).catch((e) => say(e.message, true));
  say(data.rows.length ? "episodes " + (data.offset + 1) + "–" + next : "no episode passes these filters");
}

function startEpisodes() {
  const form = document.getElementById("filters");
  const given = new URLSearchParams(window.location.search);
  const unknown = new URLSearchParams();
  for (const [k, v] of given) {
    const input = [...form.elements].find((e) => e.name === k && e.type !== "submit");
    if (!input) { unknown.append(k, v); continue; }
    if (input.tagName === "SELECT" && ![...input.options].some((o) => o.value === v)) {
      input.append(make("option", { value: v }, v));
    }
    input.value = v;
  }
  form.addEventListener("submit", (e) => { e.preventDefault(); showEpisodes(0).catch((err) => say(err.message, true)); });
  return showEpisodes(0, unknown);
}

// --- one episode ------------------------------------------------------------------------------------------------

function lpClass(lp) {
  return lp > -0.1 ? "lp-0" : lp > -0.5 ? "lp-1" : lp > -1.5 ? "lp-2" : lp > -3 ? "lp-3" : "lp-4";
}

// tokens are [position, text, mask, logprob]: a span each, "trained" where the mask is 1
function tokens(list) {
  const box = make("div", { class: "tokens" });
  for (const [i, text, mask, lp] of list) {
    const special = /^(<\|[a-z_]+\|>|\[[A-Z]+\]|<\/?think>)$/.test(text);
    const cls = "tok" + (mask ? " trained " + lpClass(lp) : "") + (special ? " special" : "");
    box.append(make("span", { class: cls, "data-i": String(i), "data-mask": String(mask), "data-logprob": String(lp),
      title: "#" + i + " mask " + mask + (mask ? " logprob " + lp.toFixed(4) : "") }, text));
  }
  return box;
}

function facts(pairs) {
  const dl = document.getElementById("facts");
  dl.replaceChildren();
  for (const [k, v] of pairs) dl.append(make("dt", {}, k), make("dd", {}, v));
}

function testTable(name, statuses) {
  const rows = Object.entries(statuses);
  const bad = rows.filter(([, s]) => s !== "PASSED").length;
  return make("details", Object.assign({ class: "tests", "data-tests": name }, bad ? { open: "" } : {}),
    make("summary", {}, name + ": " + rows.length + " tests, " + bad + " not passed"),
    make("table", {}, make("tbody", {}, ...rows.map(([t, s]) => make("tr", { "data-status": s },
      make("td", { class: "id" }, t), make("td", {}, make("span", { class: "status " + s.toLowerCase() }, s)))))));
}

function showGrade(g) {
  const box = document.getElementById("grade");
  box.replaceChildren();
  for (const [k, v] of Object.entries(g.other)) {
    box.append(make("p", {}, make("b", {}, k + ": "), typeof v === "string" ? v : JSON.stringify(v)));
  }
  for (const [name, statuses] of Object.entries(g.tests)) box.append(testTable(name, statuses));
  if (g.tampering || g.tampering_reasons.length) {
    box.append(make("p", { class: "flag" }, "tampering"),
      make("ul", {}, ...g.tampering_reasons.map((r) => make("li", {}, r))));
  }
  if (g.dropped.length) {
    box.append(make("p", {}, make("b", {}, "dropped by the grader:")),
      make("ul", { id: "dropped" }, ...g.dropped.map((d) => make("li", {},
        make("code", {}, d.path || JSON.stringify(d)), " ", d.reason ? "(" + d.reason + ")" : ""))));
  }
  const timings = Object.entries(g.timings_ms);
  if (timings.length) box.append(make("p", { class: "help" }, "grading: " + timings.map(([k, v]) => k + " " + v + " ms")
    .join(", ")));
  if (g.patch) box.append(make("details", {}, make("summary", {}, "the agent's patch"), make("pre", {}, g.patch)));
  document.getElementById("grade-section").hidden = !box.childNodes.length;
}

function turnBlock(t) {
  const head = "turn " + (t.index + 1) + ": policy " + t.policy_s.toFixed(2) + " s, env " + t.env_s.toFixed(2)
    + " s, " + t.generated.length + " tokens, weights v" + t.weight_version + (t.finish ? ", finish " + t.finish : "");
  const block = make("section", { class: "turn", "data-turn": String(t.index) },
    make("h3", {}, head, t.malformed ? make("span", { class: "flag" }, " malformed") : ""));
  if (t.before.length) block.append(tokens(t.before));
  block.append(make("div", { class: "who" }, "assistant"), tokens(t.generated));
  if (t.tool_calls.length) {
    block.append(make("ul", { class: "calls" }, ...t.tool_calls.map((c) => make("li", {}, make("code", {}, "→ " + c)))));
  }
  if (t.after.length) {
    const names = t.outputs.map((o) => o.name).join(", ") || "template";
    block.append(make("div", { class: "who" }, "← " + names), tokens(t.after));
  }
  return block;
}

function harnessFacts(run, h) {
  // a harness episode (docs/harnesses.md): the harness, this branch of its gateway session, the session's figures
  const causes = Object.entries(h.session.causes || {}).map(([k, v]) => k + " " + v).join(", ");
  const others = h.other_branches.map((o) => make("a", { href: runUrl(run, "episodes", o.episode_id) },
    "branch " + o.branch + " (" + o.cause + ")"));
  const rows = [["harness", h.name + ": " + h.outcome + (h.exit ? " (" + h.exit + ")" : "")],
    ["branch", h.branch + " (" + h.cause + ")" + (h.parent_branch === null ? ""
      : ", from branch " + h.parent_branch + " after " + h.fork_at + " tokens") + "; its turns are the session's calls "
      + h.calls.join(", ")],
    ["session", h.session.calls + " calls, " + h.session.branches + " branches (" + causes + "), merge rate "
      + num(h.session.merge_rate) + ", " + h.session.retries + " retries, " + h.session.errors + " engine errors"
      + (h.session.stopped ? ", stopped by its " + h.session.stopped + " budget" : "")]];
  const dl = document.getElementById("facts");
  for (const [k, v] of rows) dl.append(make("dt", {}, k), make("dd", {}, v));
  if (others.length) dl.append(make("dt", {}, "other branches"), make("dd", {}, ...others));
}

async function showEpisode() {
  const [run, , id] = parts();
  runLinks(run);
  document.getElementById("title").textContent = id;
  const e = await get(API + "/" + encodeURIComponent(run) + "/episodes/" + encodeURIComponent(id));
  const group = e.group_id ? make("a", { href: runUrl(run, "groups", e.group_id) }, e.group_id + " #" + e.group_index)
    : "–";
  facts([["task", e.task_id + " on " + e.env_id], ["group", group], ["reward", num(e.reward)],
    ["finish", e.finish_reason + (e.error ? ": " + e.error : "")], ["weights", e.weight_versions.join(", ")],
    ["tokens", e.tokens + " (" + e.generated + " generated, prompt " + e.prompt_len + ")"],
    ["tool calls", e.tool_calls + " (" + e.malformed_calls + " malformed)"],
    ["time", "policy " + e.time.policy_s.toFixed(2) + " s, env steps " + e.time.env_s.toFixed(2) + " s, reset "
      + e.time.reset_s.toFixed(2) + " s, fork " + e.time.fork_s.toFixed(2) + " s"],
    ["phase", e.phase || "–"]]);
  if (e.harness) harnessFacts(run, e.harness);
  showGrade(e.grade);
  const conv = document.getElementById("conversation");
  conv.replaceChildren(make("details", { class: "prompt" }, make("summary", {}, "prompt (" + e.prompt.length
    + " tokens: system, tools, task)"), tokens(e.prompt)), ...e.turns_detail.map(turnBlock));
  if (e.tail.length) conv.append(tokens(e.tail));
  say("");
}

// --- a group ----------------------------------------------------------------------------------------------------

async function showGroup() {
  const [run, , id] = parts();
  runLinks(run);
  document.getElementById("title").textContent = id;
  const g = await get(API + "/" + encodeURIComponent(run) + "/groups/" + encodeURIComponent(id));
  const a = g.advantages;
  document.getElementById("advantages").textContent = "Advantages: " + (a.baseline === "loo" ? "leave-one-out"
    : "group mean") + " baseline" + (a.std_normalize ? ", divided by the group's std" : "") + " (" + a.source + ")"
    + (g.dropped ? "; this group is dropped (all rewards equal, drop_all_equal)" : "") + ".";
  document.getElementById("members").replaceChildren(...g.members.map((m) => make("section",
    { class: "member", "data-episode": m.episode_id },
    make("h3", {}, make("a", { href: runUrl(run, "episodes", m.episode_id) }, "#" + m.group_index)),
    make("p", {}, "reward ", make("b", { class: "reward" }, num(m.reward)), ", advantage ",
      make("b", { class: "advantage" }, num(m.advantage))),
    make("p", { class: "help" }, m.finish_reason + ", " + m.turns + " turns, " + m.generated + " tokens generated"),
    ...m.turns_detail.map((t, i) => make("div", { class: "turn" }, make("div", { class: "who" }, "turn " + (i + 1)),
      t.content.trim() ? make("pre", {}, t.content.trim()) : "",
      ...t.tool_calls.map((c) => make("code", { class: "call" }, "→ " + c)))))));
  say(g.members.length + " members");
}

// --- search trees -----------------------------------------------------------------------------------------------

function treeOf(nodes, serve) {
  const kids = new Map();
  for (const n of nodes) {
    const key = n.parent === null ? "root" : n.parent;
    if (!kids.has(key)) kids.set(key, []);
    kids.get(key).push(n);
  }
  const draw = (n) => {
    const bits = ["#" + n.id, "score " + num(n.score)];
    if (n.reward !== null) bits.push("reward " + num(n.reward));
    if (n.finish) bits.push(n.finish);
    const li = make("li", { "data-node": String(n.id), class: (n.kept ? "kept" : "") + (n.done ? " done" : "") },
      make("span", { class: "node" }, bits.join(", ")));
    if (n.snapshot_id) {
      li.append(" snapshot ", serve ? make("a", { href: "/console/snapshots", class: "snapshot" },
        make("code", {}, n.snapshot_id)) : make("code", { class: "snapshot" }, n.snapshot_id));
    }
    const action = n.action.split(/\s+/).join(" ").trim();
    if (action) li.append(make("div", { class: "action" }, action.length > 160 ? action.slice(0, 160) + "…" : action));
    if (kids.has(n.id)) li.append(make("ul", {}, ...kids.get(n.id).map(draw)));
    return li;
  };
  return make("ul", { class: "tree" }, ...(kids.get("root") || []).map(draw));
}

async function showSearches() {
  const [run] = parts();
  runLinks(run);
  document.getElementById("title").textContent = run;
  const [data, runs] = await Promise.all([get(API + "/" + encodeURIComponent(run) + "/searches"), get(API)]);
  const serve = runs.mode === "serve";
  document.getElementById("searches").replaceChildren(...data.searches.map((s) => make("section",
    { class: "search", "data-search": s.id },
    make("h2", {}, s.kind + " search " + s.id + " on " + (s.task_id || "?")),
    make("p", {}, "best leaf: reward " + num(s.best.reward) + ", " + (s.best.finish_reason || "–") + ", "
      + s.nodes.length + " nodes (", make("span", { class: "kept-mark" }, "kept"), " = on the beam)"),
    treeOf(s.nodes, serve))));
  document.getElementById("empty").hidden = data.searches.length > 0;
  say("");
}

// --- metrics ----------------------------------------------------------------------------------------------------

// one chart, ``width`` pixels wide (its figure's): gridlines and labels at the y axis's ticks, steps on the x axis
function chart(key, points, interval, width) {
  const W = Math.max(240, Math.floor(width)), H = 200, L = 64, R = 12, T = 10, B = 26;
  const xs = points.map((p) => p[0]);
  const ys = points.flatMap((p) => interval ? [p[1], p[2], p[3]] : [p[1]]);
  const xt = ticks(Math.min(...xs), Math.max(...xs), Math.max(2, Math.floor((W - L - R) / 90)), true);
  const yt = ticks(Math.min(...ys), Math.max(...ys), 5, false);
  const X = (x) => L + (x - xt.lo) / (xt.hi - xt.lo) * (W - L - R);
  const Y = (y) => T + (1 - (y - yt.lo) / (yt.hi - yt.lo)) * (H - T - B);
  const box = svg("svg", { viewBox: "0 0 " + W + " " + H, width: W, height: H, class: "chart", "data-key": key });
  for (const v of yt.values) {
    box.append(svg("line", { x1: L, y1: Y(v), x2: W - R, y2: Y(v), class: "grid" }));
    const label = svg("text", { x: L - 4, y: Y(v) + 3, class: "tick y", "text-anchor": "end", "data-value": v });
    label.textContent = tickText(v, yt.step);
    box.append(label);
  }
  for (const v of xt.values) {
    const label = svg("text", { x: X(v), y: H - 8, class: "tick x", "text-anchor": "middle" });
    label.textContent = String(v);
    box.append(label);
  }
  box.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  if (!interval && points.length > 1) {
    box.append(svg("polyline", { points: points.map((p) => X(p[0]) + "," + Y(p[1])).join(" "), class: "line" }));
  }
  for (const p of points) {
    if (interval) box.append(svg("line", { x1: X(p[0]), y1: Y(p[2]), x2: X(p[0]), y2: Y(p[3]), class: "interval" }));
    const dot = svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: interval ? 3.5 : 2.5, class: "point" + (interval
      ? " heldout" : ""), "data-step": p[0], "data-value": p[1] });
    const tip = svg("title", {});
    tip.textContent = "step " + p[0] + ": " + p[1] + (interval ? " [" + p[2] + ", " + p[3] + "]" : "");
    dot.append(tip);
    box.append(dot);
  }
  return box;
}

async function showMetrics() {
  const [run] = parts();
  runLinks(run);
  document.getElementById("title").textContent = run;
  const data = await get(API + "/" + encodeURIComponent(run) + "/metrics");
  const filter = document.getElementById("keys");
  const all = [...Object.entries(data.intervals).map(([k, p]) => [k, p, true]),
    ...Object.entries(data.series).map(([k, p]) => [k, p, false])];
  // the figures first (the grid gives each its share of the page's width), then each chart at its figure's width
  const draw = () => {
    const want = filter.value.trim();
    const shown = all.filter(([k]) => !want || k.includes(want));
    const figures = shown.map(([k, , i]) => make("figure", { "data-key": k }, make("figcaption", {}, k
      + (i ? " (with interval)" : ""))));
    document.getElementById("charts").replaceChildren(...figures);
    figures.forEach((f, n) => f.append(chart(shown[n][0], shown[n][1], shown[n][2], f.clientWidth - 12)));
  };
  filter.addEventListener("input", draw);
  let pending = null;
  window.addEventListener("resize", () => { clearTimeout(pending); pending = setTimeout(draw, 150); });
  draw();
  document.getElementById("empty").hidden = data.rows > 0;
  say(data.rows + " rows");
}

const PAGES = { runs: showRuns, run: startEpisodes, episode: showEpisode, group: showGroup, searches: showSearches,
  metrics: showMetrics };

document.addEventListener("DOMContentLoaded", () => {
  PAGES[document.body.dataset.page]().then(() => { document.body.dataset.ready = "1"; })
    .catch((e) => say(e.message, true));
});
