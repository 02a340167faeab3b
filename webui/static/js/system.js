// The hardware panel: detected accelerators, the multi-GPU choice, and server facts.

import { api, el, fmtDuration } from "./api.js";
import { acceleratorList, gpuChooser } from "./hardware.js";

async function start() {
  let s;
  try { s = await api("/api/system"); } catch (e) {
    document.getElementById("accelerators").replaceChildren(el("p", { class: "err" }, `Could not load: ${e.message}`));
    return;
  }
  document.getElementById("accelerators").replaceChildren(acceleratorList(s));
  document.getElementById("gpu-choice").replaceChildren(gpuChooser(s.accelerators));
  const facts = [
    ["Version", s.version], ["Host", s.host], ["Job slots", String(s.max_concurrent)],
    ["Running", String(s.running)], ["Queued", String(s.queued)], ["Up for", fmtDuration(s.uptime_s)],
    ["Data dir", s.data_dir], ["Database", s.database], ["Allowed roots", s.allowed_roots.join("\n")],
  ];
  document.getElementById("server-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { style: "white-space:pre-line" }, v)]));
  document.body.dataset.ready = "true";
}

start();
