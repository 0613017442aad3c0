// The attribution-graph view: a graph file in circuit-tracer's schema drawn by layer and position, pruned
// by influence, a node's strongest links and an edge's per-head loadings (a head clicked: the QK
// attributions of its pattern entries, the file's `qk_attributions`), a feature's dashboard; an aggregate of a
// graph store (`aggregate(store).to_json`): a node's values over the prompts, each prompt's graph a click away.
import {$, api, el, fmt, handle, session, svgEl} from "./common.js";
import {openFeature} from "./features.js";

export let GRAPH = null;
export const pinned = new Set();
// What another module adds to this view (supernodes.js: grouping): a node's extra classes and hover text,
// a shift-click, buttons in a node's detail, a graph just opened, a pin changed.
export const graphHooks = {classes: () => [], title: () => "", toggle: null, detail: () => {}, opened: async () => {},
                           pinned: () => {}};

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
  await graphHooks.opened(data);
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

// A node named by what it is: `L1 F159 @ "to"` (a feature: layer, index, position's token) and its label
// where it has one (`clerp`), `error L0 @ "John"`, `emb @ "When"`, `logit " Mary"`.
export function nodeName(node, tokens) {
  const at = `@ ${JSON.stringify(tokens[node.ctx_idx] ?? node.ctx_idx)}`;
  const index = node.node_id.split("_")[1];
  if (node.feature_type === "logit") {
    const quoted = /^Output "(.*)" \(p=/.exec(node.clerp || "");
    return `logit ${quoted ? JSON.stringify(quoted[1]) : node.logit_token !== undefined ? JSON.stringify(node.logit_token) : index}`;
  }
  if (node.feature_type === "embedding") return `emb ${at}`;
  if (node.feature_type === "mlp reconstruction error") return `error L${node.layer} ${at}`;
  return `L${node.layer} F${index} ${at}` + (node.clerp ? `: ${node.clerp}` : "");
}

const R = 6, PITCH = 2 * R + 4;  // a node's radius, and the distance between two nodes' centres in a cell
const KINDS = {embedding: "#16a34a", logit: "#111827", "mlp reconstruction error": "#9ca3af"};
const FEATURE = "#f59e0b";
export const EDGE_COLOURS = {positive: "#b2182b", negative: "#2166ac"};  // RdBu's ends, as the other views

// Layout: one row per layer (embeddings at the bottom, logits at the top), one column per position, wide
// enough for three nodes; the nodes of one layer and position fill their cell three across and stack up, the
// row as tall as its fullest cell. The SVG grows to fit (its box scrolls), so no two nodes ever overlap.
function layout(nodes, positions, rows, minWidth) {
  const cellW = Math.max(3 * PITCH + 4, (minWidth - 60) / positions);
  const across = Math.max(1, Math.floor((cellW - 4) / PITCH));
  const cells = new Map();
  for (const node of nodes) {
    const key = `${rowOf(node)}:${node.ctx_idx}`;
    if (!cells.has(key)) cells.set(key, []);
    cells.get(key).push(node);
  }
  const stack = new Map(rows.map((row) => [row, 1]));
  for (const [key, members] of cells) {
    const row = key.split(":")[0];
    const r = row === "Infinity" ? Infinity : +row;
    stack.set(r, Math.max(stack.get(r), Math.ceil(members.length / across)));
  }
  const rowTop = new Map();
  let y = 44;  // below the legend
  for (const row of [...rows].reverse()) {  // from the top (logits) down
    rowTop.set(row, y);
    y += Math.max(stack.get(row) * PITCH + 26, 64);
  }
  const at = new Map();
  for (const [key, members] of cells) {
    const [row, ctx] = key.split(":");
    const top = rowTop.get(row === "Infinity" ? Infinity : +row);
    const used = Math.min(across, members.length);
    members.forEach((node, i) => {
      const column = i % across, level = Math.floor(i / across);
      at.set(node.node_id, {x: 50 + +ctx * cellW + (cellW - used * PITCH) / 2 + (column + 0.5) * PITCH,
                            y: top + (level + 0.5) * PITCH});
    });
  }
  return {at, cellW, rowTop, stack, width: 60 + positions * cellW, height: y + 50};
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
  svg.replaceChildren();
  const tokens = data.metadata.prompt_tokens;
  const positions = Math.max(tokens.length, 1 + Math.max(...data.nodes.map((n) => n.ctx_idx)));
  const rows = [...new Set(data.nodes.map(rowOf))].sort((a, b) => a - b);
  const box = svg.parentNode.getBoundingClientRect().width || 760;
  const {at, cellW, rowTop, stack, width, height} = layout(nodes, positions, rows, Math.max(480, box - 4));
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  rows.forEach((row) => {
    const label = svgEl("text", {x: 4, y: rowTop.get(row) + stack.get(row) * PITCH / 2 + 4});
    label.textContent = row === 0 ? "emb" : row === Infinity ? "logit" : `L${row - 1}`;
    svg.append(label);
  });
  tokens.forEach((token, i) => {  // every position's token, cut to the column (the full text on hover)
    const room = Math.max(2, Math.floor(cellW / 6));
    const x = 50 + (i + 0.5) * cellW;
    const label = svgEl("text", {x, y: height - 40, "text-anchor": "end", transform: `rotate(-45 ${x} ${height - 40})`,
                                 class: "position"});
    label.textContent = token.length > room ? `${token.slice(0, room - 1)}…` : token;
    label.append(svgEl("title"));
    label.lastChild.textContent = `${i} ${JSON.stringify(token)}`;
    svg.append(label);
  });
  const top = Math.max(...links.map((l) => Math.abs(l.weight)), 1e-12);
  for (const link of links) {
    const a = at.get(link.source), b = at.get(link.target);
    svg.append(svgEl("line", {x1: a.x, y1: a.y, x2: b.x, y2: b.y, class: "link",
                              stroke: link.weight > 0 ? EDGE_COLOURS.positive : EDGE_COLOURS.negative,
                              "stroke-width": 0.3 + 3 * Math.abs(link.weight) / top, "stroke-opacity": 0.5}));
  }
  for (const node of nodes) {
    const p = at.get(node.node_id);
    const classes = ["node", pinned.has(node.node_id) ? "pinned" : "", GRAPH.selected === node.node_id ? "selected" : "",
                     ...graphHooks.classes(node)];
    const error = node.feature_type === "mlp reconstruction error";
    const mark = svgEl(error ? "rect" : "circle", {
      class: classes.join(" "), "data-id": node.node_id, fill: KINDS[node.feature_type] || FEATURE,
      ...(error ? {x: p.x - R + 1, y: p.y - R + 1, width: 2 * R - 2, height: 2 * R - 2} : {cx: p.x, cy: p.y, r: R})});
    mark.append(svgEl("title"));
    // its top examples (from a statistics result beside the graph, when there is one), the peak in brackets
    mark.firstChild.textContent = `${nodeName(node, tokens)} (${kindOf(node)}); influence ${fmt(node.influence)}` +
      (node.examples || []).map((text) => `\n${text}`).join("") + graphHooks.title(node);
    mark.onclick = (event) => (event.shiftKey && graphHooks.toggle ? graphHooks.toggle(node.node_id) : selectNode(node.node_id));
    svg.append(mark);
  }
  drawLegend(svg, 8, 18);
}

// What the colours mean: the nodes' kinds and the links' signs.
function drawLegend(svg, x, y) {
  const items = [["circle", FEATURE, "feature"], ["rect", KINDS["mlp reconstruction error"], "error"],
                 ["circle", KINDS.embedding, "embedding"], ["circle", KINDS.logit, "logit"],
                 ["line", EDGE_COLOURS.positive, "positive link (raises the target)"],
                 ["line", EDGE_COLOURS.negative, "negative link (lowers it)"]];
  const legend = svgEl("g", {class: "legend"});
  let at = x;
  for (const [shape, colour, text] of items) {
    legend.append(shape === "line" ? svgEl("line", {x1: at, y1: y - 4, x2: at + 16, y2: y - 4, stroke: colour, "stroke-width": 3})
      : shape === "rect" ? svgEl("rect", {x: at + 2, y: y - 9, width: 10, height: 10, fill: colour})
      : svgEl("circle", {cx: at + 7, cy: y - 4, r: 5, fill: colour}));
    const label = svgEl("text", {x: at + 20, y});
    label.textContent = text;
    legend.append(label);
    at += 30 + 6 * text.length;
  }
  svg.append(legend);
}

// The feature kind from the server (`feature_kind`: the transcoders it serves for this graph), else the file's.
const kindOf = (node) => node.feature_kind || node.feature_type;

function nodeLabel(node) {
  return `${nodeName(node, GRAPH.data.metadata.prompt_tokens)} [${kindOf(node)}]`;
}

function linkTable(links, end, title) {
  const table = el("table", {class: `links ${end}`});
  table.append(el("caption", {}, title));
  for (const link of links.slice(0, 10)) {
    const row = el("tr", {class: "link"});
    const other = GRAPH.byId.get(link[end]);
    row.dataset.id = link[end];
    row.append(el("td", {title: link[end]}, other ? nodeName(other, GRAPH.data.metadata.prompt_tokens) : link[end]),
               el("td", {}, fmt(link.weight)));
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
  pin.onclick = () => { pinned.has(id) ? pinned.delete(id) : pinned.add(id); selectNode(id); graphHooks.pinned(); };
  detail.append(pin);
  graphHooks.detail(node, detail);
  detail.append(el("span", {class: "note", id: "graph-pinned"}, ` pinned: ${[...pinned].join(", ") || "none"}`));
  if (node.spread) detail.append(spreadTable(node.spread));
  detail.append(linkTable(inputs, "source", "strongest inputs"), linkTable(outputs, "target", "strongest outputs"),
                el("div", {id: "graph-heads", class: "note"}));
  const feature = Number(node.node_id.split("_")[1]);
  const sae = session.model.saes.find((s) => String(s.layer) === node.layer);
  if (!["embedding", "logit", "mlp reconstruction error"].includes(node.feature_type) && sae) {
    const open = el("button", {type: "button", id: "graph-dashboard"}, `feature dashboard (${sae.name} #${feature})`);
    open.onclick = handle(() => openFeature(sae.name, feature, "graph-board"));
    detail.append(open);
  }
  detail.append(el("div", {id: "graph-board"}));
  drawGraph();
}

// An aggregate's node over the prompts (`aggregate(store).to_json`): how often it occurs, its influence and
// signed effect in each prompt; a prompt clicked opens that prompt's own graph.
function spreadTable(spread) {
  const stat = (name) => spread[name] ? `${fmt(spread[name].mean)} ± ${fmt(spread[name].sd)}` : "–";
  const box = el("div", {id: "graph-spread"});
  box.append(el("p", {class: "note"}, `in ${spread.count} of ${spread.n_graphs} prompts; influence ${stat("influence")}, ` +
    `effect ${stat("effect")}; absent in ${spread.absent.length}, reversed in ${spread.reversed.length}`));
  const table = el("table", {class: "spread-table"});
  table.append(el("caption", {}, "per prompt (click: open its graph)"));
  const values = spread.per_prompt;
  const at = new Map(values.graphs.map((g, i) => [g, i]));
  for (let g = 0; g < spread.n_graphs; g++) {
    const i = at.get(g);
    const row = el("tr", {class: i === undefined ? "prompt absent" : spread.reversed.includes(g) ? "prompt reversed" : "prompt",
                          "data-graph": String(g)});
    row.append(el("td", {}, `prompt ${g}`),
               el("td", {}, i === undefined ? "absent" : `influence ${fmt(values.influence[i])}`),
               el("td", {}, i === undefined ? "" : `effect ${fmt(values.effect[i])}`));
    row.onclick = handle(() => {
      $("graph-path").value = GRAPH.data.metadata.prompt_graphs[g];
      return openGraph();
    }, "graph-svg", "graph-detail", "graph-title", "graph-count");
    table.append(row);
  }
  box.append(table);
  return box;
}

// An edge through attention, split over the heads that carry it (the file's per-link "heads").
function showHeads(link) {
  const box = $("graph-heads");
  const name = (id) => (GRAPH.byId.has(id) ? nodeName(GRAPH.byId.get(id), GRAPH.data.metadata.prompt_tokens) : id);
  box.replaceChildren(el("strong", {}, `${name(link.source)} → ${name(link.target)}: ${fmt(link.weight)}`));
  if (!link.heads || !Object.keys(link.heads).length) {
    box.append(el("p", {}, "this link has no per-head loadings in the file (it does not pass through attention)"));
    return;
  }
  const table = el("table", {class: "heads-table"});
  for (const [head, weight] of Object.entries(link.heads).sort((a, b) => Math.abs(b[1]) - Math.abs(a[1]))) {
    const row = el("tr", {class: "head", "data-head": head});
    row.append(el("td", {}, head), el("td", {}, fmt(weight)));
    row.onclick = () => showQK(head);
    table.append(row);
  }
  box.append(table, el("div", {id: "graph-qk"}));
}

// Why a head attended where it did: each of its pattern entries the file has, the score split into
// (query-side node, key-side node) pairs, strongest first.
function showQK(head) {
  const box = $("graph-qk");
  const m = head.match(/^layers\.(\d+)\.self_attn\.head\.(\d+)$/);
  const entries = m ? (GRAPH.data.qk_attributions || []).filter((e) => e.layer === +m[1] && e.head === +m[2]) : [];
  box.replaceChildren(el("strong", {}, `QK attributions of ${head}`));
  if (!entries.length) {
    box.append(el("p", {}, "the file has no QK attribution for this head (attribute's qk= names the entries)"));
    return;
  }
  for (const e of entries) {
    const capped = e.capped_score === e.score ? "" : `, capped ${fmt(e.capped_score)}`;
    const table = el("table", {class: "qk-table"});
    table.append(el("caption", {}, `query ${e.query_pos} → key ${e.key_pos}: score ${fmt(e.score)}${capped}`));
    for (const pair of e.pairs.slice(0, 10)) {
      const row = el("tr");
      row.append(el("td", {}, pair.query), el("td", {}, pair.key), el("td", {}, fmt(pair.weight)));
      table.append(row);
    }
    box.append(table);
  }
}
