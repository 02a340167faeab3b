// Shared helpers: the REST client (with the optional API token), SSE, DOM building and formatting.

const TOKEN_KEY = "simpletuner.token";
const GPU_KEY = "simpletuner.gpu";

export function token() {
  return localStorage.getItem(TOKEN_KEY) || "";
}

export class ApiError extends Error {
  constructor(status, body) {
    const detail = body && typeof body.detail === "string" ? body.detail : `HTTP ${status}`;
    super(detail);
    this.status = status;
    this.errors = (body && Array.isArray(body.errors)) ? body.errors : [];
  }
}

/** With a token, a session cookie (HttpOnly) first: EventSource, <img> and download links cannot send the
 *  Authorization header, and a token in a URL is refused (URLs end up in logs). */
async function startSession() {
  const t = token();
  if (!t) return;
  try {
    const res = await fetch("/api/session", { method: "POST", headers: { Authorization: `Bearer ${t}` } });
    if (res.status === 401) askToken();
  } catch { /* offline: the API calls report it */ }
}

export const sessionReady = startSession();

/** fetch() a JSON API route; throws ApiError (with .errors = [{path, message}]) on a non-2xx answer. */
export async function api(path, { method = "GET", body, raw = false } = {}) {
  await sessionReady;
  const headers = {};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  const res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!res.ok) {
    let data = null;
    try { data = await res.json(); } catch { data = null; }
    if (res.status === 401) askToken();
    throw new ApiError(res.status, data);
  }
  if (raw) return res;
  if (res.status === 204) return null;
  return res.json();
}

export function askToken() {
  const dialog = document.getElementById("token-dialog");
  if (!dialog || dialog.open) return;
  document.getElementById("token-input").value = token();
  dialog.showModal();
}

function setupToken() {
  const dialog = document.getElementById("token-dialog");
  const button = document.getElementById("token-button");
  if (!dialog) return;
  if (token()) button.hidden = false;
  button.addEventListener("click", askToken);
  dialog.addEventListener("close", () => {
    if (dialog.returnValue !== "save") return;
    const value = document.getElementById("token-input").value.trim();
    if (value) localStorage.setItem(TOKEN_KEY, value); else localStorage.removeItem(TOKEN_KEY);
    // a new token gets a new session cookie on reload; none drops the old one
    (value ? Promise.resolve() : fetch("/api/session", { method: "DELETE" })).finally(() => location.reload());
  });
}

/** Build an element: el("a", {href: "/x", class: "y"}, "text", child). Text is never parsed as HTML. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else if (key === "value") node.value = value;
    else if (key === "checked") node.checked = Boolean(value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** Ask in the page's confirmation dialog; resolves true when the user confirms. */
export function confirmAction(title, text, yes) {
  const dialog = document.getElementById("confirm-dialog");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-yes").textContent = yes;
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => dialog.addEventListener("close", () => resolve(dialog.returnValue === "yes"), { once: true }));
}

export function toast(message, { error = false, link = null, ms = 5000 } = {}) {
  const box = document.getElementById("toasts");
  if (!box) return;
  const item = el("div", { class: `toast${error ? " error" : ""}` }, message);
  if (link) item.append(" ", el("a", { href: link.href }, link.text));
  box.append(item);
  setTimeout(() => item.remove(), ms);
}

// ---- formatting ----------------------------------------------------------------------------------------
export function fmtNum(value, digits = 4) {
  if (value === null || value === undefined || value === "") return "–";
  const n = Number(value);
  if (!Number.isFinite(n)) return String(value);
  if (n !== 0 && (Math.abs(n) < 1e-3 || Math.abs(n) >= 1e5)) return n.toExponential(2);
  return Number(n.toPrecision(digits)).toString();
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(Number(seconds))) return "–";
  let s = Math.max(0, Math.round(Number(seconds)));
  const h = Math.floor(s / 3600); s -= h * 3600;
  const m = Math.floor(s / 60); s -= m * 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(s).padStart(2, "0")}s`;
  return `${s}s`;
}

export function fmtTime(epoch) {
  if (!epoch) return "–";
  const d = new Date(epoch * 1000);
  const today = new Date();
  const sameDay = d.toDateString() === today.toDateString();
  return sameDay ? d.toLocaleTimeString() : d.toLocaleString();
}

export function fmtBytes(n) {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v.toFixed(v < 10 ? 1 : 0)} ${units[i]}`;
}

export function statusBadge(status) {
  return el("span", { class: `status ${status}`, "data-status": status }, status);
}

/** A progress bar (role=progressbar) for step/total; update with setProgress. */
export function progressBar(big = false) {
  const fill = el("span", { style: "width:0%" });
  return el("div", { class: `progress${big ? " big" : ""}`, role: "progressbar", "aria-valuemin": "0",
    "aria-valuemax": "100", "aria-valuenow": "0", "aria-label": "training progress" }, fill);
}

export function setProgress(bar, step, total) {
  const pct = total ? Math.min(100, (100 * step) / total) : 0;
  bar.firstChild.style.width = `${pct.toFixed(1)}%`;
  bar.setAttribute("aria-valuenow", pct.toFixed(0));
  bar.setAttribute("aria-valuetext", total ? `step ${step} of ${total}` : "not started");
}

// ---- Server-Sent Events -----------------------------------------------------------------------------
export const EVENT_TYPES = ["progress", "checkpoint", "image", "scores", "status", "error", "log", "job"];

/** Follow an SSE URL; onEvent(parsed) for each event, onState("live"|"retry"|"closed"). EventSource resumes
 *  by itself after a dropped connection, sending Last-Event-ID, so nothing is missed. It authenticates with the
 *  session cookie (see startSession). */
export async function follow(url, { onEvent, onState = () => {}, onEnd = () => {} }) {
  await sessionReady;
  const source = new EventSource(url);
  const handle = (e) => {
    if (e.data === undefined) return; // the connection's own "error" event
    let parsed;
    try { parsed = JSON.parse(e.data); } catch { return; }
    onEvent(parsed);
  };
  for (const type of [...EVENT_TYPES, "message"]) source.addEventListener(type, handle);
  source.addEventListener("open", () => onState("live"));
  source.addEventListener("error", (e) => {
    if (e.data !== undefined) return;
    onState(source.readyState === EventSource.CLOSED ? "closed" : "retry");
  });
  source.addEventListener("end", () => { source.close(); onState("closed"); onEnd(); });
  return source;
}

// ---- multi-GPU choice (hardware panel + submit forms) --------------------------------------------------
export function gpuPreference() {
  try {
    const pref = JSON.parse(localStorage.getItem(GPU_KEY) || "{}");
    return { mode: pref.mode || "auto", count: Number(pref.count) || 1 };
  } catch {
    return { mode: "auto", count: 1 };
  }
}

export function saveGpuPreference(pref) {
  localStorage.setItem(GPU_KEY, JSON.stringify(pref));
}

/** num_processes for a job under the preference, given the server's accelerator list. */
export function processesFor(pref, accelerators) {
  const n = accelerators.length;
  if (!n || pref.mode === "disabled") return 1;
  if (pref.mode === "manual") return Math.max(1, Math.min(n, pref.count));
  return n;
}

export function describeProcesses(pref, accelerators) {
  const n = accelerators.length;
  if (!n) return "CPU, 1 process (no accelerator detected)";
  const p = processesFor(pref, accelerators);
  const how = pref.mode === "auto" ? "auto" : pref.mode === "manual" ? "manual" : "multi-GPU off";
  return `${p} of ${n} GPU${n === 1 ? "" : "s"} (${how})`;
}

setupToken();
