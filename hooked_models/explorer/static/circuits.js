// The circuits view: circuits.edge_attribution's top k edges drawn by layer, its faithfulness curve, and an
// edge's exact edge_patch on click.
import {$, api, fmt, handle, pair, runJob, showNotices, svgEl} from "./common.js";

export let CIRCUIT = null;

export async function runCircuit() {
  CIRCUIT = {request: pair("circuit")};
  CIRCUIT.result = await runJob("/api/circuit", {...CIRCUIT.request, method: $("circuit-method").value}, "circuit-progress");
  showNotices(CIRCUIT.result.notices);
  const slider = $("circuit-k");
  slider.max = CIRCUIT.result.edges.length;
  slider.value = Math.min(20, CIRCUIT.result.edges.length);
  drawCircuit();
}

// Where a node of circuits.graph sits: rows from the input (bottom) through each layer's key/value
// heads, heads and MLP to the logits (top).
function circuitBox(node, sizes, width, height) {
  const rows = 3 * sizes.num_layers + 2;
  const y = (row) => height - 20 - row * (height - 40) / (rows - 1);
  const across = (i, n) => 40 + (i + 0.5) * (width - 80) / n;
  let m;
  if (node === "input") return {x: width / 2, y: y(0), label: "input"};
  if (node === "logits") return {x: width / 2, y: y(rows - 1), label: "logits"};
  if ((m = node.match(/^layers\.(\d+)\.self_attn\.head\.(\d+)/))) {
    return {x: across(+m[2], sizes.num_heads), y: y(3 * +m[1] + 2), label: `L${m[1]}H${m[2]}`};
  }
  if ((m = node.match(/^layers\.(\d+)\.self_attn\.kv_head\.(\d+)/))) {
    return {x: across(+m[2], sizes.num_kv_heads), y: y(3 * +m[1] + 1), label: `L${m[1]} kv${m[2]}`};
  }
  if ((m = node.match(/^layers\.(\d+)\.mlp\.expert\.(\d+)/))) {
    return {x: across(+m[2], sizes.experts), y: y(3 * +m[1] + 3), label: `L${m[1]}E${m[2]}`};
  }
  if ((m = node.match(/^layers\.(\d+)\.mlp/))) return {x: width / 2, y: y(3 * +m[1] + 3), label: `MLP ${m[1]}`};
  throw new Error(`unknown circuit node ${node}`);
}

const PORT_COLOURS = {q: "#2563eb", k: "#16a34a", v: "#9333ea", mlp: "#ea580c", logits: "#111827"};
const PORT_OFFSETS = {k: -14, v: 14};

export function drawCircuit() {
  const {edges, sizes, clean_metric, corrupted_metric} = CIRCUIT.result;
  const k = +$("circuit-k").value;
  const shown = edges.slice(0, k);
  $("circuit-count").textContent = `${shown.length} of ${edges.length} edges shown`;
  $("circuit-count").dataset.count = shown.length;
  const svg = $("circuit-svg");
  const width = +svg.getAttribute("width"), height = +svg.getAttribute("height");
  svg.replaceChildren();
  const top = Math.max(...shown.map((e) => Math.abs(e.score)), 1e-12);
  const boxes = new Map();
  const box = (node) => {
    const b = circuitBox(node, sizes, width, height);
    boxes.set(b.label, b);
    return b;
  };
  for (const edge of shown) {
    const a = box(edge.writer), b = box(edge.reader);
    const port = edge.reader === "logits" ? "logits" : edge.reader.includes(".mlp") ? "mlp" : edge.reader.slice(-1);
    const x = b.x + (PORT_OFFSETS[port] || 0);  // a key/value head's k and v ports side by side
    const d = `M${a.x},${a.y - 8} C${a.x},${(a.y + b.y) / 2} ${x},${(a.y + b.y) / 2} ${x},${b.y + 8}`;
    const against = edge.score * (corrupted_metric - clean_metric) < 0;
    svg.append(svgEl("path", {d, class: "edge", stroke: PORT_COLOURS[port] || "#555",
                              "stroke-width": 0.6 + 6 * Math.abs(edge.score) / top, "stroke-opacity": 0.75,
                              "stroke-dasharray": against ? "4 3" : ""}));
    const hit = svgEl("path", {d, class: "hit", "data-writer": edge.writer, "data-reader": edge.reader});
    hit.append(svgEl("title"));
    hit.firstChild.textContent = `${edge.writer} → ${edge.reader}: ${edge.score.toPrecision(4)}`;
    hit.onclick = handle(() => patchEdge(edge));
    svg.append(hit);
  }
  Object.entries(PORT_COLOURS).forEach(([port, colour], i) => {  // the legend: what each colour enters
    const label = svgEl("text", {x: 10, y: 16 + 13 * i, fill: colour, style: `fill:${colour}`});
    label.textContent = `→ ${port}`;
    svg.append(label);
  });
  // A key/value head is read by its group's query heads (inside attention, not an edge of the graph): a
  // thin grey line to each, drawn as boxes too, so a kv head never looks cut off from its heads.
  const group = sizes.num_heads / sizes.num_kv_heads;
  for (const b of [...boxes.values()]) {
    const m = b.label.match(/^L(\d+) kv(\d+)$/);
    if (!m) continue;
    for (let h = +m[2] * group; h < (+m[2] + 1) * group; h++) {
      const head = box(`layers.${m[1]}.self_attn.head.${h}`);
      svg.append(svgEl("line", {class: "reads", x1: b.x, y1: b.y - 8, x2: head.x, y2: head.y + 8, stroke: "#9ca3af",
                                "stroke-width": 1, "stroke-dasharray": "2 2"}));
    }
  }
  for (const b of boxes.values()) {
    svg.append(svgEl("rect", {x: b.x - 26, y: b.y - 8, width: 52, height: 16, rx: 3, fill: "#fff", stroke: "#666"}));
    const text = svgEl("text", {x: b.x, y: b.y + 3.5, "text-anchor": "middle"});
    text.textContent = b.label;
    svg.append(text);
  }
  Plotly.react("circuit-curve", [{x: CIRCUIT.result.ks, y: CIRCUIT.result.faithfulness, mode: "lines+markers"}], {
    title: {text: `faithfulness (${CIRCUIT.result.method})`}, xaxis: {title: {text: "top k edges"}},
    yaxis: {title: {text: "fraction of the gap kept"}}, margin: {l: 60, r: 10},
    shapes: [{type: "line", x0: k, x1: k, yref: "paper", y0: 0, y1: 1, line: {dash: "dot", color: "#999"}}],
  }, {displayModeBar: false});
}

async function patchEdge(edge) {
  $("circuit-edge").textContent = `patching ${edge.writer} → ${edge.reader} ...`;
  const result = await api("/api/edge", {...CIRCUIT.request, writer: edge.writer, reader: edge.reader});
  const note = $("circuit-edge");
  note.dataset.value = String(result.edge_patch);
  note.textContent = `edge_patch(${edge.writer} → ${edge.reader}) = ${result.edge_patch} ` +
    `(clean ${fmt(result.clean_metric)}; change ${fmt(result.effect)}, estimated ${fmt(edge.score)})`;
}
