// The dataset list: create a dataset (a folder for uploads, or an existing folder under the allowed roots).

import { api, el, toast } from "./api.js";
import { clearErrors, showErrors } from "./form.js";

const form = document.getElementById("new-dataset");
const tbody = document.getElementById("datasets-body");

async function refresh() {
  let rows;
  try { rows = await api("/api/datasets"); } catch (e) {
    tbody.replaceChildren(el("tr", {}, el("td", { colspan: 4, class: "empty" }, `Could not load: ${e.message}`)));
    return;
  }
  if (!rows.length) {
    tbody.replaceChildren(el("tr", {}, el("td", { colspan: 4, class: "empty" }, "No datasets yet. Create one above, then upload images.")));
    return;
  }
  tbody.replaceChildren(...rows.map((d) => el("tr", { "data-dataset": d.name },
    el("td", { "data-label": "Name" }, el("a", { href: `/datasets/${encodeURIComponent(d.name)}` }, d.name)),
    el("td", { "data-label": "Files", class: "num" }, String(d.files)),
    el("td", { "data-label": "Captions", class: "num" }, `${d.captioned} of ${d.files}`),
    el("td", { "data-label": "Folder" }, el("span", { class: "muted small" }, `${d.path}${d.uploaded ? " (uploads)" : ""}${d.exists ? "" : " — missing"}`)))));
}

form.addEventListener("submit", async (e) => {
  e.preventDefault();
  clearErrors(form);
  const name = document.getElementById("dataset-name").value.trim();
  const path = document.getElementById("dataset-path").value.trim();
  if (!/^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$/.test(name)) {
    showErrors(form, [{ path: "name", message: "use letters, digits, '.', '_' and '-' (starting with a letter or digit)" }]);
    return;
  }
  try {
    const created = await api("/api/datasets", { method: "POST", body: path ? { name, path } : { name } });
    location.href = `/datasets/${encodeURIComponent(created.name)}`;
  } catch (err) {
    if (err.errors.length) showErrors(form, err.errors);
    else if (err.status === 409) showErrors(form, [{ path: "name", message: err.message }]);
    else toast(err.message, { error: true });
  }
});

refresh().then(() => { document.body.dataset.ready = "true"; });
