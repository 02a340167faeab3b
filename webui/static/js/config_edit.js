// The config editor: a form generated from TrainConfig's schema, the data backend editor with its folder
// browser, the hardware choice, a raw JSON view, and server validation errors shown at their inputs.

import { ApiError, api, el, gpuPreference, processesFor, toast } from "./api.js";
import { clearErrors, describe, field, inputOf, showErrors } from "./form.js";
import { gpuChooser } from "./hardware.js";

const OPEN_GROUPS = new Set(["model", "training", "lora", "validation"]);
const form = document.getElementById("config-form");
const nameInput = document.getElementById("config-name");
const descInput = document.getElementById("config-description");
const commentInput = document.getElementById("config-comment");
const raw = document.getElementById("raw-json");
const rawErr = document.getElementById("raw-err");

const state = {
  name: document.body.dataset.configName || "",
  exists: Boolean(document.body.dataset.configName),
  train: {}, // schema keys, plain spelling
  extra: {}, // keys the schema does not know (kept as they are)
  backends: [],
  library: null,
  schema: null,
  backendSchemas: null,
  system: null,
  families: {}, // /api/system/model-families: each family's flavours, LoRA presets and objectives
  rawDirty: false,
  dirty: false,
  loading: true, // no "unsaved changes" while the page fills the form
  presets: [],
};

// Keys whose choices depend on the model family (the family table says which values each family takes).
const FAMILY_CHOICES = { model_flavour: "flavours", lora_target: "lora_targets", prediction_type: "objectives" };

function familyChoices(key) {
  const family = state.families[state.train.model_family];
  return family && FAMILY_CHOICES[key] ? family[FAMILY_CHOICES[key]] : null;
}

/** After model_family changes: offer the new family's flavours / presets / objectives, dropping values it lacks. */
function refreshFamilyChoices() {
  for (const key of Object.keys(FAMILY_CHOICES)) {
    const select = document.querySelector(`#schema-sections select[name="${key}"]`);
    if (!select) continue;
    const prop = state.schema.schema.properties[key];
    const choices = familyChoices(key) || describe(prop, state.schema.schema.$defs || {}).enum || [];
    if (state.train[key] !== undefined && !choices.includes(state.train[key])) delete state.train[key];
    const first = select.options[0];
    select.replaceChildren(first, ...choices.map((c) => el("option", { value: String(c) }, String(c))));
    select.value = state.train[key] === undefined ? "" : String(state.train[key]);
  }
}

// ---- model <-> JSON ------------------------------------------------------------------------------------
function canon(key) {
  return key.startsWith("--") ? key.slice(2).replace(/-/g, "_") : key;
}

function load(trainConfig, backends, library) {
  const props = state.schema.schema.properties;
  state.train = {};
  state.extra = {};
  for (const [key, value] of Object.entries(trainConfig || {})) {
    const k = canon(key);
    if (k in props) {
      let v = value;
      if (k === "tread_config" && typeof v === "string" && v.trim().startsWith("{")) {
        try { v = JSON.parse(v); } catch { /* left as text; the server reports it */ }
      }
      state.train[k] = v;
    } else state.extra[key] = value;
  }
  state.backends = Array.isArray(backends) ? backends.map((b) => ({ ...b })) : [];
  state.library = library || null;
}

function trainConfig() {
  return { ...state.extra, ...state.train };
}

function body() {
  return { train_config: trainConfig(), data_backends: state.backends, prompt_library: state.library };
}

function changed() {
  if (!state.rawDirty && document.activeElement !== raw) raw.value = JSON.stringify(body(), null, 2);
  if (!state.loading) setDirty(true);
}

// ---- unsaved changes ------------------------------------------------------------------------------------
function setDirty(dirty) {
  state.dirty = dirty;
  document.body.dataset.dirty = String(dirty);
  document.getElementById("dirty-note").textContent = dirty ? "unsaved changes" : "";
}

window.addEventListener("beforeunload", (e) => {
  if (!state.dirty) return;
  e.preventDefault();
  e.returnValue = ""; // the browser asks "Leave site? Changes you made may not be saved."
});

// ---- basic / advanced ------------------------------------------------------------------------------------
const MODE_KEY = "simpletuner.form-mode";

function setMode(mode) {
  document.body.dataset.mode = mode;
  const button = document.getElementById("mode-button");
  button.setAttribute("aria-pressed", String(mode === "advanced"));
  button.textContent = mode === "advanced" ? "Show basic settings only" : "Show advanced settings";
  localStorage.setItem(MODE_KEY, mode);
}

document.getElementById("mode-button").addEventListener("click", () => {
  setMode(document.body.dataset.mode === "advanced" ? "basic" : "advanced");
});

// ---- the schema form -----------------------------------------------------------------------------------
function renderSchemaSections() {
  const { schema, groups } = state.schema;
  const defs = schema.$defs || {};
  const host = document.getElementById("schema-sections");
  host.replaceChildren();
  for (const group of groups) {
    const entries = Object.entries(schema.properties).filter(([, p]) => p.group === group.id && !p.readOnly);
    if (!entries.length) continue;
    const grid = el("div", { class: "fields" });
    for (const [key, prop] of entries) {
      grid.append(field(key, prop, defs, `train_config.${key}`,
        () => state.train[key],
        (v) => {
          if (v === undefined) delete state.train[key]; else state.train[key] = v;
          if (key === "model_family") refreshFamilyChoices();
          changed();
        },
        { browse, choices: familyChoices }));
    }
    const basic = entries.some(([, p]) => p.basic);
    const details = el("details", { class: `section${basic ? "" : " advanced-group"}`, id: `sec-${group.id}`, open: OPEN_GROUPS.has(group.id), "data-group": group.id },
      el("summary", {}, group.label, el("span", { class: "badge-err", hidden: true })),
      el("div", { class: "section-body" }, grid));
    if (group.id === "data") {
      details.querySelector(".section-body").prepend(el("p", { class: "help" },
        "Datasets listed below are used as they are; data_backend_config only matters when the list is empty."));
    }
    host.append(details);
  }
  document.querySelector("#sec-validation .fields")?.append(promptLibraryEditor());
  const toc = document.getElementById("toc");
  toc.replaceChildren(el("a", { href: "#sec-meta" }, "Config"),
    ...groups.filter((g) => document.getElementById(`sec-${g.id}`))
      .map((g) => el("a", { href: `#sec-${g.id}`, "data-group": g.id,
        class: document.getElementById(`sec-${g.id}`).classList.contains("advanced-group") ? "advanced-group" : undefined }, g.label)),
    el("a", { href: "#sec-datasets", "data-group": "datasets" }, "Datasets"),
    el("a", { href: "#sec-hardware" }, "Hardware"),
    el("a", { href: "#sec-raw" }, "Raw JSON"));
  for (const link of toc.querySelectorAll("a")) {
    link.addEventListener("click", () => { const target = document.querySelector(link.getAttribute("href")); if (target.tagName === "DETAILS") target.open = true; });
  }
}

// ---- the prompt library (user_prompt_library.json: {nickname: prompt}) ---------------------------------
function promptLibraryEditor() {
  const box = el("fieldset", { class: "wide field", "data-path": "prompt_library", id: "prompt-library" },
    el("legend", {}, "Prompt library", el("span", { class: "key" }, "user_prompt_library")),
    el("p", { class: "help" }, "Extra validation prompts, each with a nickname that names its images. Stored with the config; the server writes the file for each job."));
  const rows = el("div");
  const err = el("p", { class: "err", hidden: true });
  box.append(rows, err);
  let entries = Object.entries(state.library || {});
  const sync = () => {
    const lib = {};
    for (const [nick, prompt] of entries) if (nick.trim()) lib[nick.trim()] = prompt;
    state.library = Object.keys(lib).length ? lib : null;
    changed();
  };
  const draw = () => {
    rows.replaceChildren();
    entries.forEach((entry, i) => {
      const nickId = `lib-nick-${i}`;
      const promptId = `lib-prompt-${i}`;
      const nick = el("input", { type: "text", id: nickId, value: entry[0], autocomplete: "off" });
      const prompt = el("input", { type: "text", id: promptId, value: entry[1], autocomplete: "off" });
      nick.addEventListener("input", () => { entries[i][0] = nick.value; sync(); });
      prompt.addEventListener("input", () => { entries[i][1] = prompt.value; sync(); });
      rows.append(el("div", { class: "route-row library-row", "data-path": `prompt_library.${entry[0]}` },
        el("div", { class: "field" }, el("label", { for: nickId }, "Nickname"), nick),
        el("div", { class: "field", style: "grid-column: span 2" }, el("label", { for: promptId }, "Prompt"), prompt),
        el("button", { type: "button", class: "small danger", "aria-label": `Remove prompt ${i + 1}`,
          onclick: () => { entries.splice(i, 1); sync(); draw(); } }, "Remove")));
    });
    rows.append(el("button", { type: "button", class: "small", id: "add-prompt", onclick: () => {
      entries.push(["", ""]); draw(); rows.querySelector(".library-row:last-of-type input")?.focus();
    } }, "Add prompt"));
  };
  draw();
  return box;
}

// ---- data backends -------------------------------------------------------------------------------------
function isTextEmbeds(b) {
  return b.dataset_type === "text_embeds";
}

function backendLabel(b, i) {
  return b.id ? String(b.id) : String(i);
}

function renderBackends() {
  const host = document.getElementById("backends");
  host.replaceChildren();
  state.backends.forEach((backend, i) => {
    const te = isTextEmbeds(backend);
    const schema = te ? state.backendSchemas.text_embeds : state.backendSchemas.dataset;
    const defs = schema.$defs || {};
    const title = el("h3", {}, `${te ? "Text embeds" : "Dataset"} ${backend.id || `#${i + 1}`}`);
    const card = el("div", { class: `backend-card${te ? " text-embeds" : ""}`, "data-index": String(i) });
    const remove = el("button", { type: "button", class: "small danger", "aria-label": `Remove ${te ? "text embeds" : "dataset"} ${backend.id || i + 1}` }, "Remove");
    remove.addEventListener("click", () => { state.backends.splice(i, 1); renderBackends(); changed(); });
    card.append(el("header", {}, title, remove));
    const grid = el("div", { class: "fields" });
    const scan = el("p", { class: "scan", "aria-live": "polite" });
    for (const [key, prop] of Object.entries(schema.properties)) {
      const f = field(key, prop, defs, `data_backends[${backendLabel(backend, i)}].${key}`,
        () => backend[key],
        (v) => {
          if (v === undefined) delete backend[key]; else backend[key] = v;
          if (key === "id") { title.textContent = `${te ? "Text embeds" : "Dataset"} ${v || `#${i + 1}`}`; relabel(card, backend, i); }
          if (key === "instance_data_dir") scanLater(scan, v);
          changed();
        }, { browse });
      f.dataset.altPath = `data_backends[${i}].${key}`;
      grid.append(f);
    }
    card.append(grid);
    if (!te) { card.append(scan); if (backend.instance_data_dir) scanLater(scan, backend.instance_data_dir); }
    host.append(card);
  });
  if (!state.backends.length) host.append(el("p", { class: "muted" }, "No datasets yet."));
}

function relabel(card, backend, i) {
  for (const f of card.querySelectorAll(":scope .fields > [data-key]")) {
    f.dataset.path = `data_backends[${backendLabel(backend, i)}].${f.dataset.key}`;
  }
}

let scanTimer = null;
function scanLater(target, path) {
  clearTimeout(scanTimer);
  if (!path) { target.textContent = ""; return; }
  scanTimer = setTimeout(async () => {
    try {
      const r = await api(`/api/datasets/scan?path=${encodeURIComponent(path)}`);
      target.textContent = r.exists
        ? `${r.images} image${r.images === 1 ? "" : "s"}, ${r.videos} video${r.videos === 1 ? "" : "s"}, ${r.images_with_captions} with a caption file`
        : "folder not found";
    } catch (e) {
      target.textContent = e.errors.length ? e.errors[0].message : e.message;
    }
  }, 400);
}

function addBackend(textEmbeds) {
  if (textEmbeds) {
    state.backends.push({ id: "text-embeds", dataset_type: "text_embeds", type: "local", default: true, cache_dir: "cache/text" });
  } else {
    const n = state.backends.filter((b) => !isTextEmbeds(b)).length + 1;
    state.backends.push({ id: n === 1 ? "my-dataset" : `my-dataset-${n}`, type: "local", instance_data_dir: "" });
  }
  renderBackends();
  changed();
  const cards = document.querySelectorAll("#backends .backend-card");
  const last = cards[textEmbeds ? cards.length - 1 : cards.length - 1];
  last?.querySelector("input")?.focus();
}

// ---- folder browser --------------------------------------------------------------------------------------
const browser = {
  dialog: document.getElementById("browse-dialog"),
  path: null,
  input: null,
};

async function browseTo(path) {
  const list = document.getElementById("browse-list");
  const errBox = document.getElementById("browse-error");
  errBox.hidden = true;
  try {
    const r = await api(`/api/datasets/browse${path ? `?path=${encodeURIComponent(path)}` : ""}`);
    browser.path = r.path;
    document.getElementById("browse-path").textContent = r.path;
    list.replaceChildren();
    if (r.parent) {
      list.append(el("button", { type: "button", onclick: () => browseTo(r.parent) }, el("span", {}, "⬑ .. (up)"), ""));
    }
    for (const entry of r.entries) {
      list.append(el("button", { type: "button", "data-path": entry.path, onclick: () => browseTo(entry.path) },
        el("span", {}, `📁 ${entry.name}`), el("span", { class: "muted small" }, entry.images ? `${entry.images} images` : "")));
    }
    if (!r.entries.length) list.append(el("p", { class: "muted small", style: "padding:8px" }, "no sub-folders"));
    list.querySelector("button")?.focus();
  } catch (e) {
    errBox.textContent = e.errors.length ? e.errors[0].message : e.message;
    errBox.hidden = false;
  }
}

function browse(key, input) {
  browser.input = input;
  const roots = document.getElementById("browse-roots");
  roots.replaceChildren(el("span", { class: "muted small" }, "Roots:"),
    ...(state.system?.allowed_roots || []).map((root) => el("button", { type: "button", class: "small", onclick: () => browseTo(root) }, root)));
  browser.dialog.showModal();
  browseTo(input.value.trim() || null);
}

document.getElementById("browse-choose").addEventListener("click", () => {
  if (browser.input && browser.path) {
    browser.input.value = browser.path;
    browser.input.dispatchEvent(new Event("input", { bubbles: true }));
  }
  browser.dialog.close();
  browser.input?.focus();
});
document.getElementById("browse-cancel").addEventListener("click", () => { browser.dialog.close(); browser.input?.focus(); });

// ---- errors ------------------------------------------------------------------------------------------
function reportErrors(errors) {
  const summary = document.getElementById("error-summary");
  const list = document.getElementById("error-list");
  document.getElementById("ok-summary").hidden = true;
  const placed = showErrors(form, errors);
  if (placed.some((p) => p.node && (p.node.closest(".advanced-only") || p.node.closest(".advanced-group")))) setMode("advanced");
  // per-section badges and the table of contents
  const counts = {};
  for (const p of placed) {
    const section = p.node?.closest("details.section, section.card");
    if (section) counts[section.id] = (counts[section.id] || 0) + 1;
  }
  for (const details of document.querySelectorAll("details.section")) {
    const badge = details.querySelector(":scope > summary .badge-err");
    if (badge) { badge.hidden = !counts[details.id]; badge.textContent = String(counts[details.id] || ""); }
  }
  for (const link of document.querySelectorAll("#toc a")) link.classList.toggle("bad", Boolean(counts[link.getAttribute("href").slice(1)]));
  list.replaceChildren(...placed.map((p) => el("li", {},
    el("button", { type: "button", onclick: () => focusNode(p.node) }, `${p.path}: ${p.message}`))));
  document.getElementById("error-title").textContent = `${placed.length} problem${placed.length === 1 ? "" : "s"} to fix`;
  summary.hidden = !placed.length;
  const first = placed.find((p) => p.node);
  if (first) focusNode(first.node); else summary.focus();
}

function focusNode(node) {
  if (!node) return;
  let details = node.closest("details");
  while (details) { details.open = true; details = details.parentElement.closest("details"); }
  const input = inputOf(node);
  node.scrollIntoView({ block: "center" });
  input?.focus({ preventScroll: true });
}

function clearAll() {
  clearErrors(form);
  document.getElementById("error-summary").hidden = true;
  for (const badge of document.querySelectorAll(".badge-err")) badge.hidden = true;
  for (const link of document.querySelectorAll("#toc a")) link.classList.remove("bad");
}

function showOk(text, warnings = [], data = null) {
  const box = document.getElementById("ok-summary");
  box.replaceChildren(el("strong", {}, text));
  const summary = (data && data.summary) || [];
  if (summary.length) box.append(el("ul", { class: "data-summary", id: "data-summary" }, summary.map((line) => el("li", {}, line))));
  if (warnings.length) box.append(el("ul", { class: "warn-list" }, warnings.map((w) => el("li", {}, w))));
  box.hidden = false;
}

function failed(e) {
  if (e instanceof ApiError && e.status === 422 && e.errors.length) reportErrors(e.errors);
  else if (e instanceof ApiError && e.status === 409) reportErrors([{ path: "name", message: e.message }]);
  else { toast(e.message, { error: true }); }
}

// ---- actions -------------------------------------------------------------------------------------------
async function validate() {
  clearAll();
  try {
    const r = await api("/api/configs/validate", { method: "POST", body: body() });
    if (r.valid) showOk("The config is valid.", r.warnings, r.data);
    else reportErrors(r.errors);
  } catch (e) { failed(e); }
}

async function save() {
  clearAll();
  const name = nameInput.value.trim();
  if (!name) { reportErrors([{ path: "name", message: "give the config a name" }]); return null; }
  if (!/^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$/.test(name)) {
    reportErrors([{ path: "name", message: "use letters, digits, '.', '_' and '-' (starting with a letter or digit)" }]);
    return null;
  }
  const payload = { ...body(), description: descInput.value, comment: commentInput.value };
  try {
    // check first: a refused config is then a normal answer rather than a failed request
    const checked = await api("/api/configs/validate", { method: "POST", body: body() });
    if (!checked.valid) { reportErrors(checked.errors); return null; }
    if (!state.exists && !(await nameIsFree(name))) {
      reportErrors([{ path: "name", message: `a config named ${name} already exists; choose another name` }]);
      return null;
    }
    let saved;
    if (state.exists) saved = await api(`/api/configs/${encodeURIComponent(state.name)}`, { method: "PUT", body: payload });
    else saved = await api("/api/configs", { method: "POST", body: { ...payload, name } });
    state.name = saved.name;
    if (!state.exists) {
      state.exists = true;
      nameInput.readOnly = true;
      history.replaceState(null, "", `/configs/${encodeURIComponent(saved.name)}`);
      document.getElementById("page-title").textContent = `Config ${saved.name}`;
      document.title = `Config ${saved.name} · SimpleTuner`;
    }
    commentInput.value = "";
    setDirty(false);
    showOk(`Saved ${saved.name}, version ${saved.current_version}.`, saved.warnings);
    return saved;
  } catch (e) {
    failed(e);
    return null;
  }
}

async function nameIsFree(name) {
  const configs = await api("/api/configs");
  return !configs.some((c) => c.name === name);
}

async function saveAndQueue() {
  const saved = await save();
  if (!saved) return;
  try {
    const accelerators = state.system?.accelerators || [];
    const job = await api("/api/jobs", { method: "POST", body: {
      config_name: saved.name, num_processes: processesFor(gpuPreference(), accelerators) } });
    location.href = `/jobs/${job.id}`;
  } catch (e) { failed(e); }
}

function download(name, value) {
  const url = URL.createObjectURL(new Blob([JSON.stringify(value, null, 2) + "\n"], { type: "application/json" }));
  const a = el("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function applyRaw() {
  rawErr.hidden = true;
  let parsed;
  try { parsed = JSON.parse(raw.value); } catch (e) {
    rawErr.textContent = `not valid JSON: ${e.message}`;
    rawErr.hidden = false;
    return;
  }
  if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) {
    rawErr.textContent = "expected an object";
    rawErr.hidden = false;
    return;
  }
  if ("train_config" in parsed) load(parsed.train_config, parsed.data_backends || [], parsed.prompt_library || null);
  else load(parsed, namesBackendFile(parsed) ? [] : state.backends, state.library);
  state.rawDirty = false;
  renderSchemaSections();
  renderBackends();
  changed();
  toast("Applied the JSON to the form.");
}

// ---- import config.json (and multidatabackend.json, a prompt library) as SimpleTuner writes them -------------
/** A config.json that names its data backend file: with no dataset list given, the server reads that file. */
function namesBackendFile(config) {
  return Boolean(config.data_backend_config || config["--data_backend_config"]);
}

function isTrainConfig(obj) {
  return Object.keys(obj).some((k) => ["model_family", "--model_family", "model_type", "--model_type", "TRAINER_EXTRA_ARGS"].includes(k));
}

async function importFiles(files) {
  let train = null, backends = null, library = null, whole = null;
  for (const file of files) {
    let parsed;
    try { parsed = JSON.parse(await file.text()); } catch (e) {
      reportErrors([{ path: "raw", message: `${file.name}: not valid JSON (${e.message})` }]);
      return;
    }
    if (Array.isArray(parsed)) backends = parsed;
    else if (parsed && typeof parsed === "object" && "train_config" in parsed) whole = parsed;
    else if (parsed && typeof parsed === "object" && isTrainConfig(parsed)) train = parsed;
    else if (parsed && typeof parsed === "object" && Object.values(parsed).every((v) => typeof v === "string")) library = parsed;
    else { reportErrors([{ path: "raw", message: `${file.name}: neither a config.json, a multidatabackend.json nor a prompt library` }]); return; }
  }
  if (whole) load(whole.train_config, whole.data_backends || [], whole.prompt_library || null);
  else if (train) {
    // a dataset list given beside it wins; else its data_backend_config file (read by the server); else keep ours
    const list = backends || (namesBackendFile(train) ? [] : state.backends);
    if (backends) { delete train.data_backend_config; delete train["--data_backend_config"]; }
    load(train, list, library || state.library);
  } else if (backends) load(trainConfig(), backends, library || state.library);
  else if (library) state.library = library;
  renderSchemaSections();
  renderBackends();
  changed();
  toast(`Imported ${files.map((f) => f.name).join(", ")}.`);
  validate();
}

document.getElementById("import-button").addEventListener("click", () => document.getElementById("import-files").click());
document.getElementById("import-files").addEventListener("change", async (e) => {
  const files = [...e.target.files];
  e.target.value = "";
  if (files.length) await importFiles(files);
});

// ---- presets -------------------------------------------------------------------------------------------
function describePreset() {
  const preset = state.presets.find((p) => p.id === document.getElementById("preset-select").value);
  document.getElementById("preset-help").textContent = preset ? preset.description : "";
}

async function applyPreset(id, dataset) {
  const list = await api(`/api/presets${dataset ? `?dataset=${encodeURIComponent(dataset)}` : ""}`);
  const preset = list.find((p) => p.id === id);
  if (!preset) { toast(`There is no preset ${id}.`, { error: true }); return; }
  load(preset.train_config, preset.data_backends, null);
  if (!nameInput.value.trim()) nameInput.value = dataset ? `${preset.id}-${dataset}` : preset.id;
  if (!descInput.value.trim()) descInput.value = preset.label;
  renderSchemaSections();
  renderBackends();
  changed();
  document.body.dataset.preset = preset.id;
  toast(`Filled the form from "${preset.label}".`);
}

async function setupPresets(params) {
  const panel = document.getElementById("preset-panel");
  const select = document.getElementById("preset-select");
  const datasets = document.getElementById("preset-dataset");
  state.presets = await api("/api/presets");
  select.replaceChildren(...state.presets.map((p) => el("option", { value: p.id }, p.label)));
  try {
    const list = await api("/api/datasets");
    datasets.append(...list.map((d) => el("option", { value: d.name }, `${d.name} (${d.files} files)`)));
  } catch { /* none */ }
  if (params.get("preset")) select.value = params.get("preset");
  if (params.get("dataset")) datasets.value = params.get("dataset");
  describePreset();
  select.addEventListener("change", describePreset);
  document.getElementById("preset-apply").addEventListener("click", () => applyPreset(select.value, datasets.value));
  panel.hidden = false;
  if (params.get("preset")) await applyPreset(params.get("preset"), params.get("dataset"));
}

form.addEventListener("submit", (e) => { e.preventDefault(); save(); });
document.getElementById("validate-button").addEventListener("click", validate);
document.getElementById("queue-button").addEventListener("click", saveAndQueue);
document.getElementById("add-dataset").addEventListener("click", () => addBackend(false));
document.getElementById("add-text-embeds").addEventListener("click", () => addBackend(true));
document.getElementById("raw-apply").addEventListener("click", applyRaw);
raw.addEventListener("input", () => { state.rawDirty = true; });
document.getElementById("download-config").addEventListener("click", () => download("config.json", trainConfig()));
document.getElementById("download-backends").addEventListener("click", () => download("multidatabackend.json", state.backends));

// ---- start -------------------------------------------------------------------------------------------
async function start() {
  try {
    const [schema, backendSchemas, system, families] = await Promise.all([
      api("/api/schema/train-config"), api("/api/schema/data-backends"), api("/api/system"),
      api("/api/system/model-families")]);
    state.families = families;
    state.schema = schema;
    state.backendSchemas = backendSchemas;
    state.system = system;
    const params = new URLSearchParams(location.search);
    const from = params.get("from");
    setMode(localStorage.getItem(MODE_KEY) || "basic");
    if (state.exists || from) {
      const cfg = await api(`/api/configs/${encodeURIComponent(state.exists ? state.name : from)}`);
      load(cfg.latest.train_config, cfg.latest.data_backends, cfg.latest.prompt_library);
      descInput.value = cfg.description || "";
      if (!state.exists) { nameInput.value = `${cfg.name}-copy`; commentInput.value = `copied from ${cfg.name} v${cfg.current_version}`; }
      else document.getElementById("page-title").textContent = `Config ${cfg.name} (version ${cfg.current_version})`;
    } else {
      load({}, [{ id: "my-dataset", type: "local", instance_data_dir: "" },
        { id: "text-embeds", dataset_type: "text_embeds", type: "local", default: true, cache_dir: "cache/text" }], null);
    }
    renderSchemaSections();
    renderBackends();
    const hw = document.getElementById("hardware-body");
    hw.replaceChildren(el("p", { class: "help" }, `The server has ${system.accelerators.length || "no"} accelerator${system.accelerators.length === 1 ? "" : "s"} and ${system.max_concurrent} job slot${system.max_concurrent === 1 ? "" : "s"}. "Save and queue" uses this choice.`),
      gpuChooser(system.accelerators));
    changed();
    document.getElementById("loading").hidden = true;
    form.hidden = false;
    if (!state.exists && !from) await setupPresets(params);
    state.loading = false;
    setDirty(Boolean(params.get("preset")) && !state.exists); // a filled-in preset is not saved yet
    document.body.dataset.ready = "true";
  } catch (e) {
    document.getElementById("loading").textContent = `Could not load: ${e.message}`;
  }
}

start();
