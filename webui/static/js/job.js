// The live job view: replays the job's events from the start over SSE (EventSource resumes after a dropped
// connection with Last-Event-ID), drawing progress, charts, images, checkpoints and the activity list.

import {
  api, confirmAction, el, fmtBytes, fmtDuration, fmtNum, fmtTime, follow, progressBar, setProgress, statusBadge, toast,
} from "./api.js";
import { LineChart } from "./chart.js";

const jobId = Number(document.body.dataset.jobId);
const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
const METRIC_NAMES = { clip_score: "CLIP score", eval: "Eval loss", eval_loss: "Eval loss" };
const COLORS = ["#3b5bdb", "#e8590c", "#2b8a3e", "#ae3ec9", "#1098ad", "#c92a2a"];

const bar = progressBar(true);
document.getElementById("progress-bar-host").append(bar, el("div", { class: "progress-label", id: "progress-label" }, "waiting to start"));
const lossChart = new LineChart(document.getElementById("loss-chart"), {
  title: "training loss and learning rate per step",
  series: [{ name: "loss", color: COLORS[0] }, { name: "learning rate", color: COLORS[1], axis: "right" }],
});
const scoreCharts = new Map();
const gallerySteps = new Map(); // step -> grid element
const previews = new Map(); // prompt key -> figure
const prompts = new Set();
const checkpoints = new Map(); // path -> {step, path}

let job = null;
let lastId = 0;
let count = 0;
let logOffset = null;
let logTimer = null;
let detailTimer = null;
let filesTimer = null;
let lastStage = null;

// ---- job record ----------------------------------------------------------------------------------------
async function loadJob() {
  try {
    job = await api(`/api/jobs/${jobId}`);
  } catch (e) {
    document.getElementById("job-title").textContent = `Job ${jobId}`;
    document.getElementById("job-sub").textContent = e.status === 404 ? "This job does not exist (it may have been removed)." : `Could not load: ${e.message}`;
    return false;
  }
  renderJob();
  return true;
}

function renderJob() {
  const name = job.name || job.config_name || "";
  document.getElementById("job-title").textContent = `Job ${job.id}${name ? ` · ${name}` : ""}`;
  document.title = `Job ${job.id} · SimpleTuner`;
  const sub = [];
  if (job.config_name) sub.push(`config ${job.config_name} v${job.config_version}`);
  sub.push(`submitted ${fmtTime(job.submitted_at)}`);
  if (job.started_at) sub.push(`started ${fmtTime(job.started_at)}`);
  if (job.finished_at) sub.push(`finished ${fmtTime(job.finished_at)}`);
  document.getElementById("job-sub").textContent = sub.join(" · ");
  document.getElementById("job-status").replaceChildren(statusBadge(job.status));
  document.body.dataset.status = job.status;
  const cancel = document.getElementById("cancel-button");
  cancel.hidden = FINISHED.has(job.status);
  cancel.disabled = job.cancel_requested;
  cancel.textContent = job.cancel_requested ? "Cancelling…" : "Cancel";
  renderActions();
  if (job.progress) applyProgress(job.progress);
  else if (job.status === "queued") {
    document.getElementById("progress-label").textContent = job.queue_position ? `queued, #${job.queue_position} in line` : "queued";
  }
  if (job.status === "succeeded") {
    setProgress(bar, 1, 1);
    document.getElementById("stat-eta").textContent = "done";
  }
  const results = job.results || {};
  if (job.kind === "cache" && job.status !== "queued") { // stage 1 trains nothing: say what it cached
    document.getElementById("progress-label").textContent = job.status === "succeeded"
      ? `cached ${results.cached_samples ?? "?"} samples and ${results.cached_captions ?? "?"} captions` : `caching (${job.status})`;
  }
  const facts = [
    ["Status", job.status + (job.reason ? ` (${job.reason})` : "")], ["Attempt", String(job.attempt)],
    ["Priority", String(job.priority)], ["Processes", String(job.num_processes)], ["Devices", job.devices || "CPU"],
    ["Run dir", job.run_dir || "–"], ["Exit code", job.exit_code ?? "–"],
  ];
  if (results.final_loss !== undefined) facts.push(["Final loss", fmtNum(results.final_loss)]);
  if (results.lora_path) facts.push(["LoRA", results.lora_path]);
  facts.push(...pairFacts());
  document.getElementById("details").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, typeof v === "object" ? v : String(v))]));
  document.getElementById("frozen").textContent = JSON.stringify({ train_config: job.train_config, data_backends: job.data_backends, prompt_library: job.prompt_library }, null, 2);
  const errorBox = document.getElementById("error-box");
  if (job.status === "failed" || job.error) {
    errorBox.replaceChildren(el("strong", {}, job.error || job.reason || "failed"));
    if (job.log_tail) errorBox.append(el("details", {}, el("summary", {}, "last log lines"), el("pre", {}, job.log_tail)));
    errorBox.hidden = false;
  }
  document.getElementById("log-download").href = `/api/jobs/${job.id}/files/train.log`;
}

// Split training: the job's kind, and its partner jobs (the cache job it trains from, or the train jobs waiting).
let waitingJobs = [];
function pairFacts() {
  const link = (id) => el("a", { href: `/jobs/${id}` }, `job ${id}`);
  const facts = [["Kind", job.kind === "cache" ? "cache (split training, stage 1)" : "train"]];
  if (job.depends_on) facts.push(["Trains from", el("span", { id: "pair-link" }, "the cache of ", link(job.depends_on))]);
  if (job.kind === "cache") {
    facts.push(["Train jobs", waitingJobs.length ? el("span", { id: "pair-link" }, ...waitingJobs.flatMap((id, i) => [i ? ", " : "", link(id)])) : "none yet"]);
    if (job.results && job.results.cache_manifest) facts.push(["Cache manifest", job.results.cache_manifest]);
  }
  return facts;
}

async function loadPair() {
  if (!job || job.kind !== "cache") return;
  try {
    const data = await api("/api/jobs?limit=1000");
    waitingJobs = data.jobs.filter((j) => j.depends_on === job.id).map((j) => j.id).sort((a, b) => a - b);
    renderJob();
  } catch { /* the pair is shown once the list loads */ }
}

function refreshJobSoon(ms = 300) {
  clearTimeout(detailTimer);
  detailTimer = setTimeout(async () => { await loadJob(); if (job && FINISHED.has(job.status)) { pollLog(); loadFiles(); } }, ms);
}

/** The newest checkpoint this job has on disk (or announced): {step, path} or null. */
function newestCheckpoint() {
  const all = [...checkpoints.values()].filter((c) => !files.length || files.some((f) => f.path.startsWith(`${rel(c.path)}/`)));
  all.sort((a, b) => b.step - a.step);
  if (all.length) return all[0];
  const r = job?.results || {};
  return r.last_checkpoint_step ? { step: r.last_checkpoint_step, path: r.last_checkpoint } : null;
}

const LORA_FILE = "pytorch_lora_weights.safetensors";

function fileHref(path) {
  return `/api/jobs/${jobId}/files/${path.split("/").map(encodeURIComponent).join("/")}`;
}

/** Resume (from the newest checkpoint) beside Retry (from step 0) on a finished job; Download LoRA: the final
 *  LoRA, else the newest checkpoint's. */
function renderActions() {
  if (!job) return;
  const finished = FINISHED.has(job.status);
  const newest = newestCheckpoint();
  const resume = document.getElementById("resume-button");
  resume.hidden = !finished || job.status === "succeeded" || !newest;
  if (newest) resume.textContent = `Resume from step ${newest.step}`;
  document.getElementById("retry-button").hidden = !finished;
  const link = document.getElementById("download-lora");
  const final = rel(job.results?.lora_path);
  const finalFile = final && (!files.length || files.some((f) => f.path === final)) ? final : null;
  const ckptFile = newest && rel(newest.path) ? `${rel(newest.path)}/${LORA_FILE}` : null;
  const target = finalFile || (ckptFile && files.some((f) => f.path === ckptFile) ? ckptFile : null);
  link.hidden = !target;
  if (target) {
    link.href = fileHref(target);
    link.setAttribute("download", finalFile ? LORA_FILE : `${job.name || `job-${job.id}`}-step-${newest.step}-${LORA_FILE}`);
    link.textContent = finalFile ? "Download LoRA" : `Download LoRA (step ${newest.step})`;
    link.dataset.path = target;
  }
}

// ---- events ------------------------------------------------------------------------------------------
function applyProgress(p) {
  if (p.stage && !p.total_steps) { // start-up: loading, caching N/M
    setProgress(bar, p.done || 0, p.total || 0);
    document.getElementById("progress-label").textContent = `${p.stage}${p.total ? ` ${p.done} / ${p.total}` : "…"}`;
    return;
  }
  setProgress(bar, p.step || 0, p.total_steps || 0);
  document.getElementById("progress-label").textContent = p.total_steps ? `step ${p.step} of ${p.total_steps}` : "";
  document.getElementById("stat-step").textContent = p.total_steps ? `${p.step} / ${p.total_steps}` : "–";
  document.getElementById("stat-loss").textContent = fmtNum(p.loss);
  document.getElementById("stat-lr").textContent = fmtNum(p.lr, 3);
  document.getElementById("stat-its").textContent = fmtNum(p.it_per_s, 3);
  document.getElementById("stat-eta").textContent = fmtDuration(p.eta_s);
  document.getElementById("stat-epoch").textContent = p.epoch ?? "–";
}

function activity(ev, text) {
  const list = document.getElementById("activity");
  list.prepend(el("li", { "data-type": ev.type }, el("span", {}, text), el("span", { class: "muted small" }, fmtTime(ev.time))));
  while (list.children.length > 200) list.lastChild.remove();
}

function promptKey(d) {
  return d.nickname || d.prompt || "(no prompt)";
}

function imageFigure(d, caption) {
  const figure = el("figure", { "data-step": d.step, "data-prompt": promptKey(d) });
  if (d.video_url) {
    // a video family's validation: the mp4, playable, with its first frame as the poster
    const attrs = { src: d.video_url, controls: "", loop: "", muted: "", playsinline: "", preload: "metadata",
      class: "validation-video", "aria-label": `${d.kind || "validation"} video, ${caption}` };
    if (d.image_url) attrs.poster = d.image_url;
    figure.append(el("video", attrs));
  } else if (d.image_url) {
    const src = d.image_url;
    figure.append(el("a", { href: src, target: "_blank", rel: "noopener", "aria-label": `open ${caption} full size` },
      el("img", { src, alt: `${d.kind || "validation"} image, ${caption}`, loading: "lazy" })));
  } else {
    figure.append(el("div", { class: "muted small", style: "padding:20px 6px" }, d.image_error || "image not stored"));
  }
  figure.append(el("figcaption", {}, caption));
  return figure;
}

function addValidationImage(d) {
  document.getElementById("no-images")?.remove();
  const key = promptKey(d);
  if (!prompts.has(key)) {
    prompts.add(key);
    document.getElementById("gallery-prompt").append(el("option", { value: key }, key.length > 60 ? `${key.slice(0, 57)}…` : key));
  }
  const step = Number(d.step) || 0;
  let grid = gallerySteps.get(step);
  if (!grid) {
    grid = el("div", { class: "gallery" });
    const section = el("section", { class: "gallery-step", "data-step": step }, el("h3", {}, `Step ${step}`), grid);
    // newest step first
    const host = document.getElementById("gallery");
    const later = [...host.querySelectorAll(":scope > .gallery-step")].find((s) => Number(s.dataset.step) < step);
    host.insertBefore(section, later || null);
    gallerySteps.set(step, grid);
  }
  const res = Array.isArray(d.resolution) ? ` · ${d.resolution.join("×")}` : "";
  const figure = imageFigure(d, `${key}${res}`);
  figure.classList.add("validation-image");
  figure.dataset.promptText = d.prompt || key;
  if (d.seed !== undefined && d.seed !== null) figure.dataset.seed = String(d.seed);
  if (Array.isArray(d.resolution)) figure.dataset.resolution = d.resolution.join("×");
  grid.append(figure);
  applyPromptFilter();
}

function addPreview(d) {
  document.getElementById("previews-wrap").hidden = false;
  const key = promptKey(d);
  const caption = `${key} · step ${d.step}${d.inference_step !== undefined && d.inference_step !== null ? ` · denoising step ${d.inference_step}` : ""}`;
  const figure = imageFigure(d, caption);
  figure.classList.add("preview-image");
  const old = previews.get(key);
  if (old) old.replaceWith(figure); else document.getElementById("previews").append(figure);
  previews.set(key, figure);
}

function applyPromptFilter() {
  const wanted = document.getElementById("gallery-prompt").value;
  for (const fig of document.querySelectorAll("#gallery figure")) fig.hidden = Boolean(wanted) && fig.dataset.prompt !== wanted;
}

/** Metrics arrive as "group/name" (clip_score/<prompt>, clip_score/mean, eval/loss, eval/loss_sigma_0.1, ...):
 *  one chart per group, one line per name. train/* repeats the loss chart and is left out. */
function addScores(d) {
  for (const [metric, value] of Object.entries(d.metrics || {})) {
    const cut = metric.indexOf("/");
    const group = cut > 0 ? metric.slice(0, cut) : metric;
    const name = cut > 0 ? metric.slice(cut + 1) : metric;
    if (group === "train") continue;
    document.getElementById("no-scores")?.remove();
    let chart = scoreCharts.get(group);
    if (!chart) {
      const box = el("div", { "data-metric": group });
      const label = METRIC_NAMES[group] || group;
      document.getElementById("score-charts").append(el("h3", {}, label), box);
      chart = new LineChart(box, { title: `${label} per step`, series: [] });
      scoreCharts.set(group, chart);
    }
    const label = group === "eval" ? (name === "loss" ? "mean" : name.replace(/^loss_sigma_/, "σ ")) : name;
    const index = chart.seriesIndex(label, COLORS[chart.series.length % COLORS.length]);
    chart.add(index, d.step, value);
  }
}

function addCheckpoint(d) {
  checkpoints.set(d.path, d);
  renderCheckpoints();
  loadFilesSoon();
}

function onEvent(ev) {
  if (ev.id <= lastId) return; // already shown (a replay after reconnecting)
  lastId = ev.id;
  count += 1;
  const counter = document.getElementById("event-count");
  counter.dataset.count = String(count);
  counter.dataset.lastId = String(lastId);
  counter.textContent = `${count} event${count === 1 ? "" : "s"}`;
  const d = ev.data || {};
  switch (ev.type) {
    case "progress":
      applyProgress(d);
      lossChart.add(0, d.step, d.loss);
      lossChart.add(1, d.step, d.lr);
      break;
    case "image":
      if (d.kind === "preview") addPreview(d);
      else { addValidationImage(d); activity(ev, `validation ${d.video_url ? "video" : "image"} at step ${d.step}: ${promptKey(d)}`); }
      break;
    case "scores":
      addScores(d);
      activity(ev, `scores at step ${d.step}: ${Object.entries(d.metrics || {}).filter(([k]) => !k.startsWith("train/") && !k.startsWith("eval/loss_sigma"))
        .map(([k, v]) => `${k} ${fmtNum(v)}`).join(", ") || "train metrics"}`);
      break;
    case "checkpoint":
      addCheckpoint(d);
      activity(ev, `checkpoint at step ${d.step}`);
      break;
    case "status":
      if (d.status === "starting") {
        if (!job || !job.progress || !job.progress.total_steps) applyProgress(d);
        if (d.stage !== lastStage) activity(ev, `trainer: ${d.stage}`);
        lastStage = d.stage;
        break;
      }
      activity(ev, `trainer: ${d.status}${d.reason ? ` (${d.reason})` : ""}`);
      break;
    case "error": {
      activity(ev, `error: ${d.message}`);
      const box = document.getElementById("error-box");
      box.replaceChildren(el("strong", {}, d.message || "error"));
      if (d.traceback) box.append(el("details", {}, el("summary", {}, "traceback"), el("pre", {}, d.traceback)));
      box.hidden = false;
      break;
    }
    case "log":
      activity(ev, `${d.level || "info"}: ${d.message}`);
      break;
    case "job":
      activity(ev, `job ${d.status}${d.cancel_requested ? " (cancel requested)" : ""}${d.reason ? `: ${d.reason}` : ""}`);
      if (job && d.status) { job.status = d.status; document.getElementById("job-status").replaceChildren(statusBadge(d.status)); document.body.dataset.status = d.status; }
      refreshJobSoon();
      break;
    default:
      activity(ev, ev.type);
  }
}

// ---- log tail ----------------------------------------------------------------------------------------
const logLines = [];
let logPartial = ""; // the unfinished last line (a chunk may end mid-line)

function lastState(line) {
  // tqdm redraws a line with carriage returns: show its latest state
  return line.split("\r").filter((part) => part.trim()).pop() || "";
}

async function pollLog() {
  clearTimeout(logTimer);
  const pre = document.getElementById("log");
  try {
    const url = logOffset === null ? `/api/jobs/${jobId}/log?tail=300` : `/api/jobs/${jobId}/log?offset=${logOffset}`;
    const res = await api(url, { raw: true });
    const text = await res.text();
    const next = Number(res.headers.get("X-Log-Offset"));
    if (Number.isFinite(next)) logOffset = next;
    if (text) {
      const atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 30;
      const lines = (logPartial + text).split("\n");
      logPartial = lines.pop();
      logLines.push(...lines.map(lastState));
      if (logLines.length > 500) logLines.splice(0, logLines.length - 500);
      pre.textContent = [...logLines, lastState(logPartial)].join("\n");
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    }
  } catch { /* retried below */ }
  if (!job || !FINISHED.has(job.status)) logTimer = setTimeout(pollLog, 1500);
}

// ---- files: checkpoints and artefacts ----------------------------------------------------------------
let files = [];

function rel(path) {
  if (!job?.run_dir || !path) return null;
  const root = job.run_dir.endsWith("/") ? job.run_dir : `${job.run_dir}/`;
  return path.startsWith(root) ? path.slice(root.length) : null;
}

function fileLink(f) {
  return el("a", { href: `/api/jobs/${jobId}/files/${f.path.split("/").map(encodeURIComponent).join("/")}`, download: f.path.split("/").pop() }, f.path);
}

function renderCheckpoints() {
  const list = document.getElementById("checkpoints");
  if (!checkpoints.size) return;
  const all = [...checkpoints.values()].sort((a, b) => b.step - a.step);
  const items = [];
  const removed = [];
  for (const c of all) {
    const r = rel(c.path);
    const inside = r ? files.filter((f) => f.path.startsWith(`${r}/`)) : [];
    if (files.length && r && !inside.length) { removed.push(c.step); continue; }
    const body = el("div", {}, el("strong", {}, `step ${c.step}`), " ", el("span", { class: "muted small" }, r || c.path));
    const lora = inside.find((f) => f.path === `${r}/${LORA_FILE}`);
    const others = inside.filter((f) => f !== lora);
    if (others.length) body.append(el("details", { class: "small" }, el("summary", {}, `${others.length} checkpoint files`),
      el("ul", {}, others.map((f) => el("li", {}, fileLink(f), ` ${fmtBytes(f.size)}`)))));
    const row = el("li", { "data-step": c.step }, body);
    if (lora) row.append(el("a", { class: "button small", href: fileHref(lora.path), download: `step-${c.step}-${LORA_FILE}`, "data-lora": c.step }, `LoRA ${fmtBytes(lora.size)}`));
    items.push(row);
  }
  if (removed.length) {
    items.push(el("li", { class: "muted small" }, `step${removed.length === 1 ? "" : "s"} ${removed.join(", ")}: removed (checkpoints_total_limit)`));
  }
  list.replaceChildren(...items);
  renderActions();
}

function renderArtefacts() {
  const list = document.getElementById("artefacts");
  // checkpoints, validation images and event copies have their own sections
  const wanted = files.filter((f) => !/(^|\/)checkpoint-[^/]+\//.test(f.path) && !f.path.startsWith("events/")
    && !f.path.includes("/cache/") && !/(^|\/)validation\//.test(f.path));
  if (!wanted.length) return;
  list.replaceChildren(...wanted.map((f) => el("li", {}, fileLink(f), el("span", { class: "muted small" }, fmtBytes(f.size)))));
  const images = files.filter((f) => /(^|\/)validation\/.+\.(png|jpe?g|webp|mp4)$/.test(f.path)).length;
  if (images) list.append(el("li", { class: "muted small" }, `${images} validation and preview image files under output/validation/ (shown above)`));
}

async function loadFiles() {
  if (!job?.run_dir) return;
  try { files = await api(`/api/jobs/${jobId}/files`); } catch { return; }
  renderCheckpoints();
  renderArtefacts();
  renderActions();
}

function loadFilesSoon() {
  clearTimeout(filesTimer);
  filesTimer = setTimeout(loadFiles, 800);
}

// ---- actions -----------------------------------------------------------------------------------------

document.getElementById("cancel-button").addEventListener("click", async () => {
  const newest = newestCheckpoint();
  const keep = newest ? `Its newest checkpoint (step ${newest.step}) is kept: Resume continues from there.` : "It has no checkpoint yet.";
  if (!(await confirmAction(`Cancel job ${jobId}?`, `The trainer stops. ${keep}`, "Cancel the job"))) return;
  try { await api(`/api/jobs/${jobId}/cancel`, { method: "POST" }); toast("Cancel requested."); refreshJobSoon(0); } catch (e) { toast(e.message, { error: true }); }
});
// Resume continues this job's run from its newest checkpoint; Retry begins again at step 0 (the old output stays
// in the run dir). Either way the page reloads to follow the new attempt.
async function retry(startOver) {
  try {
    await api(`/api/jobs/${jobId}/retry`, { method: "POST", body: { start_over: startOver } });
    location.reload();
  } catch (e) { toast(e.message, { error: true }); }
}
document.getElementById("resume-button").addEventListener("click", () => retry(false));
document.getElementById("retry-button").addEventListener("click", async () => {
  if (newestCheckpoint() && !(await confirmAction("Retry from the start?", "The run starts again at step 0; its current output is kept aside in the run dir.", "Retry from step 0"))) return;
  retry(true);
});

// ---- lightbox ------------------------------------------------------------------------------------------
let lightboxAt = -1;

function lightboxFigures() {
  return [...document.querySelectorAll("#gallery figure.validation-image:not([hidden])")].filter((f) => f.querySelector("img"));
}

function showLightbox(index) {
  const figures = lightboxFigures();
  if (!figures.length) return;
  lightboxAt = (index + figures.length) % figures.length;
  const fig = figures[lightboxAt];
  const img = document.getElementById("lightbox-image");
  img.src = fig.querySelector("img").src;
  img.alt = fig.querySelector("img").alt;
  const facts = [["Prompt", fig.dataset.promptText || fig.dataset.prompt], ["Step", fig.dataset.step], ["Seed", fig.dataset.seed || "–"],
    ["Size", fig.dataset.resolution || "–"], ["Image", `${lightboxAt + 1} of ${figures.length}`]];
  document.getElementById("lightbox-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { "data-fact": k.toLowerCase() }, v)]));
  document.getElementById("lightbox-open").href = img.src;
  const dialog = document.getElementById("lightbox");
  if (!dialog.open) dialog.showModal();
}

document.getElementById("gallery").addEventListener("click", (e) => {
  const fig = e.target.closest("figure.validation-image");
  if (!fig || !fig.querySelector("img") || e.ctrlKey || e.metaKey || e.shiftKey) return;
  e.preventDefault();
  showLightbox(lightboxFigures().indexOf(fig));
});
document.getElementById("lightbox-prev").addEventListener("click", () => showLightbox(lightboxAt - 1));
document.getElementById("lightbox-next").addEventListener("click", () => showLightbox(lightboxAt + 1));
document.getElementById("lightbox-close").addEventListener("click", () => document.getElementById("lightbox").close());
document.getElementById("lightbox").addEventListener("keydown", (e) => {
  if (e.key === "ArrowLeft") showLightbox(lightboxAt - 1);
  if (e.key === "ArrowRight") showLightbox(lightboxAt + 1);
});
document.getElementById("gallery-prompt").addEventListener("change", applyPromptFilter);

function liveState(state) {
  document.getElementById("live-dot").className = `live-dot ${state === "live" ? "on" : state === "retry" ? "retry" : ""}`;
  document.getElementById("live-text").textContent = state === "live" ? "live" : state === "retry" ? "reconnecting…" : "stream closed";
}

async function start() {
  if (!(await loadJob())) return;
  await loadPair();
  document.body.dataset.ready = "true";
  follow(`/api/jobs/${jobId}/stream?until_done=true`, {
    onEvent,
    onState: liveState,
    onEnd: () => { document.body.dataset.streamEnded = "true"; refreshJobSoon(0); },
  });
  pollLog();
  loadFiles();
}

start();
