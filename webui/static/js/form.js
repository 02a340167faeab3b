// Form fields generated from a JSON schema (pydantic's model_json_schema), and server errors mapped onto them.
//
// Every field wrapper carries data-path, the same path the server names in a 422 error
// ("train_config.learning_rate", "train_config.tread_config.routes[1].end_layer_idx",
// "data_backends[my-set].resolution"), so an error finds its input by path.

import { el } from "./api.js";

let uid = 0;

function resolveRef(ref, defs) {
  const name = ref.split("/").pop();
  return defs[name] || {};
}

/** A flat description of a property: {kind, nullable, enum, default, title, description, item, props}. */
export function describe(prop, defs = {}) {
  let base = prop.$ref ? { ...resolveRef(prop.$ref, defs), ...prop } : prop;
  let nullable = false;
  if (base.anyOf) {
    const branches = [];
    const walk = (list) => {
      for (const b of list) {
        if (b.anyOf) walk(b.anyOf);
        else branches.push(b.$ref ? { ...resolveRef(b.$ref, defs), ...b } : b);
      }
    };
    walk(base.anyOf);
    nullable = branches.some((b) => b.type === "null");
    const rest = branches.filter((b) => b.type !== "null");
    let merged;
    if (rest.length === 1) merged = rest[0];
    else if (rest.length && rest.every((b) => b.type === "integer" || b.type === "number")) {
      merged = { type: rest.every((b) => b.type === "integer") ? "integer" : "number" };
    } else merged = { type: "json" };
    const { anyOf, ...outer } = base;
    base = { ...merged, ...outer };
  }
  const d = {
    title: prop.title || base.title || "",
    description: prop.description || base.description || "",
    default: prop.default !== undefined ? prop.default : base.default,
    nullable,
    readOnly: Boolean(prop.readOnly || base.readOnly),
    basic: prop.basic,
    constraints: [],
  };
  for (const [k, sym] of [["minimum", "≥"], ["exclusiveMinimum", ">"], ["maximum", "≤"], ["exclusiveMaximum", "<"]]) {
    if (base[k] !== undefined) d.constraints.push(`${sym} ${base[k]}`);
  }
  if (base.const !== undefined) return { ...d, kind: "const", value: base.const };
  if (prop.enum || base.enum) return { ...d, kind: "enum", enum: prop.enum || base.enum };
  if (base.type === "boolean") return { ...d, kind: "bool" };
  if (base.type === "integer") return { ...d, kind: "int" };
  if (base.type === "number") return { ...d, kind: "number" };
  if (base.type === "string") return { ...d, kind: "string" };
  if (base.type === "object" && base.properties) return { ...d, kind: "object", props: base.properties };
  if (base.type === "array" && base.items) {
    const item = base.items.$ref ? resolveRef(base.items.$ref, defs) : base.items;
    if (item.type === "object" && item.properties) return { ...d, kind: "list", props: item.properties, required: item.required || [] };
  }
  return { ...d, kind: "json" };
}

/** What a text input holds, as JSON: "" -> undefined (the default applies), numbers parsed where they parse. */
export function parseText(text, kind) {
  const v = text.trim();
  if (v === "") return undefined;
  if (kind === "int" || kind === "number") {
    if (/^[-+]?\d+$/.test(v)) return parseInt(v, 10);
    const n = Number(v);
    return Number.isFinite(n) ? n : v; // leave nonsense as text: the server says what is wrong with it
  }
  return text;
}

function asBool(value) {
  if (typeof value === "string") return ["true", "1", "yes", "on"].includes(value.toLowerCase());
  return Boolean(value);
}

function helpText(d) {
  const parts = [];
  if (d.description) parts.push(d.description);
  if (d.constraints.length) parts.push(`(${d.constraints.join(", ")})`);
  if (d.default !== undefined && d.default !== null && d.kind !== "object" && d.kind !== "list") {
    parts.push(`default: ${typeof d.default === "object" ? JSON.stringify(d.default) : d.default}`);
  }
  return parts.join(" · ");
}

const PATH_KEY = /(_dir|_path|_folder|^cache_dir.*)$/;

/**
 * One field. ``get()`` returns the current value (undefined = unset), ``set(v)`` stores it.
 * Options: browse(key, input) adds a "Browse…" button for folder-like keys.
 */
export function field(key, prop, defs, path, get, set, options = {}) {
  const d = describe(prop, defs);
  const id = `f${++uid}-${key.replace(/[^A-Za-z0-9_-]/g, "")}`;
  const helpId = `${id}-help`;
  const errId = `${id}-err`;
  const labelEl = el("label", { for: id }, d.title || key, el("span", { class: "key" }, key));
  const help = el("p", { class: "help", id: helpId }, helpText(d));
  const err = el("p", { class: "err", id: errId, hidden: true });
  const wrap = el("div", { class: `field${prop.basic === false ? " advanced-only" : ""}`, "data-path": path, "data-key": key });
  const described = `${helpId} ${errId}`;
  const value = get();

  if (d.kind === "object" || d.kind === "list") {
    return objectField(key, d, defs, path, get, set, options);
  }
  let input;
  if (d.kind === "bool") {
    input = el("input", { type: "checkbox", id, name: key, "aria-describedby": described,
      checked: value === undefined ? asBool(d.default) : asBool(value) });
    input.addEventListener("change", () => set(input.checked));
    wrap.classList.add("check-field");
    wrap.append(el("div", { class: "check-row" }, input, labelEl), help, err);
    return wrap;
  }
  if (d.kind === "enum") {
    input = el("select", { id, name: key, "aria-describedby": described });
    const def = d.default === undefined || d.default === null ? "" : String(d.default);
    input.append(el("option", { value: "" }, d.default === undefined ? "— choose —" : `default${def ? ` (${def})` : ""}`));
    const choices = (options.choices && options.choices(key)) || d.enum;
    for (const option of choices) input.append(el("option", { value: String(option) }, String(option)));
    input.value = value === undefined || value === null ? "" : String(value);
    input.addEventListener("change", () => set(input.value === "" ? undefined : input.value));
  } else if (d.kind === "const") {
    input = el("input", { type: "text", id, name: key, value: String(d.value), readonly: true, "aria-describedby": described });
  } else if (d.kind === "json") {
    input = el("textarea", { id, name: key, rows: 3, spellcheck: "false", "aria-describedby": described,
      placeholder: "JSON" });
    input.value = value === undefined || value === null ? "" : (typeof value === "string" ? value : JSON.stringify(value, null, 1));
    input.addEventListener("change", () => {
      const text = input.value.trim();
      if (!text) { set(undefined); return; }
      try { set(JSON.parse(text)); } catch { set(text); }
    });
    wrap.classList.add("wide");
  } else {
    const numeric = d.kind === "int" || d.kind === "number";
    input = el("input", { type: "text", id, name: key, "aria-describedby": described, spellcheck: "false",
      inputmode: numeric ? (d.kind === "int" ? "numeric" : "decimal") : undefined, autocomplete: "off",
      placeholder: d.default !== undefined && d.default !== null ? String(d.default) : "" });
    input.value = value === undefined || value === null ? "" : String(value);
    input.addEventListener("input", () => set(parseText(input.value, d.kind)));
  }
  if (d.readOnly) input.disabled = true;
  wrap.append(labelEl);
  if (options.browse && d.kind === "string" && PATH_KEY.test(key)) {
    const button = el("button", { type: "button", class: "small", "aria-label": `Browse folders for ${key}` }, "Browse…");
    button.addEventListener("click", () => options.browse(key, input));
    wrap.append(el("div", { class: "with-button" }, input, button));
  } else {
    wrap.append(input);
  }
  wrap.append(help, err);
  return wrap;
}

/** A nested object (e.g. tread_config) or a list of objects (its routes, webhook_config): a fieldset. */
function objectField(key, d, defs, path, get, set, options) {
  const box = el("fieldset", { class: `wide field${d.basic === false ? " advanced-only" : ""}`, "data-path": path, "data-key": key });
  box.append(el("legend", {}, d.title || key, el("span", { class: "key" }, key)));
  if (d.description) box.append(el("p", { class: "help" }, d.description));
  const err = el("p", { class: "err", hidden: true });
  const body = el("div");
  box.append(body, err);

  if (d.kind === "object") {
    // {routes: [...]} and the like: each property rendered with its own path
    const current = () => (get() && typeof get() === "object" ? get() : {});
    const grid = el("div", { class: "fields" });
    for (const [sub, subProp] of Object.entries(d.props)) {
      grid.append(field(sub, subProp, defs, `${path}.${sub}`,
        () => current()[sub],
        (v) => {
          const next = { ...current() };
          if (v === undefined || (Array.isArray(v) && !v.length)) delete next[sub]; else next[sub] = v;
          set(Object.keys(next).length ? next : undefined);
        }, options));
    }
    body.append(grid);
    return box;
  }

  // a list of objects: one row per item, add/remove buttons
  const items = () => (Array.isArray(get()) ? get() : []);
  const draw = () => {
    body.replaceChildren();
    items().forEach((item, i) => {
      const row = el("div", { class: "route-row", "data-path": `${path}[${i}]` });
      for (const [sub, subProp] of Object.entries(d.props)) {
        row.append(field(sub, subProp, defs, `${path}[${i}].${sub}`,
          () => (items()[i] || {})[sub],
          (v) => {
            const list = items().map((x) => ({ ...x }));
            if (v === undefined) delete list[i][sub]; else list[i][sub] = v;
            set(list);
          }, options));
      }
      row.append(el("button", { type: "button", class: "small danger", "aria-label": `Remove ${key} item ${i + 1}`,
        onclick: () => { const list = items().slice(); list.splice(i, 1); set(list.length ? list : undefined); draw(); } },
      "Remove"));
      body.append(row);
    });
    if (!items().length) body.append(el("p", { class: "muted small" }, "none"));
    body.append(el("button", { type: "button", class: "small", onclick: () => {
      const blank = {};
      for (const [sub, subProp] of Object.entries(d.props)) {
        const sd = describe(subProp, defs);
        if (sd.default !== undefined && sd.default !== null) blank[sub] = sd.default;
      }
      set([...items(), blank]);
      draw();
      const inputs = body.querySelectorAll(".route-row:last-of-type input, .route-row:last-of-type select");
      if (inputs.length) inputs[0].focus();
    } }, `Add ${singular(key)}`));
  };
  draw();
  return box;
}

function singular(key) {
  if (key === "routes") return "route";
  if (key === "webhook_config") return "webhook";
  return "item";
}

// ---- errors --------------------------------------------------------------------------------------------
/** Remove every error mark under ``root``. */
export function clearErrors(root) {
  for (const node of root.querySelectorAll(".has-error")) node.classList.remove("has-error");
  for (const node of root.querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
  for (const node of root.querySelectorAll(".err")) { node.textContent = ""; node.hidden = true; }
}

/** Parent paths of "a.b[1].c": "a.b[1]", "a.b", "a". */
function parents(path) {
  const out = [];
  let p = path;
  while (true) {
    const cut = Math.max(p.lastIndexOf("."), p.lastIndexOf("["));
    if (cut <= 0) break;
    p = p.slice(0, cut);
    out.push(p);
  }
  return out;
}

function findByPath(root, path) {
  const q = (p) => root.querySelector(`[data-path="${CSS.escape(p)}"]`) || root.querySelector(`[data-alt-path="${CSS.escape(p)}"]`);
  const exact = q(path);
  if (exact) return { node: exact, exact: true };
  for (const p of parents(path)) {
    const node = q(p);
    if (node) return { node, exact: false };
  }
  return { node: null, exact: false };
}

/** Show [{path, message}] at their inputs; returns [{path, message, node}] (node null when nothing matched). */
export function showErrors(root, errors) {
  clearErrors(root);
  const placed = [];
  for (const e of errors) {
    const { node, exact } = findByPath(root, e.path);
    if (node) {
      node.classList.add("has-error");
      const errEl = node.querySelector(":scope > .err") || node.querySelector(".err");
      if (errEl) {
        const text = exact ? e.message : `${e.path}: ${e.message}`;
        errEl.textContent = errEl.textContent ? `${errEl.textContent}; ${text}` : text;
        errEl.hidden = false;
      }
      const input = node.matches("input, select, textarea") ? node : node.querySelector(":scope > input, :scope > select, :scope > textarea, :scope > .with-button > input, :scope > .check-row > input");
      if (input) input.setAttribute("aria-invalid", "true");
      let details = node.closest("details");
      while (details) { details.open = true; details = details.parentElement.closest("details"); }
    }
    placed.push({ ...e, node });
  }
  return placed;
}

/** The input to focus for an error's node. */
export function inputOf(node) {
  if (!node) return null;
  if (node.matches("input, select, textarea, button")) return node;
  return node.querySelector("input:not([disabled]), select, textarea, button");
}
