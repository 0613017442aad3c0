// The explorer's page: six views over the server's JSON API (README "The explorer"), one module each. It
// draws what the server sends; every number comes from the library. Plotly draws heatmaps and curves; the
// two graphs (circuits, attribution) are plain SVG laid out by layer and position.
import {$, api, el, handle, session, showError} from "./common.js";
import {runPrompt} from "./prompt.js";
import {HEAD, drawHead, runAttention} from "./attention.js";
import {runPatch} from "./patching.js";
import {CIRCUIT, drawCircuit, runCircuit} from "./circuits.js";
import {fitHarvest, openFeature, refreshFiles, searchFeatures} from "./features.js";
import {GRAPH, drawGraph, openGraph} from "./graph.js";

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
  $("prompt-form").onsubmit = handle(runPrompt);
  $("attention-form").onsubmit = handle(runAttention);
  $("attention-kind").onchange = () => HEAD && drawHead(...HEAD);
  $("patch-form").onsubmit = handle(runPatch);
  $("circuit-form").onsubmit = handle(runCircuit);
  $("circuit-k").oninput = () => CIRCUIT && drawCircuit();
  $("feature-form").onsubmit = handle(() => openFeature($("feature-sae").value, +$("feature-index").value));
  $("feature-search").onclick = handle(searchFeatures);
  $("feature-sae").onchange = fitHarvest;
  $("graph-form").onsubmit = handle(openGraph);
  $("graph-threshold").oninput = () => GRAPH && drawGraph();
  await handle(runPrompt)();
}

start().catch((error) => showError(error.message));
