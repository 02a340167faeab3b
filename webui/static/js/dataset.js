// One dataset: upload files (or a folder, or a zip), see each image with its caption, edit a caption in place,
// remove an image, and the scan: captions, too-small images, aspect buckets and batches at chosen settings.

import { api, confirmAction, el, fmtBytes, sessionReady, toast, token } from "./api.js";

const name = document.body.dataset.dataset;
const base = `/api/datasets/${encodeURIComponent(name)}`;
const thumbs = document.getElementById("thumbs");
const PAGE = 200;
let shown = 0;

function fileUrl(path) {
  return `${base}/files/${path.split("/").map(encodeURIComponent).join("/")}`;
}

function scanParams() {
  const params = new URLSearchParams({ limit: String(PAGE) });
  const resolution = document.getElementById("scan-resolution").value.trim();
  const minimum = document.getElementById("scan-minimum").value.trim();
  const batch = document.getElementById("scan-batch").value.trim();
  if (resolution) params.set("resolution", resolution);
  params.set("resolution_type", document.getElementById("scan-resolution-type").value);
  if (minimum) params.set("minimum_image_size", minimum);
  if (batch) params.set("train_batch_size", batch);
  return params;
}

function renderScan(scan) {
  const box = document.getElementById("scan-summary");
  const d = scan.datasets[0];
  const parts = [];
  if (d && d.exists) {
    parts.push(el("dl", { class: "kv", id: "scan-facts" },
      el("dt", {}, "Images"), el("dd", { "data-fact": "images" }, String(d.images)),
      el("dt", {}, "Videos"), el("dd", { "data-fact": "videos" }, String(d.videos)),
      el("dt", {}, "With captions"), el("dd", { "data-fact": "captioned" }, `${d.captioned} (caption strategy ${d.caption_strategy}${d.caption_strategy_chosen ? ", from the folder" : ""})`),
      el("dt", {}, "Too small"), el("dd", { "data-fact": "too_small" }, String(d.too_small)),
      el("dt", {}, "Unreadable"), el("dd", { "data-fact": "unreadable" }, String(d.unreadable)),
      el("dt", {}, "Batches per epoch"), el("dd", { "data-fact": "batches" }, d.batches === null ? "counted when training starts" : String(d.batches))));
    const buckets = Object.entries(d.buckets);
    parts.push(el("h3", {}, "Aspect buckets"));
    parts.push(buckets.length
      ? el("table", { class: "buckets", id: "buckets" }, el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "Size (w×h)"), el("th", { scope: "col" }, "Images"))),
        el("tbody", {}, buckets.map(([k, n]) => el("tr", { "data-bucket": k }, el("td", {}, k.replace("x", "×")), el("td", { class: "num" }, String(n))))))
      : el("p", { class: "muted small" }, "none yet"));
  } else if (d) {
    parts.push(el("p", { class: "err" }, `The folder ${d.folder} does not exist.`));
  }
  if (scan.errors.length) {
    parts.push(el("ul", { class: "scan-errors", id: "scan-errors" }, scan.errors.map((e) => el("li", {}, e.message))));
  }
  if (scan.warnings.length) parts.push(el("ul", { class: "warn-list", id: "scan-warnings" }, scan.warnings.map((w) => el("li", {}, w))));
  box.replaceChildren(...parts);
}

function captionEditor(item) {
  const id = `cap-${btoa(unescape(encodeURIComponent(item.path))).replace(/[^A-Za-z0-9]/g, "")}`;
  const area = el("textarea", { id, rows: 2, spellcheck: "true", class: "caption-input", "data-original": item.caption ?? "",
    placeholder: "no caption yet" });
  area.value = item.caption ?? "";
  const save = el("button", { type: "button", class: "small", "aria-label": `Save the caption of ${item.path}` }, "Save");
  const state = el("span", { class: "muted small", role: "status" });
  const store = async () => {
    if (area.value === area.dataset.original) return;
    save.disabled = true;
    try {
      const r = await api(`${base}/captions/${item.path.split("/").map(encodeURIComponent).join("/")}`, { method: "PUT", body: { caption: area.value } });
      area.dataset.original = r.caption ?? "";
      state.textContent = "saved";
      loadScan();
    } catch (e) { state.textContent = ""; toast(e.errors.length ? e.errors[0].message : e.message, { error: true }); }
    save.disabled = false;
  };
  save.addEventListener("click", store);
  area.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) store(); });
  area.addEventListener("input", () => { state.textContent = area.value === area.dataset.original ? "" : "not saved"; });
  return el("div", { class: "caption-edit" }, el("label", { for: id, class: "sr-only" }, `Caption of ${item.path}`), area,
    el("div", { class: "actions" }, save, state));
}

function thumb(item) {
  const size = item.width ? `${item.width}×${item.height}` : item.kind;
  const media = item.kind === "image"
    ? el("img", { src: fileUrl(item.path), alt: item.caption || item.path, loading: "lazy" })
    : el("video", { src: fileUrl(item.path), preload: "metadata", muted: "", controls: "", "aria-label": item.path });
  const remove = el("button", { type: "button", class: "small danger", "aria-label": `Remove ${item.path}` }, "Remove");
  const card = el("figure", { class: "thumb", "data-path": item.path }, media,
    el("figcaption", {}, el("span", { class: "small" }, item.path), el("span", { class: "muted small" }, `${size} · ${fmtBytes(item.bytes)}`)),
    captionEditor(item), remove);
  remove.addEventListener("click", () => confirmRemove(item, card));
  return card;
}

async function confirmRemove(item, card) {
  if (!(await confirmAction(`Remove ${item.path}?`, `Delete ${item.path} and its caption from the dataset folder? This cannot be undone.`, "Remove"))) return;
  try {
    await api(`${base}/files/${item.path.split("/").map(encodeURIComponent).join("/")}`, { method: "DELETE" });
    card.remove();
    toast(`Removed ${item.path}.`);
    load();
  } catch (e) { toast(e.message, { error: true }); }
}

async function load(more = false) {
  const params = scanParams();
  params.set("offset", String(more ? shown : 0));
  let detail;
  try { detail = await api(`${base}?${params}`); } catch (e) {
    document.getElementById("dataset-sub").textContent = e.status === 404 ? "This dataset does not exist." : `Could not load: ${e.message}`;
    thumbs.replaceChildren();
    return null;
  }
  document.getElementById("dataset-sub").textContent = `${detail.path}${detail.uploaded ? " (uploads)" : " (your folder)"}`;
  document.getElementById("files-count").textContent = `${detail.total} file${detail.total === 1 ? "" : "s"}, ${detail.captioned} with captions`;
  if (!more) { thumbs.replaceChildren(); shown = 0; }
  thumbs.append(...detail.items.map(thumb));
  shown += detail.items.length;
  if (!detail.total) thumbs.replaceChildren(el("p", { class: "muted small" }, "No images yet: upload some above."));
  document.getElementById("more-files").hidden = shown >= detail.total;
  renderScan(detail.scan);
  return detail;
}

let scanTimer = null;
async function loadScan() {
  const params = scanParams();
  params.set("limit", "1");
  try { renderScan((await api(`${base}?${params}`)).scan); } catch (e) { toast(e.errors.length ? `${e.errors[0].path}: ${e.errors[0].message}` : e.message, { error: true }); }
}

async function upload() {
  const files = [...document.getElementById("upload-files").files];
  const folder = [...document.getElementById("upload-folder").files];
  if (!files.length && !folder.length) { toast("Choose files or a folder first.", { error: true }); return; }
  const data = new FormData();
  for (const f of files) data.append("files", f, f.name);
  // a folder's files keep their place inside it (without the folder's own name)
  for (const f of folder) data.append("files", f, (f.webkitRelativePath || f.name).split("/").slice(1).join("/") || f.name);
  const status = document.getElementById("upload-status");
  const button = document.getElementById("upload-button");
  status.textContent = `uploading ${files.length + folder.length} file(s)…`;
  button.disabled = true;
  await sessionReady;
  const headers = token() ? { Authorization: `Bearer ${token()}` } : {};
  try {
    const res = await fetch(`${base}/files`, { method: "POST", body: data, headers });
    const body = await res.json().catch(() => ({}));
    if (!res.ok) throw new Error(body.detail || `HTTP ${res.status}`);
    status.textContent = `saved ${body.saved.length}, skipped ${body.skipped.length}`;
    document.getElementById("upload-skipped").replaceChildren(...body.skipped.map((s) => el("li", {}, el("span", {}, s.reason))));
    document.getElementById("upload-files").value = "";
    document.getElementById("upload-folder").value = "";
    await load();
  } catch (e) {
    status.textContent = "";
    toast(`Upload failed: ${e.message}`, { error: true, ms: 9000 });
  }
  button.disabled = false;
}

document.getElementById("upload-button").addEventListener("click", upload);
document.getElementById("more-files").addEventListener("click", () => load(true));
for (const id of ["scan-resolution", "scan-resolution-type", "scan-minimum", "scan-batch"]) {
  document.getElementById(id).addEventListener(id === "scan-resolution-type" ? "change" : "input", () => {
    clearTimeout(scanTimer);
    scanTimer = setTimeout(loadScan, 350);
  });
}

load().then(() => { document.body.dataset.ready = "true"; });
