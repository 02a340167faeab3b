// A small SVG line chart: x = step, one or two y axes, redrawn at most once per animation frame.

const NS = "http://www.w3.org/2000/svg";
const CHAR_PX = 6.6; // width of one character of the 11 px tick labels

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceTicks(lo, hi, count = 5, minStep = 0) {
  if (!(hi > lo)) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
  const raw = Math.max((hi - lo) / count, minStep);
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw && (!minStep || Number.isInteger(s))) || raw;
  const start = Math.floor(lo / step) * step;
  const ticks = [];
  for (let v = start; v <= hi + step * 0.5; v += step) ticks.push(Number(v.toPrecision(12)));
  return { lo: ticks[0], hi: ticks[ticks.length - 1], ticks };
}

function label(v) {
  const a = Math.abs(v);
  if (v !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
  return String(Number(v.toPrecision(4)));
}

/** Keep at most ``max`` points, always including the first and last (a plain stride is enough here). */
function thin(points, max) {
  if (points.length <= max) return points;
  const stride = points.length / max;
  const out = [];
  for (let i = 0; i < max; i += 1) out.push(points[Math.floor(i * stride)]);
  out.push(points[points.length - 1]);
  return out;
}

export class LineChart {
  /** series: [{name, color, axis: "left"|"right"}] */
  constructor(container, { series, title, xLabel = "step" }) {
    this.container = container;
    this.series = series.map((s) => ({ axis: "left", ...s, points: [] }));
    this.xLabel = xLabel;
    this.pending = false;
    container.classList.add("chart");
    container.setAttribute("role", "img");
    container.setAttribute("aria-label", title);
    this.root = svg("svg", { "aria-hidden": "true" });
    this.legend = document.createElement("div");
    this.legend.className = "legend";
    for (const s of this.series) {
      const item = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = s.color;
      item.append(swatch, s.name);
      this.legend.append(item);
    }
    this.empty = document.createElement("div");
    this.empty.className = "nodata";
    this.empty.textContent = "no data yet";
    container.append(this.legend, this.root, this.empty);
    if (typeof ResizeObserver !== "undefined") new ResizeObserver(() => this.schedule()).observe(container);
    this.schedule();
  }

  /** The index of the series called ``name``, added (with the next colour) when it is new. */
  seriesIndex(name, color) {
    let i = this.series.findIndex((s) => s.name === name);
    if (i >= 0) return i;
    this.series.push({ name, color, axis: "left", points: [] });
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = color;
    item.append(swatch, name);
    this.legend.append(item);
    return this.series.length - 1;
  }

  get count() {
    return this.series.reduce((n, s) => n + s.points.length, 0);
  }

  add(index, x, y) {
    if (y === null || y === undefined || !Number.isFinite(Number(y))) return;
    const pts = this.series[index].points;
    const point = [Number(x), Number(y)];
    // keep x sorted (events replayed after a reconnect may repeat a step: the newer value wins)
    const last = pts[pts.length - 1];
    if (!last || last[0] < point[0]) pts.push(point);
    else {
      const at = pts.findIndex((p) => p[0] >= point[0]);
      if (pts[at][0] === point[0]) pts[at] = point; else pts.splice(at, 0, point);
    }
    this.container.dataset.points = String(this.count);
    this.schedule();
  }

  clear() {
    for (const s of this.series) s.points = [];
    this.container.dataset.points = "0";
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.draw(); });
  }

  draw() {
    const w = Math.max(200, this.root.clientWidth || this.container.clientWidth);
    const h = Math.max(100, this.root.clientHeight || this.container.clientHeight);
    const root = this.root;
    root.replaceChildren();
    root.setAttribute("viewBox", `0 0 ${w} ${h}`);
    const hasData = this.count > 0;
    this.empty.hidden = hasData;
    if (!hasData) return;
    const hasRight = this.series.some((s) => s.axis === "right" && s.points.length);
    const m = { l: 52, r: hasRight ? 58 : 14, t: 22, b: 30 };
    const all = this.series.flatMap((s) => s.points);
    // margins fit the widest tick label of each axis (a fixed margin clipped "1.5e-4" in a narrow window)
    const tickWidth = (side) => {
      const ys = this.series.filter((s) => s.axis === side).flatMap((s) => s.points.map((p) => p[1]));
      if (!ys.length) return 0;
      const t = niceTicks(Math.min(...ys), Math.max(...ys), Math.max(2, Math.floor((h - m.t - m.b) / 40)));
      return Math.max(...t.ticks.map((v) => label(v).length)) * CHAR_PX;
    };
    m.l = Math.max(m.l, Math.ceil(tickWidth("left")) + 12);
    if (hasRight) m.r = Math.max(m.r, Math.ceil(tickWidth("right")) + 12);
    const xs = all.map((p) => p[0]);
    let x0 = Math.min(...xs), x1 = Math.max(...xs);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r);
    const axes = {};
    for (const side of ["left", "right"]) {
      const ys = this.series.filter((s) => s.axis === side).flatMap((s) => s.points.map((p) => p[1]));
      if (!ys.length) continue;
      const t = niceTicks(Math.min(...ys), Math.max(...ys), Math.max(2, Math.floor((h - m.t - m.b) / 40)));
      axes[side] = { ...t, sy: (y) => h - m.b - ((y - t.lo) / (t.hi - t.lo || 1)) * (h - m.t - m.b) };
    }
    const grid = svg("g", { stroke: "#e3e7ee", "stroke-width": 1 });
    const text = svg("g", { fill: "#5d6678", "font-size": 11, "font-family": "system-ui, sans-serif" });
    const primary = axes.left || axes.right;
    for (const v of primary.ticks) {
      const y = primary.sy(v);
      grid.append(svg("line", { x1: m.l, x2: w - m.r, y1: y, y2: y }));
    }
    for (const [side, axis] of Object.entries(axes)) {
      for (const v of axis.ticks) {
        const y = axis.sy(v);
        text.append(svg("text", side === "left"
          ? { x: m.l - 6, y: y + 4, "text-anchor": "end" }
          : { x: w - m.r + 6, y: y + 4, "text-anchor": "start" }, label(v)));
      }
    }
    const xt = niceTicks(x0, x1, Math.max(2, Math.floor((w - m.l - m.r) / 80)), 1); // steps are whole numbers
    for (const v of xt.ticks) {
      if (v < x0 || v > x1) continue;
      // kept inside the chart: a label centred on the last tick would hang past the right edge
      const half = (label(v).length * CHAR_PX) / 2;
      const x = Math.min(Math.max(sx(v), half + 1), w - half - 1);
      text.append(svg("text", { x, y: h - m.b + 16, "text-anchor": "middle" }, label(v)));
    }
    text.append(svg("text", { x: w - m.r, y: h - 3, "text-anchor": "end" }, this.xLabel));
    root.append(grid, svg("line", { x1: m.l, x2: w - m.r, y1: h - m.b, y2: h - m.b, stroke: "#aab3c5" }), text);
    for (const s of this.series) {
      if (!s.points.length) continue;
      const axis = axes[s.axis];
      const pts = thin(s.points, Math.max(50, Math.floor(w)));
      const d = pts.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${axis.sy(p[1]).toFixed(1)}`).join("");
      root.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "stroke-linejoin": "round" }));
      if (pts.length <= 40) {
        for (const p of pts) root.append(svg("circle", { cx: sx(p[0]), cy: axis.sy(p[1]), r: 2.5, fill: s.color }));
      }
    }
  }
}
