// The config list: edit, duplicate, delete, queue.

import { api, el, fmtTime, gpuPreference, processesFor, toast } from "./api.js";

const tbody = document.getElementById("configs-body");
let accelerators = [];

async function queue(name) {
  try {
    const job = await api("/api/jobs", { method: "POST", body: { config_name: name, num_processes: processesFor(gpuPreference(), accelerators) } });
    toast(`Queued job ${job.id}.`, { link: { href: `/jobs/${job.id}`, text: "Open" } });
  } catch (e) {
    toast(e.errors.length ? `${e.errors[0].path}: ${e.errors[0].message}` : e.message, { error: true, ms: 9000 });
  }
}

function confirmDelete(name) {
  const dialog = document.getElementById("delete-dialog");
  document.getElementById("delete-text").textContent = `Delete ${name} and all its versions? Jobs already run keep their copy.`;
  dialog.returnValue = "";
  dialog.showModal();
  dialog.addEventListener("close", async () => {
    if (dialog.returnValue !== "delete") return;
    try {
      await api(`/api/configs/${encodeURIComponent(name)}`, { method: "DELETE" });
      toast(`Deleted ${name}.`);
      refresh();
    } catch (e) { toast(e.message, { error: true }); }
  }, { once: true });
}

async function refresh() {
  let configs;
  try { configs = await api("/api/configs"); } catch (e) {
    tbody.replaceChildren(el("tr", {}, el("td", { colspan: 6, class: "empty" }, `Could not load: ${e.message}`)));
    return;
  }
  if (!configs.length) {
    tbody.replaceChildren(el("tr", {}, el("td", { colspan: 6, class: "empty" }, "No configs yet. ",
      el("a", { href: "/configs/new" }, "Create one"), ".")));
    return;
  }
  tbody.replaceChildren(...configs.map((c) => {
    const href = `/configs/${encodeURIComponent(c.name)}`;
    return el("tr", { "data-config": c.name },
      el("td", { "data-label": "Name" }, el("a", { href }, c.name)),
      el("td", { "data-label": "Model" }, c.model_family || "–"),
      el("td", { "data-label": "Version", class: "num" }, `v${c.current_version}`),
      el("td", { "data-label": "Updated" }, fmtTime(c.updated_at)),
      el("td", { "data-label": "Description" }, c.description || ""),
      el("td", { "data-label": "" }, el("div", { class: "actions" },
        el("a", { class: "button small", href, "aria-label": `Edit ${c.name}` }, "Edit"),
        el("a", { class: "button small", href: `/configs/new?from=${encodeURIComponent(c.name)}`, "aria-label": `Duplicate ${c.name}` }, "Duplicate"),
        el("button", { type: "button", class: "small", "aria-label": `Queue a job from ${c.name}`, onclick: () => queue(c.name) }, "Queue"),
        el("button", { type: "button", class: "small danger", "aria-label": `Delete ${c.name}`, onclick: () => confirmDelete(c.name) }, "Delete"))));
  }));
}

async function diskConfigs() {
  const list = document.getElementById("disk-configs");
  let files;
  try { files = await api("/api/configs/files"); } catch (e) {
    list.replaceChildren(el("li", { class: "muted small" }, `Could not look: ${e.message}`));
    return;
  }
  if (!files.length) { list.replaceChildren(el("li", { class: "muted small" }, "none found")); return; }
  list.replaceChildren(...files.map((f) => {
    const id = `import-name-${f.path.replace(/[^A-Za-z0-9]/g, "-")}`;
    const input = el("input", { type: "text", id, value: f.suggested_name, autocomplete: "off", spellcheck: "false", style: "width:auto" });
    const button = el("button", { type: "button", class: "small", "aria-label": `Import ${f.path}` }, "Import");
    button.addEventListener("click", async () => {
      try {
        const cfg = await api("/api/configs/import", { method: "POST", body: { name: input.value.trim(), path: f.path } });
        toast(`Imported ${f.path} as ${cfg.name}.`, { link: { href: `/configs/${encodeURIComponent(cfg.name)}`, text: "Open" } });
        refresh();
      } catch (e) {
        toast(e.errors.length ? e.errors.map((x) => `${x.path}: ${x.message}`).join("; ") : e.message, { error: true, ms: 12000 });
      }
    });
    return el("li", { "data-file": f.path }, el("code", {}, f.path),
      el("span", { class: "actions" }, el("label", { for: id, class: "small" }, "as"), input, button));
  }));
}

api("/api/system").then((s) => { accelerators = s.accelerators; }).catch(() => {});
Promise.all([refresh(), diskConfigs()]).then(() => { document.body.dataset.ready = "true"; });
