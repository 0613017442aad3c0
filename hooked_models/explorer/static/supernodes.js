// The graph view's supernodes: nodes selected in the graph (shift-click, or "select" in a node's detail)
// grouped under a name, the graph of the parts (the server's Subgraph: each edge the sum of its members'
// edges), the interventions that test them as a job (measured beside the graph's prediction), and the
// subgraph saved into the graph file's qParams, as circuit-tracer's viewer saves it. The server computes
// every number (/api/subgraph/...: docs/guide/explorer.md); this module only keeps the page's choices.
import {$, api, clear, el, fmt, handle, runJob, showError, svgEl} from "./common.js";
import {EDGE_COLOURS, GRAPH, drawGraph, graphHooks, nodeName, pinned} from "./graph.js";

// supernodes: [[name, *node ids]] as qParams hold them; selection: the node ids chosen for the next group;
// view: the server's answer for them (parts, edges, kept influence); saved: whether the file holds them.
export const SUB = {supernodes: [], selection: new Set(), view: null, saved: true, table: null};

const owner = (id) => SUB.supernodes.find((s) => s.slice(1).includes(id))?.[0];

// ------------------------------------------------------------------------------ the graph view's hooks
graphHooks.classes = (node) => [owner(node.node_id) !== undefined ? "grouped" : "",
                                SUB.selection.has(node.node_id) ? "chosen" : ""];
graphHooks.title = (node) => (owner(node.node_id) !== undefined ? `\nsupernode: ${owner(node.node_id)}` : "");
graphHooks.toggle = (id) => {
  SUB.selection.has(id) ? SUB.selection.delete(id) : SUB.selection.add(id);
  showSelection();
  drawGraph();
};
graphHooks.detail = (node, detail) => {
  const choose = el("button", {type: "button", id: "graph-choose"},
                    SUB.selection.has(node.node_id) ? "unselect" : "select for a supernode");
  choose.onclick = () => { graphHooks.toggle(node.node_id); choose.textContent = SUB.selection.has(node.node_id) ? "unselect" : "select for a supernode"; };
  detail.append(choose);
};
graphHooks.pinned = () => {  // a pinned node is a part of its own: the part graph follows
  if (!GRAPH.data.whole_graph) return;
  SUB.saved = false;
  showSelection();
  refresh().catch((error) => showError(error.message));
};
graphHooks.opened = async (data) => {
  SUB.supernodes = data.qParams.supernodes.map((entry) => [...entry]);
  SUB.selection.clear();
  SUB.view = SUB.table = null;
  SUB.saved = true;
  clear($("intervention-plots"));
  clear($("intervention-table"));
  $("subgraph").hidden = !data.whole_graph;
  $("subgraph-unavailable").hidden = data.whole_graph;
  showSelection();
  if (data.whole_graph) await refresh();
};

// ------------------------------------------------------------------------------ requests
const body = () => ({path: $("graph-path").value, supernodes: SUB.supernodes, pinned: [...pinned]});

// Ask the server for the subgraph the page holds and draw it; a refusal leaves the page's groups as they were.
// Only the answer to the latest request is drawn: a pin's refresh answered after a grouping's must not undo it.
let asked = 0;
async function refresh(supernodes = SUB.supernodes, route = "/api/subgraph") {
  const mine = ++asked;
  const view = await api(route, {...body(), supernodes});
  if (mine !== asked) return view;
  SUB.supernodes = view.qParams.supernodes;
  for (const id of view.qParams.pinnedIds) pinned.add(id);  // a supernode's members are pinned (the viewer draws only those)
  SUB.view = view;
  drawSubgraph();
  drawGraph();
  return view;
}

export async function group() {
  const name = $("group-name").value.trim();
  const view = await refresh([...SUB.supernodes, [name, ...SUB.selection]]);  // refused (422): nothing changes
  SUB.selection.clear();
  SUB.saved = false;
  $("group-name").value = "";
  showSelection();
  return view;
}

export async function ungroup(name) {
  await refresh(SUB.supernodes.filter((entry) => entry[0] !== name));
  SUB.saved = false;
  showSelection();
}

export async function save() {
  await refresh(SUB.supernodes, "/api/subgraph/save");
  SUB.saved = true;
  showSelection();
}

// A subgraph saved in another copy of this graph's file (circuit-tracer's viewer saves into its own copy).
export async function importSubgraph() {
  const view = await api("/api/subgraph/import", {path: $("graph-path").value, source: $("subgraph-source").value});
  await refresh(view.qParams.supernodes.map((entry) => [...entry]));
  for (const id of view.qParams.pinnedIds) pinned.add(id);
  SUB.saved = false;
  showSelection();
}

// Scales as typed: numbers where they read as one, else the text itself, which the server names in its refusal.
function scales() {
  return $("intervention-scales").value.split(/[\s,]+/).filter((s) => s !== "")
    .map((s) => (Number.isFinite(Number(s)) ? Number(s) : s));
}

export async function runInterventions() {
  const modes = ["frozen", "free"].filter((mode) => $(`mode-${mode}`).checked);
  const answer = $("intervention-answer").value, wrong = $("intervention-wrong").value;
  const table = await runJob("/api/subgraph/interventions", {
    ...body(), scales: scales(), modes, logit_diff: answer || wrong ? [answer, wrong] : null,
    batch_size: +$("intervention-batch").value || null}, "intervention-progress");
  SUB.table = table;
  $("intervention-mode").replaceChildren(...table.modes.map((m) => el("option", {value: m}, m)));
  await drawInterventions();
}

// ------------------------------------------------------------------------------ drawing
function showSelection() {
  const tokens = GRAPH ? GRAPH.data.metadata.prompt_tokens : [];
  const names = [...SUB.selection].map((id) => (GRAPH?.byId.has(id) ? nodeName(GRAPH.byId.get(id), tokens) : id));
  $("group-selection").textContent = `selected: ${names.join("; ") || "none (shift-click nodes)"}`;
  $("group-selection").dataset.count = SUB.selection.size;
  $("subgraph-save").textContent = SUB.saved ? "saved in the graph file" : "save into the graph file";
  const list = $("supernode-list");
  list.replaceChildren(...SUB.supernodes.map(([name, ...ids]) => {
    const item = el("li", {class: "supernode", "data-name": name}, `${name} (${ids.length}): `);
    item.append(el("span", {class: "note"}, ids.map((id) => (GRAPH?.byId.has(id) ? nodeName(GRAPH.byId.get(id), tokens) : id)).join("; ")));
    const remove = el("button", {type: "button", class: "ungroup", title: `ungroup ${name}`}, "×");
    remove.onclick = handle(() => ungroup(name));
    item.prepend(remove);
    return item;
  }));
}

const BOX_W = 150, BOX_H = 30;

// The parts at their members' mean position (across) and layer (up: embeddings at the bottom, outputs on
// top), each edge between two parts an arrow as wide as its |weight|, red raising its target, blue lowering it.
function drawSubgraph() {
  const {parts, edges, kept, n_layers: layers, tokens} = SUB.view;
  const svg = $("subgraph-svg");
  svg.replaceChildren();
  $("subgraph-kept").textContent = parts.length ? `${parts.length} parts; the graph's influence on the targets kept: ` +
    `nodes ${fmt(kept.nodes)}, paths ${fmt(kept.paths)}` : "no pinned nodes or supernodes yet";
  if (!parts.length) return;
  const width = Math.max(760, 60 + tokens.length * 48), height = 60 + (layers + 2) * 70;
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  const x = (part) => 40 + (part.position + 0.5) / tokens.length * (width - 80);
  const y = (part) => height - 40 - part.row * ((height - 80) / (layers + 1));
  // parts of one row that would overlap are pushed apart along it, as Subgraph.plot does
  const at = parts.map((part) => ({x: x(part), y: y(part)}));
  const order = parts.map((_, k) => k).sort((a, b) => at[a].y - at[b].y || at[a].x - at[b].x);
  for (let i = 1; i < order.length; i++) {
    const a = at[order[i - 1]], b = at[order[i]];
    if (Math.abs(a.y - b.y) < BOX_H && b.x - a.x < BOX_W + 8) b.x = a.x + BOX_W + 8;
  }
  svg.setAttribute("width", Math.max(width, ...at.map((p) => p.x + BOX_W / 2 + 10)));
  const defs = svgEl("defs");
  for (const [sign, colour] of Object.entries(EDGE_COLOURS)) {
    const marker = svgEl("marker", {id: `arrow-${sign}`, viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 5,
                                    markerHeight: 5, orient: "auto-start-reverse"});
    marker.append(svgEl("path", {d: "M0,0 L10,5 L0,10 z", fill: colour}));
    defs.append(marker);
  }
  svg.append(defs);
  const off = [];
  edges.forEach((row, t) => row.forEach((w, s) => { if (t !== s && w !== 0) off.push([t, s, w]); }));
  const top = Math.max(...off.map(([, , w]) => Math.abs(w)), 1e-12);
  for (const [t, s, w] of off.sort((a, b) => Math.abs(a[2]) - Math.abs(b[2]))) {
    const sign = w > 0 ? "positive" : "negative";
    const line = svgEl("line", {x1: at[s].x, y1: at[s].y, x2: at[t].x, y2: at[t].y - (at[t].y < at[s].y ? -BOX_H / 2 : BOX_H / 2),
                                class: "part-edge", stroke: EDGE_COLOURS[sign], "stroke-opacity": 0.6,
                                "stroke-width": 0.5 + 6 * Math.abs(w) / top, "marker-end": `url(#arrow-${sign})`,
                                "data-source": parts[s].name, "data-target": parts[t].name, "data-weight": w});
    line.append(svgEl("title"));
    line.lastChild.textContent = `${parts[s].name} → ${parts[t].name}: ${fmt(w)}`;
    svg.append(line);
  }
  parts.forEach((part, k) => {
    const g = svgEl("g", {class: `part ${part.supernode ? "supernode" : "single"}`, "data-name": part.name});
    g.append(svgEl("rect", {x: at[k].x - BOX_W / 2, y: at[k].y - BOX_H / 2, width: BOX_W, height: BOX_H, rx: 6}));
    const label = svgEl("text", {x: at[k].x, y: at[k].y + 4, "text-anchor": "middle"});
    label.textContent = part.name.length > 24 ? `${part.name.slice(0, 23)}…` : part.name;
    g.append(label, svgEl("title"));
    g.lastChild.textContent = `${part.name}: influence ${fmt(part.influence)}\n${part.members.join("\n")}`;
    svg.append(g);
  });
}

// The standard figure for one mode: a panel per intervened part, each other part's and output's change
// measured (solid) beside the graph's prediction (hatched), one colour per scale; and the table under it.
export async function drawInterventions() {
  const {rows, descriptions} = SUB.table;
  const mode = $("intervention-mode").value;
  const shown = rows.filter((r) => r.mode === mode);
  $("intervention-note").textContent = `${mode}: ${descriptions[mode]}`;
  const box = $("intervention-plots");
  clear(box);
  const palette = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];
  for (const part of [...new Set(shown.map((r) => r.intervened))]) {
    const cell = shown.filter((r) => r.intervened === part);
    const scales = [...new Set(cell.map((r) => r.scale))];
    const traces = scales.flatMap((scale, i) => {
      const these = cell.filter((r) => r.scale === scale);
      const colour = palette[i % palette.length];
      return [{type: "bar", name: `×${scale} measured`, x: these.map((r) => r.outcome), y: these.map((r) => r.measured),
               marker: {color: colour}},
              {type: "bar", name: `×${scale} predicted`, x: these.map((r) => r.outcome), y: these.map((r) => r.predicted),
               marker: {color: "white", line: {color: colour, width: 1.5}, pattern: {shape: "/", fgcolor: colour}}}];
    });
    const plot = el("div", {class: "plot intervention", "data-part": part});
    box.append(plot);
    await Plotly.newPlot(plot, traces, {title: {text: `${part} scaled (${mode})`, font: {size: 13}}, barmode: "group",
                                        yaxis: {title: {text: "change"}}, margin: {t: 40, b: 90}},
                         {displayModeBar: false});
  }
  const table = $("intervention-table");
  table.replaceChildren(el("tr", {}, ""));
  table.firstChild.append(...["intervened", "scale", "outcome", "clean", "measured", "predicted"].map((h) => el("th", {}, h)));
  for (const r of shown) {
    const row = el("tr", {class: "intervention-row"});
    row.append(...[r.intervened, `×${r.scale}`, r.outcome, fmt(r.clean), fmt(r.measured), fmt(r.predicted)]
      .map((text) => el("td", {}, String(text))));
    table.append(row);
  }
}

export function wireSupernodes() {
  $("group-form").onsubmit = handle(group);
  $("subgraph-save").onclick = handle(save);
  $("subgraph-import").onclick = handle(importSubgraph);
  $("intervention-form").onsubmit = handle(runInterventions, "intervention-plots", "intervention-table");
  $("intervention-mode").onchange = () => SUB.table && drawInterventions().catch((error) => showError(error.message));
}
