// corral dashboard: plain DOM, no framework. Everything from the appliance (names,
// reasons, rules, errors: what an agent could have written) goes in with textContent,
// never as markup, and drawn by shown() (render.js): printable ASCII, on one line, the
// rest escaped. A text node is given a literal of this file's or shown(...), nothing else.
"use strict";

const token = new URLSearchParams(location.search).get("token") || "";
const state = { events: [], seen: new Set(), sessions: [], page: "approvals" };
const RENDER_MS = 300;
const pending = {};

// At most one render per RENDER_MS whatever the stream's rate: a flood of events must not
// freeze the page.
function later(name, render) {
  if (pending[name]) return;
  pending[name] = setTimeout(() => { delete pending[name]; render(); }, RENDER_MS);
}
const MAX_EVENTS = 500;

async function api(method, path, body) {
  const options = { method, headers: { "X-Corral-Token": token } };
  if (body !== undefined) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  const data = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
  trouble("");
  return data;
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = shown(text);
  if (className) node.className = className;
  return node;
}

function row(cells, className) {
  const tr = el("tr", null, className);
  for (const cell of cells) tr.append(cell instanceof Node ? cell : el("td", cell));
  return tr;
}

function cellWith(...nodes) {
  const td = el("td");
  td.append(...nodes);
  return td;
}

// A button answers only a single click, and only once it has been on the page for
// SETTLE_MS: a row that appears or moves under the pointer (an agent asking at the right
// moment) cannot take a click meant for another.
const SETTLE_MS = 700;

function button(label, className, action) {
  const b = el("button", label, className);
  const born = performance.now();
  b.addEventListener("click", async (event) => {
    if (event.detail > 1 || performance.now() - born < SETTLE_MS) return;
    b.disabled = true;
    try { await action(); } catch (error) { trouble(error.message); } finally { b.disabled = false; }
  });
  return b;
}

function trouble(message) {
  const p = document.getElementById("trouble");
  p.textContent = shown(message);
  p.hidden = !message;
}

function ago(ts) {
  const s = Math.max(0, Date.now() / 1000 - ts);
  return s >= 3600 ? `${Math.floor(s / 3600)}h` : s >= 60 ? `${Math.floor(s / 60)}m` : `${Math.floor(s)}s`;
}

function clock(ts) {
  return new Date(ts * 1000).toLocaleTimeString();
}

// -- approvals -------------------------------------------------------------------------

// A table is rebuilt only when what it shows changed: a button must not be replaced
// under the pointer that is about to click it.
const onPage = {};

function changed(name, data) {
  const text = JSON.stringify(data);
  if (onPage[name] === text) return false;
  onPage[name] = text;
  return true;
}

async function loadApprovals() {
  const { approvals } = await api("GET", "/api/approvals");
  document.getElementById("pending-count").textContent = shown(approvals.length || "");
  const body = document.getElementById("approvals-rows");
  const steady = approvals.map(({ id, session, kind, target, origin, note }) =>
    ({ id, session, kind, target, origin, note }));
  if (!changed("approvals", steady)) {  // counts and ages move on in place
    approvals.forEach((a, i) => {
      const cells = body.rows[i].cells;
      cells[3].textContent = shown(a.asked);
      cells[4].textContent = a.waiting ? "yes" : "";
      cells[5].textContent = shown(ago(a.created));
      const once = cells[8].querySelector("button.once");
      once.disabled = !a.waiting;
    });
    return;
  }
  body.replaceChildren(...approvals.map((a) => {
    const decide = (grant, extra, ask) => async () => {
      if (ask && !confirm(`${ask} ${shown(a.kind)} ${shown(a.target)} for session `
                          + `${shown(a.session)}?`)) return;
      await api("POST", `/api/approvals/${encodeURIComponent(a.id)}`, { grant, ...extra });
      delete onPage.approvals;
      await loadApprovals();
    };
    const once = button("once", "grant once", decide("once"));
    once.disabled = !a.waiting;
    once.title = a.waiting ? "let the waiting requests through, no rule" : "nothing waits now";
    return row([a.id, a.session, `${a.kind} ${a.target}`, a.asked, a.waiting ? "yes" : "",
                ago(a.created), a.origin, el("td", a.note || "", "untrusted"),
                cellWith(once, button("10 min", "grant for",
                                      decide("for", { duration: 600 }, "Allow for 10 minutes")),
                         button("session", "grant session",
                                decide("session", {}, "Allow for the session's life")),
                         button("refuse", "grant refuse", decide("refuse")))],
               "approval");
  }));
  document.getElementById("approvals-empty").hidden = approvals.length > 0;
}

// -- sessions --------------------------------------------------------------------------

async function loadSessions() {
  const { sessions } = await api("GET", "/api/sessions");
  state.sessions = sessions.map((s) => s.name);
  const body = document.getElementById("sessions-rows");
  const steady = sessions.map(({ created, left, ...rest }) => rest);
  if (!changed("sessions", steady)) {  // the times move on in place
    sessions.forEach((s, i) => {
      body.rows[i].cells[2].textContent = shown(s.created ? ago(s.created) : "-");
      body.rows[i].cells[3].textContent = shown(s.left === undefined || s.left === null ? "-"
        : duration(s.left));
    });
    return;
  }
  body.replaceChildren(...sessions.map((s) => {
    const stateText = s.state === "stopped" ? `stopped${s.reason ? ` (${s.reason})` : ""}`
      : (s.container_state || s.state || "-");
    const actions = cellWith();
    if (s.state !== "stopped") {
      actions.append(button("stop", "danger", async () => {
        if (confirm(`Stop ${shown(s.name)}? Its workspace stays for diff and apply.`)) {
          await api("POST", `/api/sessions/${encodeURIComponent(s.name)}/stop`);
          delete onPage.sessions;
          await loadSessions();
        }
      }));
    }
    actions.append(button("remove", "danger", async () => {
      if (confirm(`Remove ${shown(s.name)} and its workspace?`)) {
        await api("DELETE", `/api/sessions/${encodeURIComponent(s.name)}`);
        delete onPage.sessions;
        await loadSessions();
      }
    }));
    const limits = s.memory ? `${s.memory}/${s.cpus}/${s.pids}` : "-";
    return row([s.name, stateText, s.created ? ago(s.created) : "-",
                s.left === undefined || s.left === null ? "-" : duration(s.left),
                s.subnet || "-", s.allowed || 0, s.denied || 0, limits, actions]);
  }));
  document.getElementById("sessions-empty").hidden = sessions.length > 0;
  for (const id of ["decisions-session", "rules-session"]) fillSessions(id);
}

function fillSessions(id) {
  const select = document.getElementById(id);
  const chosen = select.value;
  const first = id === "decisions-session" ? [["", "every session"]] : [];
  select.replaceChildren(...[...first, ...state.sessions.map((n) => [n, n])].map(([value, text]) => {
    const option = el("option", text);
    option.value = value;
    return option;
  }));
  if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
}

// -- decisions -------------------------------------------------------------------------

function renderDecisions() {
  const session = document.getElementById("decisions-session").value;
  const verdict = document.getElementById("decisions-verdict").value;
  const picked = state.events.filter((e) => (!session || e.session === session)
    && (!verdict || e.verdict === verdict)).slice(-200).reverse();
  document.getElementById("decisions-rows").replaceChildren(...picked.map((e) => {
    const target = (e.name || e.target || "-") + (e.port ? `:${e.port}` : "");
    const reason = e.closed ? `${e.up || 0} B up, ${e.down || 0} B down, ${e.duration || 0}s`
      : (e.reason || "");
    return row([clock(e.ts || 0), e.session || "-",
                el("td", e.closed ? "done" : e.verdict, "verdict"), e.kind,
                el("td", target, "untrusted"), el("td", reason, "reason"),
                el("td", e.verdict !== "allow" && !e.closed ? (e.hint || "") : "", "hint")],
               e.closed ? "closed" : e.verdict);
  }));
}

function listen() {
  const link = document.getElementById("link");
  const source = new EventSource(`/api/events?token=${encodeURIComponent(token)}`);
  source.onopen = () => { link.textContent = "live"; link.className = "link live"; };
  source.onerror = () => { link.textContent = "reconnecting…"; link.className = "link"; };
  source.addEventListener("trouble", (m) => trouble(JSON.parse(m.data).error));
  source.onmessage = (m) => {
    const event = JSON.parse(m.data);
    if (event.id !== undefined && state.seen.has(event.id)) return;  // a reconnect's replay
    state.seen.add(event.id);
    state.events.push(event);
    if (state.events.length > MAX_EVENTS) {
      for (const old of state.events.splice(0, state.events.length - MAX_EVENTS)) {
        state.seen.delete(old.id);
      }
    }
    if (state.page === "decisions") later("decisions", renderDecisions);
    if (event.kind === "approval") later("approvals", () => loadApprovals().catch(
      (error) => trouble(error.message)));
  };
}

// -- rules -----------------------------------------------------------------------------

async function loadRules() {
  const session = document.getElementById("rules-session").value;
  const body = document.getElementById("rules-rows");
  if (!session) { body.replaceChildren(); return; }
  const { rules } = await api("GET", `/api/rules?session=${encodeURIComponent(session)}`);
  body.replaceChildren(...rules.map((r) => {
    const actions = cellWith();
    if (r.layer === "session") {
      actions.append(button("revoke", "danger", async () => {
        await api("DELETE", "/api/rules", { session, kind: r.kind, rule: r.rule });
        await loadRules();
      }));
    }
    return row([el("td", r.rule, "untrusted"), r.kind, r.layer, r.source,
                r.expires ? clock(r.expires) : "", actions]);
  }));
}

// -- health ----------------------------------------------------------------------------

function duration(seconds) {
  const s = Math.floor(seconds);
  return s >= 86400 ? `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`
    : s >= 3600 ? `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`
    : s >= 60 ? `${Math.floor(s / 60)}m ${s % 60}s` : `${s}s`;
}

function describe(name, value) {
  if (value && typeof value === "object" && "healthy" in value) {
    return [value.healthy ? "healthy" : `unhealthy: ${value.error || ""}`,
            value.healthy ? "ok" : "bad"];
  }
  if (name === "firewall" && value && typeof value === "object") {
    const counters = Object.entries(value.counters || {}).map(([k, v]) => `${k} ${v}`);
    return [`${value.loaded ? "loaded" : "NOT LOADED"}, ${value.rules} rules; dropped: `
            + (counters.join(", ") || "none"), value.loaded ? "ok" : "bad"];
  }
  if (name === "uptime" && typeof value === "number") return [duration(value), ""];
  return [typeof value === "object" ? JSON.stringify(value) : value, ""];
}

async function loadHealth() {
  const status = await api("GET", "/api/status");
  const list = document.getElementById("health-list");
  list.replaceChildren();
  for (const [name, value] of Object.entries(status)) {
    const [text, className] = describe(name, value);
    list.append(el("dt", name), el("dd", text, className));
  }
}

async function verifyAudit() {
  const out = document.getElementById("verify-result");
  out.textContent = "reading every segment…";
  const verdict = await api("GET", "/api/audit/verify");
  out.textContent = shown(verdict.intact ? `intact: ${verdict.lines} records`
    : `broken: ${verdict.error || JSON.stringify(verdict)}`);
  out.className = verdict.intact ? "ok" : "bad";
}

// -- pages -----------------------------------------------------------------------------

const loaders = { approvals: loadApprovals, sessions: loadSessions, rules: loadRules,
                  health: loadHealth, decisions: async () => renderDecisions() };

function show(page) {
  state.page = page;
  for (const section of document.querySelectorAll("section.page")) section.hidden = section.id !== page;
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("current", b.dataset.page === page);
  loaders[page]().catch((error) => trouble(error.message));
}

document.addEventListener("DOMContentLoaded", () => {
  for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => show(b.dataset.page));
  document.getElementById("decisions-session").addEventListener("change", renderDecisions);
  document.getElementById("decisions-verdict").addEventListener("change", renderDecisions);
  document.getElementById("rules-session").addEventListener("change", () => loadRules().catch((e) => trouble(e.message)));
  document.getElementById("verify").addEventListener("click", () => verifyAudit().catch((e) => trouble(e.message)));
  loadSessions().then(() => show(state.page)).catch((error) => trouble(error.message));
  listen();
  setInterval(() => loadApprovals().catch((error) => trouble(error.message)), 2000);
  setInterval(() => loadSessions().catch(() => {}), 5000);
});
