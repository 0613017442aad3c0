// The features view: a feature's dashboard over a harvest, and the features most active on a token.
import {$, api, el, fmt, handle, runJob, session} from "./common.js";

export async function refreshFiles() {
  const harvests = $("harvests"), graphs = $("graph-files");
  harvests.replaceChildren();
  graphs.replaceChildren();
  const roots = (await api("/api/files")).entries;
  for (const root of roots) {
    const listed = [root, ...(await api(`/api/files?path=${encodeURIComponent(root.path)}`)).entries];
    for (const entry of listed) {
      // a features.statistics result opens any feature at once, read from it
      if (entry.kind === "harvest" || entry.kind === "statistics") {
        harvests.append(el("option", {value: entry.path}));
        held.set(entry.path, entry.values || []);
      }
      if (entry.kind === "json") graphs.append(el("option", {value: entry.path}));
    }
  }
  fitHarvest();
}

// the values each listed harvest or statistics result holds, by path (from /api/files)
const held = new Map();

// The default harvest fits the chosen SAE: the first listed that holds its hook (a user's own choice stays).
export function fitHarvest() {
  const sae = (session.model?.saes || []).find((s) => s.name === $("feature-sae").value);
  const current = $("feature-harvest").value;
  if (current && !held.has(current)) return;  // typed in by the user
  if (current && sae && held.get(current).includes(sae.value)) return;
  const fits = [...held.keys()].find((path) => !sae || held.get(path).includes(sae.value));
  if (fits !== undefined) $("feature-harvest").value = fits;
}

// ------------------------------------------------------------------------------------------ features
// The server was started with no SAE and found none for its graphs: say what to do, not sae=''.
function needSae(sae) {
  if (!sae) throw new Error("this explorer serves no SAE or transcoder: start it with --sae DIR (or --data with " +
                            "graph files whose transcoders it can find)");
}

export async function openFeature(sae, feature, target = "feature-board") {
  needSae(sae);
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

export async function searchFeatures() {
  const sae = $("feature-sae").value;
  needSae(sae);
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
