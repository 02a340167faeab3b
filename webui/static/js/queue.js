// The queue: submit, filter, cancel, retry; rows follow the all-jobs event stream.

import {
  api, confirmAction, describeProcesses, el, fmtDuration, fmtNum, fmtTime, follow, gpuPreference, processesFor,
  progressBar, setProgress, statusBadge, toast,
} from "./api.js";
import { showErrors, clearErrors } from "./form.js";

const tbody = document.getElementById("jobs-body");
const form = document.getElementById("submit-form");
const select = document.getElementById("submit-config");
const rows = new Map(); // job id -> {tr, parts}
let filter = "";
let accelerators = [];
let refreshTimer = null;

function stageText(p) {
  return p.stage ? `${p.stage}${p.total ? ` ${p.done} / ${p.total}` : "…"}` : "";
}

function progressCells(job) {
  const p = job.progress || {};
  const bar = progressBar();
  setProgress(bar, p.step || p.done || 0, p.total_steps || p.total || 0);
  const label = el("div", { class: "progress-label" }, p.total_steps ? `${p.step} / ${p.total_steps}` : (job.status === "queued" && job.queue_position ? `#${job.queue_position} in line` : (job.status === "running" ? stageText(p) || "starting…" : "")));
  return { bar, label, loss: el("span", {}, fmtNum(p.loss)), its: el("span", {}, fmtNum(p.it_per_s, 3)), eta: el("span", {}, job.status === "running" ? fmtDuration(p.eta_s) : "–") };
}

function applyProgress(parts, p) {
  setProgress(parts.bar, p.step || 0, p.total_steps || 0);
  parts.label.textContent = p.total_steps ? `${p.step} / ${p.total_steps}` : "";
  parts.loss.textContent = fmtNum(p.loss);
  parts.its.textContent = fmtNum(p.it_per_s, 3);
  parts.eta.textContent = fmtDuration(p.eta_s);
}

async function act(url, method, done) {
  try {
    const r = await api(url, { method });
    toast(done);
    scheduleRefresh(0);
    return r;
  } catch (e) {
    toast(e.message, { error: true });
    return null;
  }
}

// Resume re-queues the same job to continue its run from the newest checkpoint; Retry runs it again from step 0.
async function retry(job, startOver) {
  try {
    const queued = await api(`/api/jobs/${job.id}/retry`, { method: "POST", body: { start_over: startOver } });
    toast(`Job ${job.id} queued again: ${queued.reason || "retrying"}.`, { link: { href: `/jobs/${job.id}`, text: "Open" } });
    scheduleRefresh(0);
  } catch (e) {
    toast(e.errors.length ? `${e.errors[0].path}: ${e.errors[0].message}` : e.message, { error: true, ms: 9000 });
  }
}


function row(job) {
  const parts = progressCells(job);
  const actions = el("div", { class: "actions" });
  if (job.status === "queued" || job.status === "running") {
    actions.append(el("button", { type: "button", class: "small danger", disabled: job.cancel_requested, "aria-label": `Cancel job ${job.id}`,
      onclick: async () => {
        if (await confirmAction(`Cancel job ${job.id}?`, "The trainer stops; its checkpoints are kept, and Resume continues from the newest.", "Cancel the job")) {
          act(`/api/jobs/${job.id}/cancel`, "POST", `Cancelling job ${job.id}.`);
        }
      } }, job.cancel_requested ? "Cancelling…" : "Cancel"));
  } else {
    const step = (job.results || {}).last_checkpoint_step;
    if (step && job.status !== "succeeded") {
      actions.append(el("button", { type: "button", class: "small primary", "aria-label": `Resume job ${job.id} from step ${step}`,
        onclick: () => retry(job, false) }, `Resume (step ${step})`));
    }
    actions.append(el("button", { type: "button", class: "small", "aria-label": `Retry job ${job.id} from the start`, onclick: () => retry(job, true) }, "Retry"));
    actions.append(el("button", { type: "button", class: "small ghost", "aria-label": `Remove job ${job.id} from the list`,
      onclick: async () => {
        if (await confirmAction(`Remove job ${job.id}?`, "It leaves the list; its run folder (checkpoints, LoRA, log) stays on disk.", "Remove")) {
          act(`/api/jobs/${job.id}`, "DELETE", `Removed job ${job.id}.`);
        }
      } }, "Remove"));
  }
  const name = job.name || job.config_name || `job ${job.id}`;
  const tr = el("tr", { "data-job": job.id, "data-status": job.status },
    el("td", { "data-label": "Job" }, el("a", { href: `/jobs/${job.id}` }, `#${job.id} ${name}`),
      job.config_name ? el("div", { class: "muted small" }, `${job.config_name} v${job.config_version}`) : "",
      pairNote(job, dependents.get(job.id) || [])),
    el("td", { "data-label": "Status" }, statusBadge(job.status), job.reason && job.status !== "succeeded" ? el("div", { class: "muted small" }, job.reason) : ""),
    el("td", { "data-label": "Progress" }, el("div", {}, parts.bar, parts.label)),
    el("td", { "data-label": "Loss", class: "num" }, parts.loss),
    el("td", { "data-label": "it/s", class: "num" }, parts.its),
    el("td", { "data-label": "ETA", class: "num" }, parts.eta),
    el("td", { "data-label": "Submitted" }, fmtTime(job.submitted_at)),
    el("td", { "data-label": "" }, actions));
  rows.set(job.id, { tr, parts, status: job.status });
  return tr;
}

// Split training: a cache job and the train jobs that wait for it, linked both ways.
const dependents = new Map(); // cache job id -> ids of the train jobs depending on it
function pairNote(job, waiting) {
  if (job.kind === "cache") {
    return el("div", { class: "pair small", "data-pair": "cache" }, el("span", { class: "kind" }, "cache job"),
      ...waiting.flatMap((id) => [" · for ", el("a", { href: `/jobs/${id}` }, `#${id}`)]));
  }
  if (job.depends_on) {
    return el("div", { class: "pair small", "data-pair": "train" }, "trains from cache job ",
      el("a", { href: `/jobs/${job.depends_on}` }, `#${job.depends_on}`));
  }
  return "";
}

async function refresh() {
  let data;
  try {
    data = await api(`/api/jobs?limit=200${filter ? `&status=${filter}` : ""}`);
  } catch (e) {
    tbody.replaceChildren(el("tr", {}, el("td", { colspan: 8, class: "empty" }, `Could not load jobs: ${e.message}`)));
    return;
  }
  rows.clear();
  dependents.clear();
  for (const j of data.jobs) if (j.depends_on) dependents.set(j.depends_on, [...(dependents.get(j.depends_on) || []), j.id]);
  if (!data.jobs.length) {
    tbody.replaceChildren(el("tr", {}, el("td", { colspan: 8, class: "empty" }, filter ? `No ${filter} jobs.` : "No jobs yet.")));
  } else tbody.replaceChildren(...data.jobs.map(row));
  const running = data.jobs.filter((j) => j.status === "running").length;
  const queued = data.jobs.filter((j) => j.status === "queued").length;
  document.getElementById("queue-summary").textContent = filter ? `${data.total} ${filter}` : `${data.total} job${data.total === 1 ? "" : "s"} · ${running} running · ${queued} queued`;
}

function scheduleRefresh(ms = 300) {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refresh, ms);
}

for (const button of document.querySelectorAll("#filters button")) {
  button.addEventListener("click", () => {
    filter = button.dataset.status;
    for (const b of document.querySelectorAll("#filters button")) b.setAttribute("aria-pressed", String(b === button));
    refresh();
  });
}

form.addEventListener("submit", async (e) => {
  e.preventDefault();
  clearErrors(form);
  if (!select.value) { showErrors(form, [{ path: "config_name", message: "choose a config (or create one first)" }]); select.focus(); return; }
  const priorityText = document.getElementById("submit-priority").value.trim() || "0";
  const retriesText = document.getElementById("submit-retries").value.trim() || "0";
  const whole = (text) => (/^[-+]?\d+$/.test(text) ? parseInt(text, 10) : text); // else the server names the field
  const body = { config_name: select.value, name: document.getElementById("submit-name").value.trim(),
    priority: whole(priorityText), max_retries: whole(retriesText),
    num_processes: processesFor(gpuPreference(), accelerators) };
  const split = document.getElementById("submit-split").value;
  try {
    let job;
    if (split === "train") {
      job = await api("/api/jobs", { method: "POST", body });
      toast(`Queued job ${job.id}.`, { link: { href: `/jobs/${job.id}`, text: "Open" } });
    } else {
      // split training: stage 1 as a cache job, then (unless caching only) a train job that trains from its cache
      const cache = await api("/api/jobs", { method: "POST", body: { ...body, kind: "cache", name: body.name ? `${body.name} (cache)` : "" } });
      job = cache;
      if (split === "split") {
        job = await api("/api/jobs", { method: "POST", body: { ...body, depends_on: cache.id, overrides: { train_from_cache: true } } });
        toast(`Queued cache job ${cache.id} and train job ${job.id}, which trains from its cache once it succeeds.`, { link: { href: `/jobs/${job.id}`, text: "Open" } });
      } else toast(`Queued cache job ${cache.id}.`, { link: { href: `/jobs/${cache.id}`, text: "Open" } });
    }
    for (const w of job.warnings || []) toast(w);
    document.getElementById("submit-name").value = "";
    scheduleRefresh(0);
  } catch (err) {
    if (err.errors.length) showErrors(form, err.errors);
    else toast(err.message, { error: true });
  }
});

async function loadConfigs() {
  try {
    const configs = await api("/api/configs");
    select.replaceChildren(el("option", { value: "" }, configs.length ? "— choose a config —" : "no configs yet"),
      ...configs.map((c) => el("option", { value: c.name }, `${c.name} (v${c.current_version}${c.model_family ? `, ${c.model_family}` : ""})`)));
    const wanted = new URLSearchParams(location.search).get("config");
    if (wanted) select.value = wanted;
  } catch (e) { toast(e.message, { error: true }); }
}

async function loadSystem() {
  try {
    const s = await api("/api/system");
    accelerators = s.accelerators;
  } catch { accelerators = []; }
  document.getElementById("submit-gpus").textContent = describeProcesses(gpuPreference(), accelerators);
}

function liveState(state) {
  document.getElementById("live-dot").className = `live-dot ${state === "live" ? "on" : state === "retry" ? "retry" : ""}`;
  document.getElementById("live-text").textContent = state === "live" ? "live" : state === "retry" ? "reconnecting…" : "disconnected";
  if (state === "live") scheduleRefresh(0); // catch up on anything missed while away
}

function onEvent(ev) {
  const known = rows.get(ev.job_id);
  if (ev.type === "progress" && known) applyProgress(known.parts, ev.data);
  else if (ev.type === "status" && known && ev.data.status === "starting") {
    setProgress(known.parts.bar, ev.data.done || 0, ev.data.total || 0);
    known.parts.label.textContent = stageText(ev.data);
  }
  else if (ev.type === "job") scheduleRefresh();
}

Promise.all([loadConfigs(), loadSystem(), refresh()]).then(() => {
  follow("/api/stream", { onEvent, onState: liveState });
  document.body.dataset.ready = "true";
});
