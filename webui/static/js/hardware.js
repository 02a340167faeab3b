// The multi-GPU choice: auto (every detected accelerator), manual (how many), or disabled (one process).
// The choice is remembered in the browser and sets num_processes when a job is submitted.

import { describeProcesses, el, gpuPreference, saveGpuPreference } from "./api.js";

let uid = 0;

/** A radio group for the choice; calls onChange(pref) after each change. */
export function gpuChooser(accelerators, onChange = () => {}) {
  const n = accelerators.length;
  const pref = gpuPreference();
  const name = `gpu-mode-${++uid}`;
  const box = el("fieldset", { class: "gpu-chooser" });
  box.append(el("legend", {}, "Multi-GPU"));
  const summary = el("p", { class: "muted small", "aria-live": "polite" });
  const count = el("input", { type: "number", min: "1", max: String(Math.max(1, n)), value: String(Math.min(Math.max(1, pref.count), Math.max(1, n))),
    id: `${name}-count`, "aria-label": "GPUs to use", style: "width:5em", disabled: pref.mode !== "manual" || !n });
  const update = () => {
    pref.mode = box.querySelector(`input[name="${name}"]:checked`)?.value || "auto";
    pref.count = Number(count.value) || 1;
    count.disabled = pref.mode !== "manual" || !n;
    saveGpuPreference(pref);
    summary.textContent = `Jobs submitted from this browser use ${describeProcesses(pref, accelerators)}.`;
    onChange(pref);
  };
  const option = (value, text, extra) => {
    const id = `${name}-${value}`;
    const radio = el("input", { type: "radio", name, id, value, checked: pref.mode === value, disabled: !n && value !== "disabled" });
    radio.addEventListener("change", update);
    return el("div", { class: "check-row" }, radio, el("label", { for: id }, text), extra || "");
  };
  box.append(
    option("auto", n ? `Auto: all ${n} GPU${n === 1 ? "" : "s"}` : "Auto"),
    option("manual", "Manual:", el("span", { class: "check-row" }, count, el("span", { class: "muted small" }, `of ${n} GPU${n === 1 ? "" : "s"}`))),
    option("disabled", "Disabled: one process"),
    summary,
  );
  if (!n) {
    pref.mode = "disabled";
    box.querySelector(`#${name}-disabled`).checked = true;
  }
  count.addEventListener("input", update);
  update();
  return box;
}

/** A list of the server's accelerators. */
export function acceleratorList(system) {
  if (!system.accelerators.length) {
    return el("p", { class: "muted" }, "No accelerator detected: jobs run on the CPU, one process each.");
  }
  return el("ul", { class: "list" }, system.accelerators.map((id) => el("li", {}, el("span", {}, `GPU ${id}`),
    el("span", { class: "muted small" }, `CUDA_VISIBLE_DEVICES=${id}`))));
}
