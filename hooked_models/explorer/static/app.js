// The explorer's page: six views over the server's JSON API (README "The explorer"). It draws what the
// server sends; every number comes from the library. Plotly draws heatmaps and curves; the two graphs
// (circuits, attribution) are plain SVG laid out by layer and position.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
let MODEL = null;

// ------------------------------------------------------------------------------------------ plumbing
async function api(path, body) {
  const options = body === undefined ? {} :
    {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const response = await fetch(path, options);
  // a crash outside our handlers answers plain text, not JSON: its status is the message then
  const data = await response.json().catch(() => ({error: `${response.status} ${response.statusText}`}));
  if (!response.ok) {
    // our handlers answer {"error": message}; FastAPI's own request validation answers {"detail": [...]}
    const detail = Array.isArray(data.detail) ? data.detail.map((d) => `${d.loc.join(".")}: ${d.msg}`).join("; ") : data.detail;
    throw new Error(data.error || detail || response.statusText);
  }
  return data;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// Run a form's work; a failure is a message in the page, never an uncaught error.
function handle(work) {
  return async (event) => {
    if (event) event.preventDefault();
    showError("");
    try { await work(); } catch (error) { showError(error.message); }
  };
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Start a background job and poll it, showing its progress (a bar, or a moving one when unknown).
async function runJob(path, body, barId) {
  const bar = $(barId);
  const {job} = await api(path, body);
  bar.hidden = false;
  try {
    for (;;) {
      const status = await api(`/api/jobs/${job}`);
      bar.classList.toggle("indeterminate", status.progress === null && status.state !== "done");
      bar.firstElementChild.style.width = status.progress === null ? "" : `${100 * status.progress}%`;
      bar.lastElementChild.textContent = `${status.kind}: ${status.state}, ${status.elapsed.toFixed(1)} s`;
      if (status.state === "done") return status.result;
      if (status.state === "error") throw new Error(status.error);
      await sleep(150);
    }
  } finally {
    bar.hidden = true;
  }
}

function el(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text) node.textContent = text;
  return node;
}

function svgEl(tag, attributes = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  return node;
}

const uniqueLabels = (tokens) => tokens.map((t, i) => `${i} ${t}`);
const fmt = (x) => (x === null || x === undefined ? "–" : Number(x).toPrecision(4));

// ------------------------------------------------------------------------------------------ tabs
function showView(name) {
  for (const button of document.querySelectorAll("#tabs button")) {
    button.classList.toggle("active", button.dataset.view === name);
  }
  for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== `view-${name}`;
  showError("");
  if (name === "features" || name === "graph") refreshFiles().catch((error) => showError(error.message));
}

// ------------------------------------------------------------------------------------------ prompt
async function runPrompt() {
  const answer = $("prompt-answer").value;
  const result = await api("/api/prompt", {prompt: $("prompt-text").value, top_k: 5, answer: answer || null});
  const strip = $("prompt-tokens");
  strip.replaceChildren();
  result.tokens.forEach((token, i) => {
    const box = el("span", {class: "prompt-token"});
    box.append(el("span", {class: "token"}, token));
    for (const guess of result.top[i].slice(0, 3)) box.append(el("small", {}, `${guess.token} ${(100 * guess.prob).toFixed(1)}%`));
    box.title = result.top[i].map((g) => `${JSON.stringify(g.token)} ${g.prob.toPrecision(4)}`).join("\n");
    strip.append(box);
  });
  Plotly.react("prompt-lens", [{
    type: "heatmap", z: result.lens_probs, x: uniqueLabels(result.tokens), y: result.lens_labels,
    customdata: result.lens_ranks, colorscale: "Viridis", zmin: 0, zmax: 1,
    hovertemplate: "%{y} at %{x}<br>p = %{z:.4f}, rank %{customdata}<extra></extra>",
  }], {title: {text: `logit lens: probability of ${JSON.stringify(result.answer)} by layer and position`},
      margin: {l: 80, b: 110}, xaxis: {tickangle: -60}}, {displayModeBar: false});
}

// ------------------------------------------------------------------------------------------ attention
let ATTENTION = null;
let HEAD = null;

async function runAttention() {
  ATTENTION = await api("/api/attention", {prompt: $("attention-text").value});
  const kinds = $("attention-kind");
  kinds.replaceChildren(el("option", {value: "patterns"}, "pattern"));
  if (ATTENTION.raw_scores) {
    kinds.append(el("option", {value: "scores"}, "scores after the soft cap"),
                 el("option", {value: "raw_scores"}, "scores before the soft cap"));
  }
  const group = ATTENTION.num_heads / ATTENTION.num_kv_heads;
  $("attention-note").textContent = (group > 1 ?
    `Grouped-query attention: ${group} query heads share each key/value head (dashed boxes).` :
    "Every head has its own keys and values.") + (ATTENTION.soft_cap ?
    ` Scores are soft-capped, ${ATTENTION.soft_cap}·tanh(s/${ATTENTION.soft_cap}), before the softmax; ` +
    "each position's MLP expert is fixed by its position (below)." : "");
  const heads = $("attention-heads");
  heads.replaceChildren();
  for (let layer = 0; layer < ATTENTION.num_layers; layer++) {
    const row = el("div", {class: "heads"});
    row.append(el("span", {}, `layer ${layer}`));
    for (let kv = 0; kv < ATTENTION.num_kv_heads; kv++) {
      const box = el("div", {class: "kv-group"});
      box.append(el("span", {}, `kv head ${kv}`));
      ATTENTION.kv_head.forEach((owner, head) => {
        if (owner !== kv) return;
        const button = el("button", {class: "head", id: `head-${layer}-${head}`, type: "button"}, `L${layer}H${head}`);
        button.onclick = () => drawHead(layer, head);
        box.append(button);
      });
      row.append(box);
    }
    heads.append(row);
  }
  const experts = $("attention-experts");
  experts.replaceChildren();
  if (ATTENTION.experts) {
    experts.append(el("span", {}, "expert (layer 0):"));
    const palette = ["#fde68a", "#bfdbfe", "#bbf7d0", "#fecaca", "#ddd6fe", "#fbcfe8"];
    ATTENTION.tokens.forEach((token, i) => {
      const expert = ATTENTION.experts[0][i];
      experts.append(el("span", {class: "token", style: `background:${palette[expert % palette.length]}`,
                                 title: `expert ${expert}`}, `${token}·${expert}`));
    });
  }
  drawHead(0, 0);
}

function drawHead(layer, head) {
  HEAD = [layer, head];
  for (const button of document.querySelectorAll(".head")) button.classList.remove("active");
  $(`head-${layer}-${head}`).classList.add("active");
  const kind = $("attention-kind").value;
  const matrix = ATTENTION[kind][layer][head];
  const labels = uniqueLabels(ATTENTION.tokens);
  Plotly.react("attention-plot", [{
    type: "heatmap", z: matrix, x: labels, y: labels, colorscale: kind === "patterns" ? "Blues" : "RdBu",
    hovertemplate: "query %{y}<br>key %{x}<br>%{z:.4f}<extra></extra>",
  }], {title: {text: `layer ${layer} head ${head} (kv head ${ATTENTION.kv_head[head]}): ${$("attention-kind").selectedOptions[0].text}`},
      yaxis: {autorange: "reversed"}, margin: {l: 110, b: 110}, xaxis: {tickangle: -60}}, {displayModeBar: false});
  for (const strip of ["attention-from", "attention-to"]) {
    const box = $(strip);
    box.replaceChildren();
    ATTENTION.tokens.forEach((token, i) => {
      const span = el("span", {class: "token", "data-index": i}, token);
      span.onmouseenter = () => highlight(i);
      box.append(span);
    });
  }
}

// Hovering token i: "attends to" colours each key by pattern[i][key]; "attended by" each query by pattern[query][i].
function highlight(i) {
  const pattern = ATTENTION.patterns[HEAD[0]][HEAD[1]];
  $("attention-from").querySelectorAll(".token").forEach((span, k) => {
    span.style.background = `rgba(37,99,235,${pattern[i][k]})`;
    span.title = `${pattern[i][k].toFixed(4)}`;
  });
  $("attention-to").querySelectorAll(".token").forEach((span, q) => {
    span.style.background = `rgba(220,38,38,${pattern[q][i]})`;
    span.title = `${pattern[q][i].toFixed(4)}`;
  });
}

// ------------------------------------------------------------------------------------------ pairs
const pair = (prefix) => ({clean: $(`${prefix}-clean`).value, corrupted: $(`${prefix}-corrupted`).value,
                           answer: $(`${prefix}-answer`).value, wrong: $(`${prefix}-wrong`).value});

function cartesian(lists) {
  return lists.reduce((rows, list) => rows.flatMap((row) => list.map((item) => [...row, item])), [[]]);
}

// ------------------------------------------------------------------------------------------ patching
async function runPatch() {
  const over = $("patch-over").value.trim();
  const result = await runJob("/api/patch", {...pair("patch"), value: $("patch-value").value,
                                             over: over ? over.split(/\s+/) : null}, "patch-progress");
  // Rows: every axis but the last (their labels joined); columns: the last axis, as PatchingResult.plot.
  const axes = result.axes;
  const last = axes.length ? result.labels[axes[axes.length - 1]] : [result.value];
  const rows = cartesian(axes.slice(0, -1).map((axis) => result.labels[axis])).map((row) => row.join(" ") || result.value);
  const flat = (x) => (Array.isArray(x) ? x.flat(Infinity) : [x]);
  const reshape = (values) => rows.map((_, r) => values.slice(r * last.length, (r + 1) * last.length));
  const raw = reshape(flat(result.values));
  const shown = result.normalized ? reshape(flat(result.normalized)) : raw;
  $("patch-summary").textContent = `${result.value} (${result.direction}) over ${axes.join(" × ") || "nothing"}: ` +
    `clean ${fmt(result.clean_metric)}, corrupted ${fmt(result.corrupted_metric)}` +
    (result.normalized ? "; colour: fraction restored (0 corrupted, 1 clean)" : "; colour: metric");
  const plot = $("patch-plot");
  await Plotly.react(plot, [{
    type: "heatmap", z: shown, customdata: raw, x: last, y: rows, colorscale: "RdBu", zmid: result.normalized ? 0 : undefined,
    hovertemplate: "%{y} %{x}<br>metric %{customdata:.5f}<br>shown %{z:.4f}<extra></extra>",
  }], {title: {text: `activation patching: ${result.value}`}, yaxis: {autorange: "reversed"},
      margin: {l: 120, b: 100}}, {displayModeBar: false});
  plot.removeAllListeners?.("plotly_hover");
  plot.on("plotly_hover", (event) => {
    const point = event.points[0];
    const [r, c] = point.pointIndex;
    const hover = $("patch-hover");
    hover.dataset.value = String(raw[r][c]);
    hover.dataset.row = r;
    hover.dataset.column = c;
    hover.textContent = `${rows[r]} ${last[c]}: activation_patch gives ${raw[r][c]}`;
  });
}

// ------------------------------------------------------------------------------------------ circuits
let CIRCUIT = null;

async function runCircuit() {
  CIRCUIT = {request: pair("circuit")};
  CIRCUIT.result = await runJob("/api/circuit", {...CIRCUIT.request, method: $("circuit-method").value}, "circuit-progress");
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

function drawCircuit() {
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

// ------------------------------------------------------------------------------------------ files
async function refreshFiles() {
  const harvests = $("harvests"), graphs = $("graph-files");
  harvests.replaceChildren();
  graphs.replaceChildren();
  const roots = (await api("/api/files")).entries;
  for (const root of roots) {
    const listed = [root, ...(await api(`/api/files?path=${encodeURIComponent(root.path)}`)).entries];
    for (const entry of listed) {
      if (entry.kind === "harvest") harvests.append(el("option", {value: entry.path}));
      if (entry.kind === "json") graphs.append(el("option", {value: entry.path}));
    }
  }
  if (!$("feature-harvest").value && harvests.firstChild) $("feature-harvest").value = harvests.firstChild.value;
}

// ------------------------------------------------------------------------------------------ features
async function openFeature(sae, feature, target = "feature-board") {
  const board = await runJob("/api/features/dashboard", {harvest: $("feature-harvest").value, sae, feature},
                             "feature-progress");
  renderBoard(board, $(target));
}

function renderBoard(board, container) {
  container.replaceChildren();
  container.append(el("h3", {}, `${board.sae}: feature ${board.feature}`),
    el("p", {class: "note"}, `${board.name}; active on ${(100 * board.density).toFixed(2)}% of ${board.tokens} tokens; ` +
       `max ${fmt(board.max_activation)}, mean when active ${fmt(board.mean_active)}`));
  const windows = el("div", {class: "windows"});
  for (const w of board.windows) {
    const line = el("div", {class: "window tokens", title: `window ${w.row}, peak at ${w.position}`});
    w.tokens.forEach((token, i) => {
      const a = w.activations[i];
      line.append(el("span", {class: "token", title: a.toPrecision(4),
                              style: `background: rgba(234,88,12,${Math.max(0, a) / (board.max_activation || 1)})`}, token));
    });
    windows.append(line);
  }
  container.append(el("h4", {}, "top-activating windows"), windows);
  if (!board.windows.length) container.append(el("p", {class: "note"}, "the feature never fires in this harvest"));
  const histogram = el("div", {class: "plot small"});
  container.append(histogram);
  const centres = board.counts.map((_, i) => (board.edges[i] + board.edges[i + 1]) / 2);
  Plotly.newPlot(histogram, [{type: "bar", x: centres, y: board.counts, marker: {color: "#ea580c"}}], {
    title: {text: "activations where active"}, xaxis: {title: {text: "activation"}}, yaxis: {title: {text: "tokens"}},
    margin: {l: 50, r: 10}}, {displayModeBar: false});
  const table = el("table");
  table.append(el("tr", {}, ""));
  table.firstChild.append(el("th", {}, "promotes"), el("th", {}, ""), el("th", {}, "suppresses"), el("th", {}, ""));
  board.promoted.forEach(([token, weight], i) => {
    const row = el("tr");
    const [down, downWeight] = board.suppressed[i] || ["", null];
    row.append(el("td", {}, JSON.stringify(token)), el("td", {}, fmt(weight)),
               el("td", {}, JSON.stringify(down)), el("td", {}, fmt(downWeight)));
    table.append(row);
  });
  container.append(el("h4", {}, "through the unembedding (W_dec · W_U)"),
                   board.logit_note ? el("p", {class: "note"}, board.logit_note) : table);
}

async function searchFeatures() {
  const sae = $("feature-sae").value;
  const result = await runJob("/api/features/search",
    {harvest: $("feature-harvest").value, sae, token: $("feature-token").value, k: 10}, "feature-progress");
  const found = $("feature-found");
  found.replaceChildren(el("span", {}, `features most active on ${JSON.stringify(result.token)}: `));
  found.className = "found";
  for (const f of result.features) {
    const button = el("button", {type: "button"}, `#${f.feature} (mean ${fmt(f.mean)})`);
    button.onclick = handle(() => openFeature(sae, f.feature));
    found.append(button);
  }
}

// ------------------------------------------------------------------------------------------ graph
let GRAPH = null;
const pinned = new Set();

async function openGraph() {
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

function drawGraph() {
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
    mark.firstChild.textContent = `${node.node_id} (${node.feature_type}) ${node.clerp}`;
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
  const sae = MODEL.saes.find((s) => String(s.layer) === node.layer);
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

// ------------------------------------------------------------------------------------------ start
async function start() {
  MODEL = await api("/api/model");
  $("model-name").textContent = `${MODEL.family}: ${MODEL.num_layers} layers, ${MODEL.num_heads} heads` +
    ` (${MODEL.num_kv_heads} key/value), hidden ${MODEL.hidden_size}`;
  $("values").replaceChildren(...MODEL.values.map((v) => el("option", {value: v})));
  $("feature-sae").replaceChildren(...MODEL.saes.map((s) => el("option", {value: s.name}, `${s.name} (${s.d_sae})`)));
  for (const button of document.querySelectorAll("#tabs button")) button.onclick = () => showView(button.dataset.view);
  $("prompt-form").onsubmit = handle(runPrompt);
  $("attention-form").onsubmit = handle(runAttention);
  $("attention-kind").onchange = () => HEAD && drawHead(...HEAD);
  $("patch-form").onsubmit = handle(runPatch);
  $("circuit-form").onsubmit = handle(runCircuit);
  $("circuit-k").oninput = () => CIRCUIT && drawCircuit();
  $("feature-form").onsubmit = handle(() => openFeature($("feature-sae").value, +$("feature-index").value));
  $("feature-search").onclick = handle(searchFeatures);
  $("graph-form").onsubmit = handle(openGraph);
  $("graph-threshold").oninput = () => GRAPH && drawGraph();
  await handle(runPrompt)();
}

start().catch((error) => showError(error.message));
