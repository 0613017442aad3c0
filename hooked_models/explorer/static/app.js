// The explorer's page: six views over the server's JSON API (docs/guide/explorer.md), one module each. It
// draws what the server sends; every number comes from the library. Plotly draws heatmaps and curves; the
// two graphs (circuits, attribution) are plain SVG laid out by layer and position.
import {$, api, el, handle, session, showError, showQueue} from "./common.js";
import {runPrompt} from "./prompt.js";
import {HEAD, drawHead, runAttention} from "./attention.js";
import {runPatch} from "./patching.js";
import {CIRCUIT, drawCircuit, runCircuit} from "./circuits.js";
import {fitHarvest, openFeature, refreshFiles, searchFeatures} from "./features.js";
import {GRAPH, drawGraph, openGraph} from "./graph.js";
import {wireSupernodes} from "./supernodes.js";

// ------------------------------------------------------------------------------------------ tabs
function showView(name) {
  for (const button of document.querySelectorAll("#tabs button")) {
    button.classList.toggle("active", button.dataset.view === name);
  }
  for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== `view-${name}`;
  showError("");
  if (name === "features" || name === "graph") refreshFiles().catch((error) => showError(error.message));
}


// ------------------------------------------------------------------------------------------ start
async function start() {
  const MODEL = session.model = await api("/api/model");
  $("model-name").textContent = `${MODEL.family}: ${MODEL.num_layers} layers, ${MODEL.num_heads} heads` +
    ` (${MODEL.num_kv_heads} key/value), hidden ${MODEL.hidden_size}`;
  $("values").replaceChildren(...MODEL.values.map((v) => el("option", {value: v})));
  $("feature-sae").replaceChildren(...MODEL.saes.map((s) => el("option", {value: s.name}, `${s.name} (${s.d_sae})`)));
  for (const button of document.querySelectorAll("#tabs button")) button.onclick = () => showView(button.dataset.view);
  const promptViews = ["prompt-tokens", "prompt-lens"];
  $("prompt-form").onsubmit = handle(runPrompt, ...promptViews);
  $("attention-form").onsubmit = handle(runAttention, "attention-heads", "attention-from", "attention-to",
                                        "attention-experts", "attention-plot", "attention-note");
  $("attention-kind").onchange = () => HEAD && drawHead(...HEAD);
  $("patch-form").onsubmit = handle(runPatch, "patch-plot", "patch-summary", "patch-hover");
  $("circuit-form").onsubmit = handle(runCircuit, "circuit-svg", "circuit-curve", "circuit-count", "circuit-edge");
  $("circuit-k").oninput = () => CIRCUIT && drawCircuit();
  $("feature-form").onsubmit = handle(() => openFeature($("feature-sae").value, +$("feature-index").value),
                                      "feature-board");
  $("feature-search").onclick = handle(searchFeatures, "feature-found");
  // the graph file opened is kept in the address (#graph=path), so a reload opens it again, its supernodes too
  const openAndKeep = async () => { await openGraph(); history.replaceState(null, "", `#graph=${encodeURIComponent($("graph-path").value)}`); };
  $("graph-form").onsubmit = handle(openAndKeep, "graph-svg", "graph-detail", "graph-title", "graph-count");
  wireSupernodes();
  $("feature-sae").onchange = fitHarvest;
  $("graph-threshold").oninput = () => GRAPH && drawGraph();
  // the queue in the header, every job that runs or waits (whoever started it: another tab, a script)
  setInterval(() => showQueue().catch(() => {}), 1000);
  await handle(runPrompt, ...promptViews)();
  const kept = new URLSearchParams(location.hash.slice(1)).get("graph");
  if (kept) {
    showView("graph");
    $("graph-path").value = kept;
    await handle(openAndKeep, "graph-svg", "graph-detail", "graph-title", "graph-count")();
  }
}

start().catch((error) => showError(error.message));
