// Meshnet dashboard: plain JavaScript, no build step, no third-party code.
//
// Data comes only from the gateway's public API (docs/dashboard.md):
//   GET /v1/models                     the model id and its layer count (once)
//   GET /v1/swarm, /v1/health          nodes, their health and the active sessions (every 2 s)
//   GET /v1/audits                     the latest audit verdicts (every 2 s, with the swarm)
//   GET /v1/generations                snapshots of the running generations (every second)
//   GET /v1/generations/{id}/events    each running generation's live events (EventSource)
//   POST /v1/chat/completions          the chat box, streamed (SSE read from fetch's body)
//
// A gateway started with --api-keys answers 401 (invalid_api_key) without a key: the page then stops
// polling and asks for one, and signs in with it (POST /dashboard/key): the gateway sets the
// meshnet_api_key cookie itself, HttpOnly and SameSite=Strict, for its /v1/ endpoints only. No script
// (this page's included) can read it; every fetch and EventSource of the page carries it.
//
// Everything a node, the tracker or the model says is data: it reaches the page only through
// textContent and attribute setters, never as markup.
"use strict";

const SWARM_EVERY_MS = 2000;
const GENERATIONS_EVERY_MS = 1000;
const KEEP_FINISHED = 6; // finished generations kept on the page
const MAX_STREAMS = 3; // EventSources at once: a browser opens at most 6 connections to one host
const MAX_SAMPLES = 400; // tokens/s points a generation's sparkline keeps (4 a second)
const GONE_KEEP_MS = 60000; // a node the tracker stopped listing stays on the page this long
const TERMINAL = new Set(["generation.completed", "generation.failed"]);
const KEY_PATH = "/dashboard/key"; // sign in (POST {key}), sign out (DELETE); the gateway sets the cookie

const state = {
  model: null, // {id, layers, contextCap, architecture, quantization}
  swarm: null,
  health: null,
  nodes: new Map(), // node id -> {data, present, lastSeen}
  gens: new Map(), // generation id -> generation record (see newGen)
  cards: new Map(), // generation id -> its card element
  chat: { messages: [], busy: false, abort: null },
  lastUpdate: null,
  connected: null,
  auth: { keys: false, signedIn: false, needed: false }, // keys needed; signed in; the key refused
};

// -- DOM helpers (text only) ------------------------------------------------------------------
const SAFE_ATTRS = new Set(["title", "role", "type", "datetime"]);

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else if (key.startsWith("data-") || key.startsWith("aria-") || SAFE_ATTRS.has(key)) node.setAttribute(key, String(value));
    else throw new Error(`el: attribute ${key} is not allowed`);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child)); // a string becomes a Text node
  }
  return node;
}

const $ = (id) => document.getElementById(id);

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  return node;
}

// -- formatting -------------------------------------------------------------------------------
function num(value, digits = 1) {
  return typeof value === "number" && Number.isFinite(value) ? value.toFixed(digits) : "—";
}

function bytes(value) {
  if (typeof value !== "number" || !Number.isFinite(value)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = value;
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

function seconds(value) {
  if (typeof value !== "number" || !Number.isFinite(value)) return "—";
  return value < 10 ? `${value.toFixed(2)} s` : `${value.toFixed(1)} s`;
}

function str(value, fallback = "—") {
  return value === null || value === undefined || value === "" ? fallback : String(value);
}

function parseLayers(text) {
  const match = /^(\d+):(\d+)$/.exec(String(text ?? ""));
  if (!match) return null;
  const start = Number(match[1]);
  const stop = Number(match[2]);
  return stop > start ? { start, stop } : null;
}

const hues = new Map(); // node id -> hue, in order of first appearance: neighbours get distinct colours
function hue(id) {
  const key = String(id);
  if (!hues.has(key)) hues.set(key, Math.round((205 + hues.size * 137.508) % 360));
  return hues.get(key);
}

function nodeId(node) {
  return str(node.node_id ?? node.node, "?");
}

// -- API keys ---------------------------------------------------------------------------------
// Thrown by apiFetch on a 401: the key form is up and polling has stopped; callers just give up.
class KeyRequired extends Error {}

function showSignedIn(signedIn) {
  state.auth.signedIn = signedIn;
  $("key-forget").hidden = !signedIn;
}

// The gateway checks the key and, if it is one of its keys, sets the cookie; its refusal is the API's.
async function signIn(key) {
  const response = await fetch(KEY_PATH, {
    method: "POST",
    cache: "no-store",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ key }),
  });
  if (response.status === 401) {
    const body = await response.json().catch(() => null);
    const error = body && body.error ? body.error : {};
    needKey(error.message);
    throw new KeyRequired(str(error.message, "this gateway needs an API key"));
  }
  if (!response.ok) throw new Error(await errorMessage(response));
}

// The gateway refused the request's key (or there was none): stop and ask for one.
function needKey(message) {
  const first = !state.auth.needed;
  state.auth.needed = true;
  state.auth.keys = true;
  showSignedIn(false);
  $("key-message").textContent = str(message, "This gateway needs an API key.");
  $("auth").hidden = false;
  $("key-use").disabled = false;
  if (!state.model) $("model-id").textContent = "—";
  const conn = $("conn");
  conn.dataset.state = "locked";
  conn.textContent = "API key needed";
  conn.title = "";
  if (first) {
    clearTimeout(timers.swarm);
    clearTimeout(timers.generations);
    $("key-input").focus();
  }
}

async function useKey(key) {
  $("key-use").disabled = true;
  $("key-message").textContent = "checking the key…";
  state.auth.needed = false;
  try {
    await signIn(key);
    await loadModel();
  } catch (err) {
    if (!(err instanceof KeyRequired)) {
      state.auth.needed = true;
      $("key-message").textContent = `cannot check the key: ${err.message}`;
    }
    return; // a refused key is not kept; the form shows the gateway's answer
  } finally {
    $("key-use").disabled = false;
  }
  $("key-input").value = "";
  $("key-message").textContent = "";
  $("auth").hidden = true;
  showSignedIn(true);
  resume();
}

async function forgetKey() {
  await fetch(KEY_PATH, { method: "DELETE", cache: "no-store" }).catch(() => null);
  showSignedIn(false);
  $("key-input").value = "";
  resume(); // a gateway that needs a key says so again on the next call
}

async function setupKeys() {
  showSignedIn(false);
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) {
      $("key-message").textContent = "Enter the gateway's API key.";
      return;
    }
    useKey(key);
  });
  $("key-forget").addEventListener("click", forgetKey);
  // Whether this gateway takes keys at all: then an API that answers means the page is signed in.
  const info = await fetch(KEY_PATH, { cache: "no-store" }).then((r) => r.json()).catch(() => null);
  state.auth.keys = Boolean(info && info.keys === true);
  if (state.auth.keys && state.model && !state.auth.needed) showSignedIn(true);
}

// -- fetching ---------------------------------------------------------------------------------
// fetch (the gateway's cookie, when the page signed in, goes with it by itself); a 401 raises the key form.
async function apiFetch(path, init = {}) {
  const response = await fetch(path, { cache: "no-store", ...init });
  if (response.status === 401) {
    const body = await response.json().catch(() => null);
    const error = body && body.error ? body.error : {};
    needKey(error.message);
    throw new KeyRequired(str(error.message, "this gateway needs an API key"));
  }
  return response;
}

// The message of an error response, in OpenAI's shape, with its Retry-After (a 429) when it has one.
async function errorMessage(response) {
  const body = await response.json().catch(() => null);
  let message = body && body.error && body.error.message ? String(body.error.message) : `HTTP ${response.status}`;
  const retry = response.headers.get("Retry-After");
  if (response.status === 429 && retry && !/retry/i.test(message)) message += ` (retry in ${retry} s)`;
  return message;
}

async function getJson(path) {
  const response = await apiFetch(path, { headers: { Accept: "application/json" } });
  if (!response.ok) throw new Error(`${path}: ${await errorMessage(response)}`);
  return response.json().catch(() => null);
}

async function loadModel() {
  const models = await getJson("/v1/models");
  const first = models && Array.isArray(models.data) ? models.data[0] : null;
  if (!first) throw new Error("/v1/models lists no model");
  const meta = first.meshnet || {};
  state.model = {
    id: String(first.id),
    layers: Number.isInteger(meta.layers) ? meta.layers : null,
    contextCap: meta.context_cap,
    architecture: meta.architecture,
    quantization: meta.quantization,
  };
  $("model-id").textContent = state.model.id;
  if (state.auth.keys) showSignedIn(true); // the gateway's cookie opened the API
  const parts = [
    state.model.architecture,
    state.model.quantization,
    state.model.layers ? `${state.model.layers} layers` : null,
    state.model.contextCap ? `context ${state.model.contextCap}` : null,
  ].filter(Boolean);
  $("model-meta").textContent = parts.join(" · ");
}

function setConnected(ok, why) {
  state.connected = ok;
  const conn = $("conn");
  conn.dataset.state = ok ? "live" : "down";
  conn.textContent = ok ? "live" : "gateway unreachable";
  conn.title = ok ? "" : str(why, "");
}

// The two polling loops. An epoch ends a loop: resume() starts fresh ones, and a loop that finds the
// epoch moved on (or the key form up) does not go round again.
const timers = { swarm: null, generations: null };
let epoch = 0;

function again(name, fn, ms, mine) {
  if (mine !== epoch || state.auth.needed) return;
  timers[name] = setTimeout(() => fn(mine), ms);
}

function resume() {
  epoch += 1;
  clearTimeout(timers.swarm);
  clearTimeout(timers.generations);
  state.auth.needed = false;
  pollSwarm(epoch);
  pollGenerations(epoch);
}

async function pollSwarm(mine) {
  try {
    if (!state.model) await loadModel();
    const swarm = await getJson("/v1/swarm");
    const health = await getJson("/v1/health").catch(() => null);
    state.audits = await getJson("/v1/audits?limit=10").catch(() => null);
    state.swarm = swarm;
    state.health = health;
    mergeNodes(swarm);
    state.lastUpdate = new Date();
    setConnected(true);
    renderSwarm();
  } catch (err) {
    if (!(err instanceof KeyRequired)) setConnected(false, err.message);
  } finally {
    again("swarm", pollSwarm, SWARM_EVERY_MS, mine);
  }
}

async function pollGenerations(mine) {
  try {
    const list = await getJson("/v1/generations");
    const active = new Set();
    for (const snap of Array.isArray(list.data) ? list.data : []) {
      if (!snap || typeof snap.generation_id !== "string") continue;
      active.add(snap.generation_id);
      const gen = track(snap.generation_id, "api");
      applySnapshot(gen, snap);
    }
    // A generation that left the list has finished: if its event stream broke, fetch its last snapshot.
    // (One never subscribed gets its stream below, history included.)
    for (const gen of state.gens.values()) {
      if (!gen.finished && !active.has(gen.id) && gen.streamed && !gen.stream && !gen.fetchingFinal) {
        gen.fetchingFinal = true;
        getJson(`/v1/generations/${encodeURIComponent(gen.id)}`)
          .then((snap) => applySnapshot(gen, snap))
          .catch((err) => {
            if (err instanceof KeyRequired) return; // asked again once there is a key
            gen.finished = true;
            gen.phase = gen.phase === "failed" ? "failed" : "gone";
          })
          .finally(() => {
            gen.fetchingFinal = false;
            scheduleRender();
          });
      }
    }
    startStreams();
    scheduleRender();
  } catch (err) {
    if (!(err instanceof KeyRequired)) setConnected(false, err.message);
  } finally {
    again("generations", pollGenerations, GENERATIONS_EVERY_MS, mine);
  }
}

// -- nodes ------------------------------------------------------------------------------------
function mergeNodes(swarm) {
  const now = Date.now();
  const seen = new Set();
  for (const node of Array.isArray(swarm.nodes) ? swarm.nodes : []) {
    if (!node || typeof node !== "object") continue;
    const id = nodeId(node);
    seen.add(id);
    state.nodes.set(id, { data: node, present: true, lastSeen: now });
  }
  for (const [id, entry] of state.nodes) {
    if (seen.has(id)) continue;
    if (swarm.error) continue; // the tracker is unreachable: nothing is known about the nodes
    entry.present = false;
    if (now - entry.lastSeen > GONE_KEEP_MS) state.nodes.delete(id);
  }
}

function nodeState(entry) {
  const node = entry.data;
  if (!entry.present) return "gone";
  if (node.suspended === true || node.state === "suspended") return "suspended";
  if (typeof node.state === "string" && node.state) return node.state;
  const status = node.health && node.health.status;
  if (status === "ok") return "up";
  return str(status, "unknown");
}

function trustOf(node) {
  for (const source of [node, node.health || {}]) {
    if (typeof source.trusted === "boolean") return source.trusted ? "trusted" : "untrusted";
    if (typeof source.trust === "boolean") return source.trust ? "trusted" : "untrusted";
    if (typeof source.trust === "string" && source.trust) return source.trust;
  }
  return null;
}

function activeRoutes() {
  // node id -> number of active sessions routed through it
  const busy = new Map();
  const sessions = state.swarm && Array.isArray(state.swarm.sessions) ? state.swarm.sessions : [];
  for (const session of sessions) {
    for (const hop of Array.isArray(session.route) ? session.route : []) {
      const id = str(hop.node, "?");
      busy.set(id, (busy.get(id) || 0) + 1);
    }
  }
  return busy;
}

function layerCount() {
  if (state.model && state.model.layers) return state.model.layers;
  let n = 0;
  for (const { data } of state.nodes.values()) {
    if (Number.isInteger(data.total_layers)) n = Math.max(n, data.total_layers);
    const range = parseLayers(data.layers);
    if (range) n = Math.max(n, range.stop);
  }
  return n;
}

function renderSwarm() {
  const swarm = state.swarm || {};
  const banner = $("banner");
  banner.hidden = !swarm.error;
  banner.textContent = swarm.error ? `Tracker: ${swarm.error}` : "";
  renderSummary();
  renderLayerMap();
  renderNodes();
  renderSessions();
  renderAudits();
  scheduleRender(); // the cards' link RTTs come from the nodes
  $("updated").textContent = state.lastUpdate ? state.lastUpdate.toLocaleTimeString() : "never";
}

function renderSummary() {
  const entries = [...state.nodes.values()];
  const up = entries.filter((e) => nodeState(e) === "up");
  const n = layerCount();
  const covered = new Set();
  for (const e of up) {
    const range = parseLayers(e.data.layers);
    if (range) for (let i = range.start; i < Math.min(range.stop, n); i += 1) covered.add(i);
  }
  const running = [...state.gens.values()].filter((g) => !g.finished);
  const tps = running.reduce((sum, g) => sum + (g.phase === "decode" ? g.tps || 0 : 0), 0);
  const health = state.health || {};
  const tracker = state.swarm ? state.swarm.tracker : null;
  const stat = (label, value, cls, key) =>
    el("div", { class: `stat ${cls || ""}`, "data-stat": key }, el("div", { class: "stat-value", text: value }), el("div", { class: "stat-label", text: label }));
  $("summary").replaceChildren(
    stat("nodes up", `${up.length} / ${entries.length}`, up.length && up.length === entries.length ? "good" : "warn", "nodes"),
    stat("layers covered", n ? `${covered.size} / ${n}` : "—", n && covered.size === n ? "good" : "bad", "coverage"),
    stat("running generations", String(health.active_generations ?? running.length), "", "running"),
    stat("queued", String(health.queue_depth ?? 0), health.queue_depth ? "warn" : "", "queue"),
    stat("decode tokens/s", num(tps), "", "tps"),
    stat("tracker", tracker ? String(tracker) : "none (one process)", "small-value", "tracker"),
  );
}

function renderLayerMap() {
  const n = layerCount();
  const map = $("layer-map");
  if (!n) {
    map.replaceChildren(el("p", { class: "empty", text: "No node has registered yet." }));
    return;
  }
  $("layers-caption").textContent = `0 … ${n - 1}`;
  const busy = activeRoutes();
  const pct = (x) => `${(100 * x) / n}%`;

  // coverage: one cell per layer, shaded by how many live nodes hold it
  const holders = Array.from({ length: n }, () => []);
  const ranged = [];
  for (const [id, entry] of state.nodes) {
    const range = parseLayers(entry.data.layers);
    if (!range || entry.data.auditor === true) continue; // an auditor serves no route: not on the bar
    ranged.push({ id, entry, range });
    if (nodeState(entry) !== "up") continue;
    for (let i = range.start; i < Math.min(range.stop, n); i += 1) holders[i].push(id);
  }
  const cells = holders.map((ids, i) =>
    el("div", {
      class: `cell c${Math.min(ids.length, 3)}`,
      "data-layer": i,
      title: ids.length ? `layer ${i}: ${ids.join(", ")}` : `layer ${i}: no live node holds it`,
    }),
  );
  const coverage = el("div", { class: "coverage" }, cells);

  // ruler
  const step = n <= 16 ? 1 : n <= 40 ? 5 : n <= 100 ? 10 : 20;
  const ticks = [];
  for (let i = 0; i < n; i += step) ticks.push(i);
  if (ticks[ticks.length - 1] !== n - 1) ticks.push(n - 1);
  const ruler = el(
    "div",
    { class: "ruler" },
    ticks.map((i) => {
      const tick = el("span", { class: "tick", text: i });
      tick.style.left = pct(i + 0.5);
      return tick;
    }),
  );

  // one lane per set of non-overlapping nodes
  ranged.sort((a, b) => a.range.start - b.range.start || a.id.localeCompare(b.id));
  const lanes = [];
  for (const item of ranged) {
    let lane = lanes.find((l) => l.stop <= item.range.start);
    if (!lane) {
      lane = { stop: 0, items: [] };
      lanes.push(lane);
    }
    lane.items.push(item);
    lane.stop = item.range.stop;
  }
  const laneEls = lanes.map((lane) =>
    el(
      "div",
      { class: "lane" },
      lane.items.map(({ id, entry, range }) => {
        const node = entry.data;
        const st = nodeState(entry);
        const backend = str(node.backend ?? (node.health && node.health.backend), "");
        const sessions = busy.get(id) || 0;
        const seg = el(
          "div",
          {
            class: `segment state-${st.replace(/[^a-z]/g, "")}${sessions ? " busy" : ""}`,
            "data-node-id": id,
            "data-layers": `${range.start}:${range.stop}`,
            "data-backend": backend,
            "data-state": st,
            title: `${id} · layers ${range.start}:${range.stop} (${range.start}…${range.stop - 1}) · ${backend || "backend ?"} · ${st}` +
              (sessions ? ` · ${sessions} active session(s)` : ""),
          },
          el("span", { class: "seg-id", text: id }),
          el("span", { class: "seg-range", text: `${range.start}:${range.stop}` }),
          backend ? el("span", { class: "seg-backend", text: backend }) : null,
        );
        seg.style.left = pct(Math.min(range.start, n));
        seg.style.width = pct(Math.min(range.stop, n) - Math.min(range.start, n));
        seg.style.setProperty("--hue", String(hue(id)));
        return seg;
      }),
    ),
  );
  map.replaceChildren(ruler, coverage, ...laneEls);
}

function renderNodes() {
  const entries = [...state.nodes.entries()].sort((a, b) => {
    const ra = parseLayers(a[1].data.layers);
    const rb = parseLayers(b[1].data.layers);
    return (ra ? ra.start : 1e9) - (rb ? rb.start : 1e9) || a[0].localeCompare(b[0]);
  });
  const showTrust = entries.some(([, e]) => trustOf(e.data) !== null);
  const columns = ["Node", "Layers", "Backend", "State", "Load", "Free KV", "Speed (pos/s)", "Reliability"];
  if (showTrust) columns.push("Trust");
  columns.push("Next-hop RTT");
  $("nodes-head").replaceChildren(...columns.map((c) => el("th", { text: c })));
  const urls = new Map(entries.map(([id, e]) => [String(e.data.url ?? ""), id]));

  const rows = entries.map(([id, entry]) => {
    const node = entry.data;
    const health = node.health || {};
    const st = nodeState(entry);
    const free = health.kv_bytes_free ?? node.kv_bytes_free;
    const used = health.kv_bytes_used;
    const perToken = health.kv_bytes_per_token ?? node.kv_bytes_per_token;
    const kvCell = el("td", { class: "kv" }, el("div", { text: bytes(free) }));
    if (typeof free === "number" && typeof used === "number" && free + used > 0) {
      const bar = el("div", { class: "meter", title: `${bytes(used)} used of ${bytes(free + used)}` }, el("div", { class: "meter-fill" }));
      bar.firstChild.style.width = `${(100 * used) / (free + used)}%`;
      kvCell.append(bar);
    }
    if (typeof free === "number" && typeof perToken === "number" && perToken > 0) {
      kvCell.append(el("div", { class: "muted small", text: `≈ ${Math.floor(free / perToken).toLocaleString()} positions` }));
    }
    const parked = health.kv_bytes_parked;
    if (typeof parked === "number" && parked > 0) {
      // cached prefixes and standby snapshots kept in the free part: they yield to new sessions
      kvCell.append(el("div", { class: "muted small", title: "cached KV kept in free sequences; a new session takes its room", text: `${bytes(parked)} of it cached` }));
    }
    const sessions = health.sessions;
    const maxSessions = health.max_sessions;
    const load = el(
      "td",
      { "data-col": "load" },
      el("div", { text: `queue ${str(node.queue_depth, "0")}` }),
      el("div", { class: "muted small", text: `sessions ${str(sessions)}${maxSessions ? ` / ${maxSessions}` : ""}` }),
    );
    const speed = el(
      "td",
      {},
      el("div", { text: `prefill ${node.prefill_tps ? num(node.prefill_tps, 0) : "—"}` }),
      el("div", { text: `decode ${node.decode_tps ? num(node.decode_tps, 0) : "—"}` }),
    );
    const rel = typeof node.reliability === "number" ? `${(100 * node.reliability).toFixed(1)}%` : "—";
    const rtts = node.latency_ms && typeof node.latency_ms === "object" ? Object.entries(node.latency_ms) : [];
    const rttCell = el(
      "td",
      { class: "small" },
      rtts.length
        ? rtts.map(([url, ms]) => el("div", { text: `→ ${urls.get(url) ?? url}: ${num(Number(ms), 2)} ms` }))
        : el("span", { class: "muted", text: "—" }),
    );
    const cells = [
      el(
        "td",
        {},
        el("div", { class: "mono strong", text: id }),
        el("div", { class: "muted small mono", text: str(node.url, "") }),
        node.auditor === true ? el("span", { class: "badge warn", text: "auditor", title: "re-executes audited sessions; never routed" }) : null,
        typeof node.suspended === "string" ? el("span", { class: "badge hop-bad", text: "suspended", title: node.suspended }) : null,
      ),
      el("td", { class: "mono", text: str(node.layers) }),
      el("td", {}, el("div", { text: str(node.backend ?? health.backend) }), el("div", { class: "muted small", text: str(node.quantization, "") })),
      el("td", {}, el("span", { class: `badge state-${st.replace(/[^a-z]/g, "")}`, text: st, title: stateHelp(st, health) })),
      load,
      kvCell,
      speed,
      el("td", { text: rel }),
    ];
    if (showTrust) {
      const trust = trustOf(node);
      cells.push(el("td", {}, trust ? el("span", { class: `badge trust-${trust === "trusted" ? "yes" : "no"}`, text: trust }) : "—"));
    }
    cells.push(rttCell);
    return el("tr", { "data-node-id": id, "data-layers": str(node.layers, ""), "data-state": st }, cells);
  });
  $("nodes-body").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", text: "No nodes.", "data-empty": "1" }))]),
  );
}

function stateHelp(st, health) {
  if (st === "gone") return "no longer in the tracker's live set: suspended after a failure report, or expired";
  if (st === "up") return "registered and answering /v1/health";
  return str(health.reason, st);
}

function hopChain(hops) {
  const chain = el("div", { class: "chain" });
  hops.forEach((hop, i) => {
    if (i > 0) {
      const prev = hops[i - 1];
      const rtt = linkRtt(prev, hop);
      chain.append(el("span", { class: "arrow", text: rtt === null ? "→" : `→ ${num(rtt, 1)} ms →`, title: "round trip the upstream node measured" }));
    }
    const chip = el("span", { class: "chip mono", "data-node-id": str(hop.node, "?") }, el("b", { text: str(hop.node, "?") }), ` ${str(hop.layers, "")}`);
    chip.style.setProperty("--hue", String(hue(str(hop.node, "?"))));
    chain.append(chip);
  });
  return chain;
}

function linkRtt(from, to) {
  const entry = state.nodes.get(str(from.node, "?"));
  const table = entry && entry.data.latency_ms;
  const ms = table && to.url !== undefined ? table[to.url] : undefined;
  return typeof ms === "number" ? ms : null;
}

function renderAudits() {
  // Audit sampling (docs/security.md): the gateway's latest verdicts; a failed hop stands out.
  const audits = state.audits;
  const box = $("audits");
  if (!audits || !(audits.audit_rate > 0)) {
    $("audits-caption").textContent = "off (meshnet gateway --audit-rate R)";
    box.replaceChildren(el("p", { class: "empty", text: "No sessions are audited." }));
    return;
  }
  const counts = audits.counts || {};
  $("audits-caption").textContent =
    `${num(100 * audits.audit_rate, 1)}% of sessions · ${counts.pass || 0} passed · ` +
    `${counts.fail || 0} failed · ${counts.skipped || 0} skipped`;
  const list = Array.isArray(audits.audits) ? audits.audits : [];
  if (!list.length) {
    box.replaceChildren(el("p", { class: "empty", text: "No audit yet." }));
    return;
  }
  const rows = list.map((a) =>
    el(
      "tr",
      { "data-verdict": str(a.verdict, "") },
      el("td", {}, el("span", { class: `badge ${a.verdict === "fail" ? "hop-bad" : "hop-ok"}`, text: str(a.verdict) })),
      el("td", { class: "mono", text: str(a.node_id) }),
      el("td", { class: "mono small", text: str(a.layers) }),
      el("td", { class: "mono small", text: str(a.session_id) }),
      el("td", { class: "small", text: str(a.reason) }),
      el("td", { class: "mono small", text: Array.isArray(a.auditors) ? a.auditors.join(", ") : "—" }),
    ),
  );
  const head = el("tr", {}, ["Verdict", "Node", "Layers", "Session", "Reason", "Auditors"].map((c) => el("th", { text: c })));
  box.replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

function renderSessions() {
  const sessions = state.swarm && Array.isArray(state.swarm.sessions) ? state.swarm.sessions : [];
  const box = $("sessions");
  if (!sessions.length) {
    box.replaceChildren(el("p", { class: "empty", text: "No active sessions." }));
    return;
  }
  const rows = sessions.map((s) =>
    el(
      "tr",
      { "data-session-id": str(s.session_id, "") },
      el("td", { class: "mono", text: str(s.generation_id) }),
      el("td", {}, el("span", { class: `badge phase-${str(s.phase, "").replace(/[^a-z]/g, "")}`, text: str(s.phase) })),
      el("td", { class: "mono small", text: str(s.session_id) }),
      el("td", { class: "mono small", text: str(s.route_id) }),
      el("td", {}, hopChain(Array.isArray(s.route) ? s.route : [])),
    ),
  );
  const head = el("tr", {}, ["Generation", "Phase", "Session", "Route id", "Route"].map((c) => el("th", { text: c })));
  box.replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

// -- generations ------------------------------------------------------------------------------
function newGen(id) {
  return {
    id,
    source: null, // "chat" when this page's chat box started it
    phase: "queued",
    finished: false,
    stream: null, // its EventSource while subscribed
    streamed: false, // ever subscribed
    sessionId: null,
    routeId: null,
    route: [],
    promptTokens: null,
    prefillDone: 0,
    prefillTotal: null,
    prefillSeconds: null,
    prefillTps: null,
    completionTokens: 0,
    tps: 0,
    meanTps: null,
    seconds: null,
    elapsed: null,
    firstTokenT: null,
    hops: null, // route.health hops (per-hop timings)
    queueDepth: null,
    retries: [],
    retryCount: 0,
    drafted: 0,
    accepted: 0,
    billing: null,
    finishReason: null,
    error: null,
    warning: null,
    updates: 0, // events and snapshots applied (the page's live-update count)
    samples: [], // [t, tokens/s] for the sparkline
    created: Date.now(),
    fetchingFinal: false,
  };
}

function track(id, source) {
  let gen = state.gens.get(id);
  if (!gen) {
    gen = newGen(id);
    state.gens.set(id, gen);
  }
  if (source === "chat") gen.source = "chat";
  return gen;
}

function startStreams() {
  if (state.auth.needed) return;
  const open = [...state.gens.values()].filter((g) => g.stream).length;
  let budget = MAX_STREAMS - open;
  const waiting = [...state.gens.values()]
    .filter((g) => !g.finished && !g.stream && !g.streamed)
    .sort((a, b) => (b.source === "chat") - (a.source === "chat") || a.created - b.created);
  for (const gen of waiting) {
    if (budget <= 0) break;
    subscribe(gen);
    budget -= 1;
  }
}

function subscribe(gen) {
  gen.streamed = true;
  const source = new EventSource(`/v1/generations/${encodeURIComponent(gen.id)}/events`);
  let opened = false;
  gen.stream = source;
  source.onopen = () => {
    opened = true;
  };
  source.onmessage = (message) => {
    let event;
    try {
      event = JSON.parse(message.data);
    } catch {
      return;
    }
    applyEvent(gen, event);
    if (TERMINAL.has(event.type)) closeStream(gen);
    scheduleRender();
  };
  source.onerror = () => {
    // The gateway went away or the stream broke before the end: stop (no reconnect storm); the
    // polled snapshots go on. An EventSource does not tell why it failed: one that never opened may
    // have been refused its key (a 401), which a plain request for the snapshot finds out.
    closeStream(gen);
    scheduleRender();
    if (opened) return;
    getJson(`/v1/generations/${encodeURIComponent(gen.id)}`)
      .then((snap) => applySnapshot(gen, snap))
      .catch((err) => {
        if (err instanceof KeyRequired) gen.streamed = false; // subscribe again once there is a key
      })
      .finally(scheduleRender);
  };
}

function closeStream(gen) {
  if (gen.stream) {
    gen.stream.close();
    gen.stream = null;
    startStreams();
  }
}

function applyEvent(gen, e) {
  gen.updates += 1;
  const t = typeof e.t === "number" ? e.t : null;
  if (t !== null) gen.elapsed = Math.max(gen.elapsed || 0, t);
  switch (e.type) {
    case "route.accepted":
    case "route.retry":
      if (Array.isArray(e.nodes)) gen.route = e.nodes;
      gen.sessionId = e.session_id ?? gen.sessionId;
      gen.routeId = e.route_id ?? gen.routeId;
      if (e.type === "route.retry") {
        gen.retries.push(e);
        gen.retryCount = Math.max(gen.retryCount, gen.retries.length);
      }
      break;
    case "model.selected":
      if (e.warning) gen.warning = String(e.warning);
      break;
    case "route.health":
      if (e.status === "queued") {
        gen.phase = "queued";
        gen.queueDepth = e.queue_depth ?? null;
      }
      if (Array.isArray(e.hops) && e.hops.length) gen.hops = e.hops;
      break;
    case "prefill.started":
      gen.phase = "prefill";
      gen.prefillTotal = e.prompt_tokens ?? gen.prefillTotal;
      gen.prefillDone = 0;
      break;
    case "prefill.progress":
      gen.phase = "prefill";
      gen.prefillDone = e.done ?? gen.prefillDone;
      gen.prefillTotal = e.total ?? gen.prefillTotal;
      break;
    case "prefill.completed":
      gen.prefillDone = e.prompt_tokens ?? gen.prefillTotal ?? gen.prefillDone;
      gen.prefillTotal = e.prompt_tokens ?? gen.prefillTotal;
      gen.prefillSeconds = e.seconds ?? null;
      gen.prefillTps = e.tokens_per_second ?? null;
      break;
    case "billing.estimate":
      gen.billing = e.units ?? gen.billing;
      break;
    case "decode.started":
      gen.phase = "decode";
      if (gen.firstTokenT === null) gen.firstTokenT = t;
      break;
    case "decode.progress":
      gen.phase = "decode";
      gen.completionTokens = Math.max(gen.completionTokens, e.completion_tokens ?? 0);
      gen.tps = e.tokens_per_second ?? gen.tps;
      if (typeof e.drafted_tokens === "number") gen.drafted = e.drafted_tokens;
      if (typeof e.accepted_tokens === "number") gen.accepted = e.accepted_tokens;
      if (t !== null && typeof e.tokens_per_second === "number") {
        gen.samples.push([t, e.tokens_per_second]);
        if (gen.samples.length > MAX_SAMPLES) gen.samples.splice(0, gen.samples.length - MAX_SAMPLES);
      }
      break;
    case "generation.completed":
      gen.phase = "completed";
      gen.finished = true;
      gen.finishReason = e.finish_reason ?? null;
      gen.completionTokens = e.completion_tokens ?? gen.completionTokens;
      gen.meanTps = e.tokens_per_second ?? null;
      gen.seconds = e.seconds ?? null;
      break;
    case "generation.failed":
      gen.phase = "failed";
      gen.finished = true;
      gen.error = `${str(e.reason, "failed")}${e.code ? ` (${e.code})` : ""}`;
      break;
    default:
      break;
  }
}

function applySnapshot(gen, s) {
  if (!s || typeof s !== "object") return;
  gen.updates += 1;
  if (!gen.stream || s.finished) {
    // Events are finer-grained; the snapshot fills in while no stream is open.
    if (typeof s.phase === "string") gen.phase = s.phase;
    gen.finished = gen.finished || s.finished === true;
  }
  gen.sessionId = s.session_id ?? gen.sessionId;
  gen.routeId = s.route_id ?? gen.routeId;
  if (Array.isArray(s.route) && s.route.length) gen.route = s.route;
  if (typeof s.prompt_tokens === "number") gen.prefillTotal = gen.prefillTotal ?? s.prompt_tokens;
  if (typeof s.prefill_done === "number" && !gen.stream) gen.prefillDone = s.prefill_done;
  if (typeof s.completion_tokens === "number") gen.completionTokens = Math.max(gen.completionTokens, s.completion_tokens);
  if (typeof s.tokens_per_second === "number" && !gen.stream) gen.tps = s.tokens_per_second;
  if (typeof s.elapsed === "number") gen.elapsed = Math.max(gen.elapsed || 0, s.elapsed);
  if (typeof s.retries === "number") gen.retryCount = Math.max(gen.retryCount, s.retries);
  if (typeof s.billing_units === "number") gen.billing = s.billing_units;
  if (s.finish_reason) gen.finishReason = s.finish_reason;
  if (s.error) gen.error = String(s.error);
  if (s.speculation) {
    gen.drafted = s.speculation.drafted_tokens ?? gen.drafted;
    gen.accepted = s.speculation.accepted_tokens ?? gen.accepted;
  }
}

let renderQueued = false;
function scheduleRender() {
  if (renderQueued) return;
  renderQueued = true;
  setTimeout(() => {
    renderQueued = false;
    renderGenerations();
    renderSummary();
  }, 80);
}

function sparkline(samples) {
  const width = 120;
  const height = 28;
  const box = svg("svg", { viewBox: `0 0 ${width} ${height}`, width, height, class: "spark", "aria-hidden": "true" });
  if (samples.length < 2) return box;
  const t0 = samples[0][0];
  const t1 = samples[samples.length - 1][0];
  const top = Math.max(...samples.map((s) => s[1]), 1);
  const points = samples.map(([t, v]) => {
    const x = t1 > t0 ? ((t - t0) / (t1 - t0)) * (width - 2) + 1 : 1;
    const y = height - 2 - (v / top) * (height - 4);
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  });
  box.append(svg("polyline", { points: points.join(" "), fill: "none", "stroke-width": 1.5, class: "spark-line" }));
  return box;
}

function progress(label, done, total, cls) {
  const frac = total ? Math.max(0, Math.min(1, done / total)) : 0;
  const fill = el("div", { class: `bar-fill ${cls || ""}` });
  fill.style.width = `${(100 * frac).toFixed(1)}%`;
  return el(
    "div",
    { class: "progress" },
    el("div", { class: "progress-label" }, el("span", { text: label }), el("span", { class: "mono", text: total ? `${done} / ${total}` : str(done) })),
    el("div", { class: "bar" }, fill),
  );
}

function hopTable(gen) {
  const timings = new Map();
  for (const hop of gen.hops || []) timings.set(`${hop.node}|${hop.layers}`, hop);
  const rows = gen.route.map((hop, i) => {
    const timing = timings.get(`${hop.node}|${hop.layers}`) || {};
    const next = gen.route[i + 1];
    const rtt = next ? linkRtt(hop, next) : null;
    const chip = el("span", { class: "chip mono" }, el("b", { text: str(hop.node, "?") }), ` ${str(hop.layers, "")}`);
    chip.style.setProperty("--hue", String(hue(str(hop.node, "?"))));
    return el(
      "tr",
      {
        "data-hop": i,
        "data-node-id": str(hop.node, "?"),
        "data-layers": str(hop.layers, ""),
        "data-compute-ms": timing.compute_ms_per_token ?? "",
      },
      el("td", {}, chip),
      el("td", { class: "mono", text: timing.compute_ms_per_token != null ? `${num(timing.compute_ms_per_token, 2)} ms` : "—" }),
      el("td", { class: "mono", text: next ? (rtt === null ? "—" : `${num(rtt, 2)} ms`) : "(tail)" }),
      el("td", {}, timing.status ? el("span", { class: `badge hop-${timing.status === "ok" ? "ok" : "bad"}`, text: String(timing.status) }) : "—"),
    );
  });
  return el(
    "table",
    { class: "hops" },
    el("thead", {}, el("tr", {}, ["hop", "compute / token", "link RTT →", "status"].map((c) => el("th", { text: c })))),
    el("tbody", {}, rows),
  );
}

function renderCard(gen) {
  let card = state.cards.get(gen.id);
  if (!card) {
    card = el("article", { class: "gen" });
    state.cards.set(gen.id, card);
  }
  card.className = `gen phase-${gen.phase.replace(/[^a-z]/g, "")}${gen.source === "chat" ? " from-chat" : ""}`;
  card.dataset.generationId = gen.id;
  card.dataset.phase = gen.phase;
  card.dataset.completionTokens = String(gen.completionTokens);
  card.dataset.prefillDone = String(gen.prefillDone);
  card.dataset.updates = String(gen.updates);
  card.dataset.retries = String(gen.retryCount);

  const stepMs = gen.hops && gen.hops[0] && gen.hops[0].decode_step_ms;
  const mean = gen.finished && gen.meanTps != null;
  const speed = mean ? gen.meanTps : gen.tps;
  const spec = gen.drafted ? `${gen.accepted}/${gen.drafted}` : null;
  const head = el(
    "header",
    { class: "gen-head" },
    el("span", { class: "mono strong gen-id", text: gen.id }),
    gen.source === "chat" ? el("span", { class: "tag", text: "chat" }) : null,
    el("span", { class: `badge phase-${gen.phase.replace(/[^a-z]/g, "")}`, text: gen.phase }),
    el("span", { class: "muted small", text: gen.elapsed != null ? seconds(gen.elapsed) : "" }),
  );
  const facts = el(
    "div",
    { class: "facts" },
    fact("tokens", String(gen.completionTokens), "tokens"),
    fact(mean ? "mean tokens/s" : "tokens/s", num(speed), "tps"),
    fact("first token", gen.firstTokenT != null ? seconds(gen.firstTokenT) : "—", "ttft"),
    fact("ms / token", stepMs != null ? num(stepMs, 1) : speed ? num(1000 / speed, 1) : "—", "step"),
    fact("retries", String(gen.retryCount), "retries", gen.retryCount ? "warn" : ""),
    fact("billing units", gen.billing != null ? num(gen.billing, 2) : "—", "billing"),
    spec ? fact("drafts kept", spec, "spec") : null,
  );
  const retries = gen.retries.length
    ? el(
        "ul",
        { class: "retries" },
        gen.retries.map((r) =>
          el(
            "li",
            {},
            el("span", { class: "badge warn", text: str(r.kind, "retry") }),
            ` #${str(r.attempt, "?")} · ${str(r.failed_node, "?")} failed: ${str(r.reason, "?")} · back in ${seconds(r.seconds)}` +
              (r.replayed_positions != null ? ` · replayed ${r.replayed_positions} positions` : ""),
          ),
        ),
      )
    : null;
  const end = gen.error
    ? el("div", { class: "gen-error", text: gen.error })
    : gen.finishReason
      ? el("div", { class: "muted small", text: `finished: ${gen.finishReason}${gen.seconds != null ? ` in ${seconds(gen.seconds)}` : ""}` })
      : null;
  const parts = [
    head,
    progress("prefill", gen.prefillDone, gen.prefillTotal, gen.prefillTotal && gen.prefillDone >= gen.prefillTotal ? "done" : ""),
    el("div", { class: "gen-row" }, facts, sparkline(gen.samples)),
    gen.route.length ? hopTable(gen) : null,
    gen.warning ? el("div", { class: "gen-warning", text: gen.warning }) : null,
    retries,
    end,
  ];
  card.replaceChildren(...parts.filter(Boolean)); // replaceChildren would write a null as "null"
  return card;
}

function fact(label, value, key, cls) {
  return el("div", { class: `fact ${cls || ""}`, "data-fact": key }, el("div", { class: "fact-value mono", text: value }), el("div", { class: "fact-label", text: label }));
}

function renderGenerations() {
  const all = [...state.gens.values()];
  const running = all.filter((g) => !g.finished).sort((a, b) => b.created - a.created);
  const finished = all.filter((g) => g.finished).sort((a, b) => b.created - a.created);
  for (const old of finished.slice(KEEP_FINISHED)) {
    closeStream(old);
    state.gens.delete(old.id);
    state.cards.delete(old.id);
  }
  const shown = [...running, ...finished.slice(0, KEEP_FINISHED)];
  const box = $("generations");
  if (!shown.length) {
    if (!box.querySelector(".empty")) box.replaceChildren(el("p", { class: "empty", text: "No generation yet — send a chat message." }));
    return;
  }
  box.replaceChildren(...shown.map(renderCard));
}

// -- chat -------------------------------------------------------------------------------------
function addMessage(role, text) {
  const msg = el("div", { class: `msg ${role}` }, el("div", { class: "who", text: role === "user" ? "you" : "assistant" }), el("div", { class: "text", text }));
  const log = $("chat-log");
  log.append(msg);
  log.scrollTop = log.scrollHeight;
  return msg;
}

function chatStatus(text) {
  $("chat-status").textContent = text;
}

function boundedNumber(id, lo, hi, fallback) {
  const value = Number($(id).value);
  return Number.isFinite(value) ? Math.min(hi, Math.max(lo, value)) : fallback;
}

async function sendChat(text) {
  const chat = state.chat;
  if (chat.busy) return;
  if (!state.model) {
    try {
      await loadModel();
    } catch (err) {
      chatStatus(err instanceof KeyRequired ? "this gateway needs an API key" : `cannot reach the gateway: ${err.message}`);
      return;
    }
  }
  chat.busy = true;
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const replyText = reply.querySelector(".text");
  reply.classList.add("streaming");
  reply.dataset.chunks = "0";
  reply.dataset.lengths = "";
  const controller = new AbortController();
  chat.abort = controller;
  const body = {
    model: state.model.id,
    messages: chat.messages,
    stream: true,
    max_tokens: Math.round(boundedNumber("chat-max", 1, 2048, 128)),
    temperature: boundedNumber("chat-temp", 0, 2, 0.7),
  };
  let content = "";
  let chunks = 0;
  chatStatus("sending…");
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    const gid = response.headers.get("X-Meshnet-Generation-Id");
    if (gid) {
      reply.dataset.generationId = gid;
      track(gid, "chat");
      startStreams();
      scheduleRender();
    }
    if (!response.ok || !response.body) throw new Error(await errorMessage(response)); // a 429 too
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let done = false;
    while (!done) {
      const { value, done: ended } = await reader.read();
      if (ended) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") {
          done = true;
          break;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(str(chunk.error.message, "the generation failed"));
        chunks += 1;
        reply.dataset.chunks = String(chunks);
        const choice = Array.isArray(chunk.choices) ? chunk.choices[0] : null;
        const delta = choice && choice.delta && typeof choice.delta.content === "string" ? choice.delta.content : "";
        if (delta) {
          content += delta;
          replyText.textContent = content;
          reply.dataset.lengths += `${reply.dataset.lengths ? "," : ""}${content.length}`;
          $("chat-log").scrollTop = $("chat-log").scrollHeight;
        }
        const m = chunk.meshnet;
        if (m) {
          chatStatus(`${str(m.generation_id, "")} · ${str(m.phase)} · prefill ${str(m.prefill_done)}/${str(m.prompt_tokens)} · ` +
            `${str(m.completion_tokens, "0")} tokens · ${num(m.tokens_per_second)} tokens/s`);
        }
      }
    }
    reply.dataset.done = "1";
    chatStatus(`${chatStatusPrefix(gid)}done: ${chunks} chunks, ${content.length} characters`);
  } catch (err) {
    const stopped = err && err.name === "AbortError";
    reply.dataset.done = stopped ? "stopped" : "error";
    reply.append(el("div", { class: stopped ? "muted small" : "gen-error", text: stopped ? "(stopped)" : `error: ${err.message}` }));
    chatStatus(stopped ? "stopped" : `error: ${err.message}`);
  } finally {
    reply.classList.remove("streaming");
    if (content) chat.messages.push({ role: "assistant", content });
    else chat.messages.pop(); // nothing came back: drop the unanswered question from the history
    chat.busy = false;
    chat.abort = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

function chatStatusPrefix(gid) {
  return gid ? `${gid} · ` : "";
}

function setupChat() {
  const input = $("chat-input");
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (!text || state.chat.busy) return;
    input.value = "";
    sendChat(text);
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => {
    if (state.chat.abort) state.chat.abort.abort();
  });
  $("chat-clear").addEventListener("click", () => {
    if (state.chat.busy) return;
    state.chat.messages = [];
    $("chat-log").replaceChildren();
    chatStatus("");
  });
}

function start() {
  setupKeys();
  setupChat();
  resume();
}

document.addEventListener("DOMContentLoaded", start);
