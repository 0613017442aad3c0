// The attribution-graph view: a graph file in circuit-tracer's schema drawn by layer and position, pruned
// by influence, a node's strongest links and an edge's per-head loadings, a feature's dashboard.
import {$, api, el, fmt, handle, session, svgEl} from "./common.js";
import {openFeature} from "./features.js";

export let GRAPH = null;
const pinned = new Set();

export async function openGraph() {
  const data = await api("/api/graph", {path: $("graph-path").value});
  GRAPH = {data, selected: null, byId: new Map(data.nodes.map((n) => [n.node_id, n]))};
  pinned.clear();
  for (const id of data.qParams.pinnedIds) {
    const node = data.nodes.find((n) => n.node_id === id || n.jsNodeId === id);
    if (node) pinned.add(node.node_id);
  }
  if (data.metadata.node_threshold !== null) $("graph-threshold").value = data.metadata.node_threshold;
  $("graph-title").textContent = `${data.metadata.slug}: ${JSON.stringify(data.metadata.prompt)} ` +
    `(${data.nodes.length} nodes, ${data.links.length} links; transcoders ${data.metadata.transcoder_list.join(", ") || "–"})`;
  $("graph-detail").replaceChildren();
  drawGraph();
}

// A node is shown when its cumulative influence (circuit-tracer's pruning score) is within the
// threshold, when it is an input or output, or when it is pinned.
function visible(node, threshold) {
  return pinned.has(node.node_id) || node.feature_type === "embedding" || node.feature_type === "logit" ||
    node.influence === null || node.influence <= threshold;
}

function rowOf(node) {
  return node.layer === "E" ? 0 : node.feature_type === "logit" ? Infinity : 1 + Number(node.layer);
}

export function drawGraph() {
  const {data} = GRAPH;
  const threshold = +$("graph-threshold").value;
  const nodes = data.nodes.filter((n) => visible(n, threshold));
  const shownIds = new Set(nodes.map((n) => n.node_id));
  const links = data.links.filter((l) => shownIds.has(l.source) && shownIds.has(l.target));
  $("graph-count").textContent = `${nodes.length} nodes, ${links.length} links`;
  $("graph-count").dataset.nodes = nodes.length;
  $("graph-count").dataset.links = links.length;
  const svg = $("graph-svg");
  const width = +svg.getAttribute("width"), height = +svg.getAttribute("height");
  svg.replaceChildren();
  const tokens = data.metadata.prompt_tokens;
  const positions = Math.max(tokens.length, 1 + Math.max(...data.nodes.map((n) => n.ctx_idx)));
  const rows = [...new Set(data.nodes.map(rowOf))].sort((a, b) => a - b);
  const cellW = (width - 60) / positions, rowH = (height - 70) / Math.max(rows.length - 1, 1);
  const cells = new Map();
  for (const node of nodes) {
    const key = `${rowOf(node)}:${node.ctx_idx}`;
    if (!cells.has(key)) cells.set(key, []);
    cells.get(key).push(node);
  }
  const at = new Map();
  for (const [key, members] of cells) {
    const [row, ctx] = key.split(":");
    const y = height - 40 - rows.indexOf(row === "Infinity" ? Infinity : +row) * rowH;
    members.forEach((node, i) => at.set(node.node_id, {x: 40 + (+ctx + (i + 1) / (members.length + 1)) * cellW, y}));
  }
  rows.forEach((row, i) => {
    const label = svgEl("text", {x: 4, y: height - 37 - i * rowH});
    label.textContent = row === 0 ? "emb" : row === Infinity ? "logit" : `L${row - 1}`;
    svg.append(label);
  });
  tokens.forEach((token, i) => {
    const label = svgEl("text", {x: 40 + (i + 0.5) * cellW, y: height - 8, "text-anchor": "middle"});
    label.textContent = token.length > 8 ? `${token.slice(0, 7)}…` : token;
    svg.append(label);
  });
  const top = Math.max(...links.map((l) => Math.abs(l.weight)), 1e-12);
  for (const link of links) {
    const a = at.get(link.source), b = at.get(link.target);
    svg.append(svgEl("line", {x1: a.x, y1: a.y, x2: b.x, y2: b.y, stroke: link.weight > 0 ? "#2563eb" : "#dc2626",
                              "stroke-width": 0.3 + 3 * Math.abs(link.weight) / top, "stroke-opacity": 0.5}));
  }
  const shapes = {embedding: "#16a34a", logit: "#111827", "mlp reconstruction error": "#9ca3af"};
  for (const node of nodes) {
    const p = at.get(node.node_id);
    const classes = ["node", pinned.has(node.node_id) ? "pinned" : "", GRAPH.selected === node.node_id ? "selected" : ""];
    const mark = svgEl(node.feature_type === "mlp reconstruction error" ? "rect" : "circle", {
      class: classes.join(" "), "data-id": node.node_id, fill: shapes[node.feature_type] || "#f59e0b",
      cx: p.x, cy: p.y, r: 6, x: p.x - 5, y: p.y - 5, width: 10, height: 10});
    mark.append(svgEl("title"));
    // its top examples (from a statistics result beside the graph, when there is one), the peak in brackets
    mark.firstChild.textContent = `${node.node_id} (${node.feature_type}) ${node.clerp}` +
      (node.examples || []).map((text) => `\n${text}`).join("");
    mark.onclick = () => selectNode(node.node_id);
    svg.append(mark);
  }
}

function nodeLabel(node) {
  const token = GRAPH.data.metadata.prompt_tokens[node.ctx_idx];
  return `${node.node_id} [${node.feature_type}] at ${JSON.stringify(token ?? node.ctx_idx)}`;
}

function linkTable(links, end, title) {
  const table = el("table", {class: `links ${end}`});
  table.append(el("caption", {}, title));
  for (const link of links.slice(0, 10)) {
    const row = el("tr", {class: "link"});
    row.append(el("td", {}, link[end]), el("td", {}, fmt(link.weight)));
    row.onclick = () => showHeads(link);
    table.append(row);
  }
  return table;
}

function selectNode(id) {
  GRAPH.selected = id;
  const node = GRAPH.byId.get(id);
  const byWeight = (a, b) => Math.abs(b.weight) - Math.abs(a.weight);
  const inputs = GRAPH.data.links.filter((l) => l.target === id).sort(byWeight);
  const outputs = GRAPH.data.links.filter((l) => l.source === id).sort(byWeight);
  const detail = $("graph-detail");
  detail.replaceChildren(el("h3", {}, nodeLabel(node)),
    el("p", {class: "note"}, `activation ${fmt(node.activation)}, influence ${fmt(node.influence)} ${node.clerp}`));
  const pin = el("button", {type: "button", id: "graph-pin"}, pinned.has(id) ? "unpin" : "pin");
  pin.onclick = () => { pinned.has(id) ? pinned.delete(id) : pinned.add(id); selectNode(id); };
  detail.append(pin, el("span", {class: "note", id: "graph-pinned"}, ` pinned: ${[...pinned].join(", ") || "none"}`));
  detail.append(linkTable(inputs, "source", "strongest inputs"), linkTable(outputs, "target", "strongest outputs"),
                el("div", {id: "graph-heads", class: "note"}));
  const feature = Number(node.node_id.split("_")[1]);
  const sae = session.model.saes.find((s) => String(s.layer) === node.layer);
  if (node.feature_type.includes("transcoder") && sae) {
    const open = el("button", {type: "button", id: "graph-dashboard"}, `feature dashboard (${sae.name} #${feature})`);
    open.onclick = handle(() => openFeature(sae.name, feature, "graph-board"));
    detail.append(open);
  }
  detail.append(el("div", {id: "graph-board"}));
  drawGraph();
}

// An edge through attention, split over the heads that carry it (the file's per-link "heads").
function showHeads(link) {
  const box = $("graph-heads");
  box.replaceChildren(el("strong", {}, `${link.source} → ${link.target}: ${fmt(link.weight)}`));
  if (!link.heads || !Object.keys(link.heads).length) {
    box.append(el("p", {}, "this link has no per-head loadings in the file (it does not pass through attention)"));
    return;
  }
  const table = el("table", {class: "heads-table"});
  for (const [head, weight] of Object.entries(link.heads).sort((a, b) => Math.abs(b[1]) - Math.abs(a[1]))) {
    const row = el("tr");
    row.append(el("td", {}, head), el("td", {}, fmt(weight)));
    table.append(row);
  }
  box.append(table);
}
